"""attnlab.bench.decode_peers and the static-cache SDPA peer: the peer computes attnlab's
function, rows are checked before they are timed, the compiled and static rows appear where
they apply. No timing is asserted."""

import sys

import pytest
import torch

from attnlab.attention import MultiHeadAttention
from attnlab.bench import decode_peers
from attnlab.bench.decode_peers import KVCACHE, NO_STATIC, PEER, STATIC, run_decode_peers
from attnlab.bench.peers import StaticCacheSDPA, StaticCacheSDPAStack

TINY = {
    "d_model": 32,
    "num_heads": 4,
    "kv_heads": (4, 2),
    "layers": 2,
    "steps": 2,
    "rounds": 1,
    "min_run_time": 0.0,
    "read_bytes": 2**20,
}


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_static_sdpa_layer_computes_attnlabs_attention(kv_heads):
    """Prompt and two decode steps, batch 2: the peer equals attnlab's module with its cache
    (the peer really is the same function, so that its time is comparable)."""
    torch.manual_seed(0)
    module = MultiHeadAttention(32, 32, 16, 0.0, 4, num_kv_heads=kv_heads).eval()
    peer = StaticCacheSDPAStack([StaticCacheSDPA(module, 2, 16)])
    cache = module.make_cache(2, 16)
    x = torch.randn(2, 7, 32)  # (b, t, d)
    with torch.no_grad():
        for positions in (range(5), [5], [6]):
            tokens = x[:, positions[0] : positions[-1] + 1]
            expected = module(tokens, cache=cache)
            got = peer(tokens, torch.tensor(list(positions)))
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert peer.layers[0].k_cache.shape == (2, kv_heads, 16, 8)


def _rows(report):
    return {(r.num_kv_heads, r.context, r.implementation, r.compiled): r for r in report.rows}


def test_compiled_rows_are_the_static_stacks_beside_the_compiled_peer(monkeypatch):
    """The plumbing of compile=True (torch.compile replaced by the identity: compiling
    itself is minutes on a CPU): compiled rows for the two static stacks, none for
    KVCache, each compared with the compiled peer."""
    compiled = []

    def fake_compile(fn, **options):
        compiled.append(options)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    report = run_decode_peers((8, 16), compile=True, **TINY)
    assert compiled == [{"mode": "reduce-overhead", "fullgraph": True}] * 4  # 2 per layout
    rows = _rows(report)
    eager = {(kv, c, n, False) for kv in (4, 2) for c in (8, 16) for n in (KVCACHE, STATIC, PEER)}
    assert set(rows) == eager | {(kv, c, n, True) for kv, c, n, _ in eager if n != KVCACHE}
    assert report.compile_mode == "reduce-overhead"
    for (kv, context, _, is_compiled), row in rows.items():
        assert row.skipped == "" and row.step_s > 0
        assert row.peer_s == rows[kv, context, PEER, is_compiled].step_s


def test_a_peer_that_computes_something_else_is_skipped_untimed(monkeypatch):
    forward = StaticCacheSDPA.forward

    def wrong(self, x, input_pos, mask):
        return forward(self, x, input_pos, mask) + 1.0

    monkeypatch.setattr(StaticCacheSDPA, "forward", wrong)
    report = run_decode_peers((8,), **{**TINY, "kv_heads": (2,)})
    rows = _rows(report)
    skipped = rows[2, 8, PEER, False]
    assert skipped.step_s is None and skipped.over_floor is None
    assert skipped.skipped.startswith(f"differs from {KVCACHE}'s by ")
    assert rows[2, 8, STATIC, False].vs_peer is None  # nothing to compare with
    assert rows[2, 8, STATIC, False].step_s > 0


def test_without_a_static_cache_its_rows_are_omitted_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "attnlab.static_cache", None)  # import: ImportError
    assert not decode_peers.static_cache_available()
    report = run_decode_peers((8,), **{**TINY, "kv_heads": (2,)})
    assert [r.implementation for r in report.rows] == [KVCACHE, PEER]
    assert report.notes == [NO_STATIC]
    assert report.to_dict()["notes"] == [NO_STATIC]


def test_the_floor_counts_the_weights_and_the_mean_step_s_cache():
    torch.manual_seed(0)
    modules = [MultiHeadAttention(32, 32, 64, 0.0, 4, num_kv_heads=2) for _ in range(3)]
    weights = 32 * (32 + 2 * 16) + 32 * 32 + 32  # fused qkv, out_proj with bias
    # 4 steps from context 10: 10, 11, 12, 13 tokens, 11.5 on average, keys and values
    expected = 3 * 4 * (weights + 11.5 * 2 * 16)
    assert decode_peers.bytes_read(modules, 10, 4) == expected
