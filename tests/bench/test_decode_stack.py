"""attnlab.bench.decode_stack: the back-to-back decode rows and their floors, checked against
the harness's definitions written out here (bytes, flops, which term binds)."""

import pytest

from attnlab.bench.decode_stack import StackSpec, default_specs, run_stack_decode

D, HEADS, KV, LAYERS, STEPS = 16, 2, 1, 2, 3


@pytest.fixture(scope="module")
def report():
    specs = [StackSpec(KV, 1, "float32", 8), StackSpec(KV, 2, "int8", 8)]
    return run_stack_decode(
        specs, d_model=D, num_heads=HEADS, layers=LAYERS, steps=STEPS,
        bandwidth_bytes=2**20, matmul_size=32,
    )  # fmt: skip


def test_bytes_and_flops_follow_the_harness_definitions(report):
    hd = D // HEADS
    params = D * (D + 2 * KV * hd) + D * D + D  # fused qkv, out_proj with its bias
    for row in report.rows:
        held = row.context + STEPS // 2  # tokens held at the median step
        assert row.weight_bytes == LAYERS * params * 4
        per_token = 2 * KV * hd * (4 if row.cache_dtype == "float32" else 1)
        scales = 0 if row.cache_dtype == "float32" else 2 * KV * 4  # int8: a scale per head
        assert row.cache_bytes == LAYERS * row.batch * held * (per_token + scales)
        attention = 4 * HEADS * hd * held
        assert row.flops == LAYERS * row.batch * (2 * params + attention)


def test_the_floor_is_the_larger_term_and_names_it(report):
    for row in report.rows:
        memory = (row.weight_bytes + row.cache_bytes) / row.read_bytes_per_s
        compute = row.flops / row.flops_per_s
        assert row.floor_s == pytest.approx(max(memory, compute))
        assert row.binds == ("memory" if memory >= compute else "compute")
        assert row.over_floor == pytest.approx(row.step_s / row.floor_s)
        assert len(row.steps_s) == STEPS and min(row.steps_s) <= row.step_s <= max(row.steps_s)
    raw = report.to_dict()["rows"]
    assert [r["binds"] for r in raw] == [row.binds for row in report.rows]


def test_the_default_rows_are_the_outside_harness():
    specs = default_specs(12)
    batch_one = {(s.num_kv_heads, s.context) for s in specs if s.batch == 1 and not s.latent}
    assert batch_one == {(h, c) for h in (12, 4, 1) for c in (256, 1024, 4096)}
    assert {s.cache_dtype for s in specs if (s.num_kv_heads, s.context) == (12, 4096)} == {
        "float32",
        "int8",
    }
    assert StackSpec(12, 8, "float32", 1024) in specs
    batch_eight = {(s.num_kv_heads, s.context) for s in specs if s.batch == 8}
    assert batch_eight == {(12, 1024)} | {(h, c) for h in (4, 1) for c in (256, 1024, 4096)}
    assert StackSpec(12, 1, "int8", 4096) in specs
    latent = {s.context for s in specs if s.latent and s.batch == 1}
    assert latent == {256, 1024, 4096}


def test_latent_rows_count_the_latent_cache_and_the_absorbed_step():
    """A latent-attention row: the cache holds kv_lora_rank + qk_rope_head_dim values per
    token and layer, and the attention term is the absorbed step's, per head and key
    2 (2 r + dr) (latent scores, rotary scores, latent values)."""
    from attnlab.bench.decode_stack import LATENT

    heads = 4
    (row,) = run_stack_decode(
        [StackSpec(heads, 1, "float32", 8, latent=True)], d_model=32, num_heads=heads,
        layers=LAYERS, steps=STEPS, bandwidth_bytes=2**20, matmul_size=32,
    ).rows  # fmt: skip
    r, dr = LATENT["kv_lora_rank"], LATENT["qk_rope_head_dim"]
    dn, dv = LATENT["qk_nope_head_dim"], LATENT["v_head_dim"]
    held = 8 + STEPS // 2
    assert row.layout == "latent"
    assert row.cache_bytes == LAYERS * held * (r + dr) * 4
    params = 32 * heads * (dn + dr) + 32 * (r + dr) + r + r * heads * (dn + dv)
    params += heads * dv * 32  # q_proj, kv_a_proj_with_mqa, its norm, kv_b_proj, o_proj
    assert row.weight_bytes == LAYERS * params * 4
    assert row.flops == LAYERS * (2 * params + 2 * heads * (2 * r + dr) * held)


def test_a_rows_bandwidth_is_the_median_of_the_probes_between_its_steps(monkeypatch):
    """A probe of the bandwidth before every PROBE_EVERY-th step; the row's bandwidth is
    their median (not one read after the row, which a burst of the host's bandwidth can
    meet alone)."""
    from attnlab.bench import decode_stack

    nbytes = 2**20
    probe_times = iter([4.0, 1.0, 2.0])  # seconds per read, one per probe
    monkeypatch.setattr(
        decode_stack, "_read_rate", lambda buffer, calls: nbytes / next(probe_times)
    )
    (row,) = run_stack_decode(
        [StackSpec(KV, 1, "float32", 8)], d_model=D, num_heads=HEADS, layers=LAYERS,
        steps=3 * decode_stack.PROBE_EVERY, bandwidth_bytes=nbytes, matmul_size=32,
    ).rows  # fmt: skip
    assert row.read_bytes_per_s == nbytes / 2.0
