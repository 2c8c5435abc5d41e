"""attnlab bench: the harness runs end to end on tiny sizes and its figures add up. No timing
is asserted (times on shared machines are noise): only that they exist and are consistent."""

import json
import math
import os
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import cli
from attnlab.bench import compare
from attnlab.bench.compare import MODES
from attnlab.bench.decode_peers import KVCACHE, PEER, STATIC
from attnlab.bench.memory import (
    CORE_BACKWARD_NAME,
    CORE_NAME,
    MEMORY_PEERS,
    peak_bytes,
    peak_method,
)

QUADRATIC = {  # the memory table's implementations that hold (t x t) scores
    "attnlab math",
    "nn.MultiheadAttention need_weights=True",
    "book MultiHeadAttention",
    "book MultiHeadAttentionWrapper",
}


def test_decode_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert cli.main(["bench", "--decode", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "KV cache against recomputing" in printed and "MQA" in printed
    report = json.loads(out.read_text())
    assert [row["context"] for row in report["rows"]] == [32, 128]
    weights = report["weight_bytes"]
    assert weights == 4 * 768 * 768 * 4 + 768 * 4  # fused qkv without bias, out_proj with
    for row in report["rows"]:
        assert row["cached_s"] > 0 and row["recompute_s"] > 0
        cache_read = 2 * row["context"] * 768 * 4  # keys and values of every token held
        _check_floor(row, weights + cache_read, _flops(weights, 1, row["context"]))
        assert row["cached_s"] / row["over_floor"] == pytest.approx(row["floor_s"])
    for row in report["cache_rows"]:
        # fused q, k, v rows (768 + 2 x kv x 64) without bias; out_proj with its bias
        layer = 4 * ((768 + 2 * row["num_kv_heads"] * 64) * 768 + 768 * 768 + 768)
        held = row["batch"] * row["context"] * row["bytes_per_token"]
        _check_floor(row, layer + held, _flops(layer, row["batch"], row["context"]))
        binds = "memory" if row["memory_floor_s"] >= row["compute_floor_s"] else "compute"
        assert row["binds"] == binds
    bandwidths = [row["read_bytes_per_s"] for row in report["rows"] + report["cache_rows"]]
    assert min(bandwidths) <= report["read_bytes_per_s"] <= max(bandwidths)
    per_token = {
        row["num_kv_heads"]: row["bytes_per_token"]
        for row in report["cache_rows"]
        if row["cache_dtype"] == "float32" and row["batch"] == 1
    }
    assert per_token == {12: 2 * 12 * 64 * 4, 4: 2 * 4 * 64 * 4, 1: 2 * 1 * 64 * 4}
    _check_static_peers(report["static_peers"])


def _flops(weight_bytes: int, batch: int, context: int) -> float:
    """A 768-wide, 12-head layer's step: 2 flops per float32 parameter and sequence, and 4 x
    heads x head_dim (768) per key held."""
    return batch * (2 * weight_bytes / 4 + 4 * 768 * context)


def _check_floor(row: dict, nbytes: float, flops: float) -> None:
    """A decode row's floor: max(bytes / bandwidth, flops / matmul rate), as measured."""
    memory, compute = nbytes / row["read_bytes_per_s"], flops / row["flops_per_s"]
    assert row["memory_floor_s"] == pytest.approx(memory)
    assert row["compute_floor_s"] == pytest.approx(compute)
    assert row["floor_s"] == pytest.approx(max(memory, compute))
    assert row["over_floor"] == pytest.approx(row["cached_s"] / max(memory, compute))


def _check_static_peers(peers):
    """The table against a static-cache SDPA layer: every implementation eager at every
    layout and context, each with its floor and its ratio to the SDPA layer's step."""
    assert (peers["device"], peers["layers"], peers["steps"], peers["notes"]) == ("cpu", 2, 2, [])
    assert peers["capacity"] == 128 + 2 and peers["compile_mode"] is None
    rows = {(r["num_kv_heads"], r["context"], r["implementation"]): r for r in peers["rows"]}
    names = (KVCACHE, STATIC, PEER)
    assert sorted(rows) == sorted((kv, c, n) for kv in (12, 4) for c in (32, 128) for n in names)
    for (kv, context, _), row in rows.items():
        assert row["skipped"] == "" and not row["compiled"]
        for key in ("step_s", "peer_s", "read_bytes_per_s", "floor_s", "over_floor", "vs_peer"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        weights = 768 * (768 + 2 * kv * 64) + 768 * 768 + 768  # fused qkv, out_proj with bias
        held = context + 0.5  # the mean of context and context + 1 tokens over the 2 steps
        assert row["bytes_read"] == 2 * (4 * weights + int(held * 2 * kv * 64 * 4))
        assert row["floor_s"] == pytest.approx(row["bytes_read"] / row["read_bytes_per_s"])
        assert row["over_floor"] == pytest.approx(row["step_s"] / row["floor_s"])
        assert row["peer_s"] == rows[kv, context, PEER]["step_s"]
        assert row["vs_peer"] == pytest.approx(row["step_s"] / row["peer_s"])


def test_compare_quick_end_to_end(tmp_path, capsys):
    figures, chart = tmp_path / "compare.json", tmp_path / "compare.png"
    assert cli.main(["bench", "--quick", "--json", str(figures), "--plot", str(chart)]) == 0
    printed = capsys.readouterr().out
    assert "Causal self-attention module, forward" in printed and "attention core" in printed
    report = json.loads(figures.read_text())
    b, t, d = report["batch"], report["tokens"], report["d_model"]
    assert (b, t, d, report["num_heads"]) == (1, 64, 64, 4)
    rows = report["rows"]
    module = {(row["mode"], row["name"]) for row in rows if row["table"] == "module"}
    names = {name for _, name in module}
    assert "attnlab auto" in names and "book MultiHeadAttentionWrapper" in names
    assert "nanoGPT SDPA" in names and "nn.MultiheadAttention need_weights=False" in names
    assert module == {(mode, name) for mode in MODES for name in names}  # every peer, both modes
    forward_flops = 8 * b * t * d**2 + 2 * b * t**2 * d
    for row in rows:
        assert row["skipped"] == "" and row["seconds"] > 0
        backward = 3 if row["mode"] == "forward+backward" else 1
        if row["table"] == "module":
            assert row["flops"] == backward * forward_flops
        else:  # the core: causal half, or the whole (t x t) without a mask
            causal = "no mask" not in row["name"]
            assert row["flops"] == backward * (2 if causal else 4) * b * t**2 * d
        assert row["flops_per_s"] == pytest.approx(row["flops"] / row["seconds"])
        group = [r for r in rows if (r["table"], r["mode"]) == (row["table"], row["mode"])]
        fastest = min(r["seconds"] for r in group)
        assert row["vs_fastest"] == pytest.approx(row["seconds"] / fastest)
        assert row["matmul_flops_per_s"] > 0
        assert row["of_matmul"] == pytest.approx(row["flops_per_s"] / row["matmul_flops_per_s"])
        if report["peak_method"] is not None:
            assert row["peak_bytes"] >= 0
    assert all(value > 0 for value in report["matmul_flops_per_s"].values())
    assert len(report["matmul_flops_per_s"]) == 4  # beside each mode of each table
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000


def test_memory_quick_end_to_end(tmp_path, capsys):
    figures = tmp_path / "memory.json"
    assert cli.main(["bench", "--memory", "--quick", "--json", str(figures)]) == 0
    assert "Peak memory by context length" in capsys.readouterr().out
    report = json.loads(figures.read_text())
    rows = {(row["name"], row["tokens"]): row for row in report["rows"]}
    assert {tokens for _, tokens in rows} == {256, 512}
    assert {name for name, _ in rows} == {*MEMORY_PEERS, CORE_NAME, CORE_BACKWARD_NAME}
    for (name, tokens), row in rows.items():
        assert row["io_bytes"] == 4 * tokens * 768 * 4  # q, k, v, out in float32, batch 1
        scores = 12 * tokens**2 * 4  # one float32 (b, h, t, t) tensor
        quadratic = name in QUADRATIC
        if quadratic and scores > report["max_bytes"]:  # 512 tokens under quick's 8 MiB
            assert row["needs_bytes"] == scores and row["peak_bytes"] is None
            assert "scores need 12.0 MiB" in row["skipped"]
        else:
            assert row["needs_bytes"] is None and row["skipped"] == ""
            if report["method"] is not None:
                assert row["ratio"] == pytest.approx(row["peak_bytes"] / row["io_bytes"])
    assert all(rows[name, 512]["needs_bytes"] for name in QUADRATIC)
    if report["method"] is not None:  # the scores show: the math backend holds more than SDPA
        math, sdpa = rows["attnlab math", 256], rows["attnlab sdpa", 256]
        assert math["peak_bytes"] > sdpa["peak_bytes"] + 12 * 256**2 * 4
        # the backward row holds the gradients of q, k and v (3 x 1.5 MiB at 512 tokens) too
        forward, backward = rows[CORE_NAME, 512], rows[CORE_BACKWARD_NAME, 512]
        assert backward["peak_bytes"] > forward["peak_bytes"] + 3 * 12 * 512 * 64 * 4


def test_peak_bytes_sees_a_large_temporary():
    """The peak counts memory that is freed before the call returns, and the result."""
    device = torch.device("cpu")
    if peak_method(device) is None:
        pytest.skip("no way to measure peak memory on this system")
    size = 64 * 2**20

    def call():
        temporary = torch.ones(size // 4)  # 64 MiB, freed on return
        return temporary[: size // 8].clone()  # 32 MiB kept

    assert peak_bytes(call, device) >= size + size // 2 - 2**20


def test_skipped_peer_is_a_row_not_a_crash(monkeypatch):
    """A peer that fails (FlexAttention without a compiler, say) is reported as skipped."""

    def broken(shape, weights):
        raise RuntimeError("no backend for this\nsecond line")

    peers = [*compare.module_peers(), compare.Peer("broken", broken)]
    monkeypatch.setattr(compare, "module_peers", lambda flex=False: peers)
    report = compare.run_compare(quick=True)
    rows = [row for row in report.rows if row.name == "broken"]
    assert [row.mode for row in rows] == list(MODES)
    assert all(row.seconds is None and row.peak_bytes is None for row in rows)
    assert all(row.skipped == "RuntimeError: no backend for this" for row in rows)


def test_bench_modes_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--decode", "--memory"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "float64"], "invalid choice: 'float64'"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--tokens", "0"], "expected an integer >= 1"),
        (["--batch", "x"], "expected an integer >= 1"),
        (["--plot", "chart.svg"], "give a file name ending in .png"),
        (["--plot", "no/such/folder/chart.png"], "does not exist"),
        (["--json", "no/such/folder/f.json"], "does not exist"),
        (["--memory", "--plot", "chart.png"], "--plot applies to the comparison only"),
        (
            ["--memory", "--tokens", "8"],
            "--tokens applies to the comparison, --parallel and --hf only",
        ),
        (["--decode", "--batch", "2"], "--batch applies to the comparison and --hf only"),
        (
            ["--kernel", "--dtype", "float16"],
            "--dtype applies to the comparison, --memory, --decode and --hf only",
        ),
        (["--padded", "--device", "cpu"], "--device applies to the comparison, --memory, --decode"),
        (["--contexts", "8,16"], "--contexts applies to --decode only"),
        (["--hf", "--contexts", "8,16"], "--contexts applies to --decode only"),
        (["--compile"], "--compile applies to --decode and --hf only"),
        (["--memory", "--compile"], "--compile applies to --decode and --hf only"),
        (["--hf", "--plot", "chart.png"], "--plot applies to the comparison only"),
        (["--hf", "--decode"], "argument --decode: not allowed with argument --hf"),
    ],
)
def test_bench_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
@pytest.mark.parametrize(
    "mode", [[], ["--memory"], ["--decode"], ["--decode", "--compile"], ["--hf"]]
)
def test_cuda_absent_is_a_usage_error(mode, capsys, no_measuring):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *mode, "--device", "cuda", "--dtype", "bfloat16", "--quick"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # one line, not a traceback
    assert last.startswith("attnlab: error: --device cuda: no CUDA device is available to")


def test_hf_without_transformers_is_a_usage_error(capsys, monkeypatch, no_measuring):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--hf", "--quick"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "bench --hf: transformers is not installed; install it with" in err


@pytest.mark.parametrize("contexts", ["1,2", "a", ""])
def test_bad_contexts_are_a_usage_error(contexts, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--decode", "--contexts", contexts])
    assert exit_info.value.code == 2
    assert "expected integers >= 2" in capsys.readouterr().err


def test_parallel_quick_end_to_end(tmp_path, capsys):
    from attnlab.bench.parallel import CONFIGS, PASSES, SINGLE

    out = tmp_path / "parallel.json"
    assert cli.main(["bench", "--parallel", "2", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Ring attention" in printed and "forward+backward" in printed
    report = json.loads(out.read_text())
    runs = [(SINGLE, step, 0) for step in PASSES]
    runs += [(label, step, rank) for label in CONFIGS for step in PASSES for rank in (0, 1)]
    assert [(r["label"], r["step"], r["rank"]) for r in report["rows"]] == runs
    tokens = 128
    for row in report["rows"]:
        chunk = 12 * (tokens // row["world"]) * 64 * 4  # bytes of one (1, 12, n, 64) float32
        assert row["input_bytes"] == (4 if row["step"] == "forward+backward" else 3) * chunk
        assert row["sent_bytes"] == (row["world"] - 1) * 2 * chunk
        assert row["total_bytes"] == row["input_bytes"] + row["call_peak_bytes"]
    scores = {(r["label"], r["rank"]): r["scores"] for r in report["rows"]}
    whole = 12 * tokens * (tokens + 1) // 2  # causal pairs of the whole sequence, 12 heads
    assert scores[SINGLE, 0] == whole
    for label in CONFIGS:  # every pair once, spread over the ranks
        assert scores[label, 0] + scores[label, 1] == whole
    contiguous, zigzag = "attnlab ring, contiguous", "attnlab ring, zigzag"
    assert scores[contiguous, 1] > 2 * scores[contiguous, 0]
    assert scores[zigzag, 0] == scores[zigzag, 1]
    for step in PASSES:
        rows = [r for r in report["rows"] if r["step"] == step]
        single = rows[0]["total_bytes"]
        for label in CONFIGS:
            worst = max(r["total_bytes"] for r in rows if r["label"] == label)
            assert report["memory_ratio"][step][label] == pytest.approx(worst / single)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallel", "1"], "at least 2 processes"),
        (["--parallel", "3", "--tokens", "9"], "must divide by twice --parallel 3"),
    ],
)
def test_parallel_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _never_run(*args, **kwargs):
    raise AssertionError("a refused bench run must not start measuring")


@pytest.fixture
def no_measuring(monkeypatch):
    """Any bench mode that starts measuring fails the test."""
    import attnlab.bench

    commands = ("compare_command", "memory_command", "decode_command", "parallel_command")
    for command in (*commands, "hf_command"):
        monkeypatch.setattr(attnlab.bench, command, _never_run)


@pytest.mark.parametrize(
    ("argv", "options"),
    [
        (["--tokens", "10000000", "--batch", "1000"], "--tokens 10000000 --batch 1000"),
        (["--tokens", "10000000"], "--tokens 10000000 --batch 2"),
        (["--batch", "100000000"], "--tokens 1024 --batch 100000000"),
        (["--decode", "--contexts", "100000000"], "--decode --contexts 100000000"),
        (["--decode", "--contexts", "256,100000000"], "--decode --contexts 100000000"),
        (["--parallel", "2", "--tokens", "400000000"], "--parallel 2 --tokens 400000000"),
        (["--parallel", "100000", "--quick"], "--parallel 100000 --tokens 6400000"),
        (["--hf", "--tokens", "100000", "--batch", "1000"], "--hf --tokens 100000 --batch 1000"),
    ],
)
def test_absurd_sizes_are_refused_before_running(argv, options, capsys, no_measuring):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"bench: {options} need about" in err and "available on this machine" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--quick"],
        ["--memory", "--quick"],
        ["--decode", "--quick"],
        ["--parallel", "2"],
        ["--hf", "--quick"],
    ],
)
def test_every_mode_is_refused_above_the_available_memory(argv, capsys, monkeypatch, no_measuring):
    from attnlab.bench import budget

    monkeypatch.setattr(budget, "available_bytes", lambda: 1024)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2
    assert "more than the 1.0 KiB available on this machine" in capsys.readouterr().err


@given(
    batch=st.integers(1, 64),
    tokens=st.integers(1, 1 << 16),
    more=st.integers(1, 1 << 10),
)
def test_estimates_hold_the_inputs_and_grow_with_the_sizes(batch, tokens, more):
    from attnlab.bench import budget

    sizes = budget.Sizes(batch, tokens, 768, 12, 4)
    longer = budget.Sizes(batch, tokens + more, 768, 12, 4)
    compare = budget.compare_bytes(sizes, matmul_size=2048)
    assert compare >= batch * tokens * 768 * 4  # at least the input (b, t, d) itself
    assert budget.compare_bytes(longer, matmul_size=2048) > compare or (
        sizes.score_bytes <= budget.MAX_SCORE_BYTES < longer.score_bytes  # peers now skipped
    )
    decode = budget.decode_bytes(tokens, d_model=768, layers=12, itemsize=4)
    assert decode >= 12 * 2 * tokens * 768 * 4  # every layer's keys and values
    assert budget.decode_bytes(tokens + more, d_model=768, layers=12, itemsize=4) > decode
    world = 2 + batch
    ring = budget.parallel_bytes(world, tokens, d_model=768, itemsize=4)
    assert ring >= world * budget.PROCESS_BYTES
    assert budget.parallel_bytes(world + more, tokens, d_model=768, itemsize=4) > ring


def test_available_memory_is_within_the_machine():
    from attnlab.bench import budget

    available = budget.available_bytes()
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert available is None or 0 < available <= total


def test_default_sizes_fit_a_small_machine():
    """The estimates do not refuse the usual runs on a machine with 8 GiB free."""
    from attnlab.bench import cli as bench_cli

    parser = cli.build_parser()
    for argv in (
        ["bench"],
        ["bench", "--decode"],
        ["bench", "--memory"],
        ["bench", "--parallel", "4"],
        ["bench", "--hf"],
    ):
        args = parser.parse_args(argv)
        needed, _ = bench_cli.estimate_bytes(args, bench_cli.mode_of(args))
        assert needed < 8 * 2**30, (argv, needed)


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_path_that_is_a_folder_is_a_usage_error(option, tmp_path, capsys, no_measuring):
    folder = tmp_path / "figures.png"
    folder.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--quick", option, str(folder)])
    assert exit_info.value.code == 2
    assert "is a folder, give a file name" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_output_folder_not_writable_is_a_usage_error(tmp_path, capsys, no_measuring):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["bench", "--decode", "--quick", "--json", str(folder / "out.json")])
    finally:
        folder.chmod(0o700)
    assert exit_info.value.code == 2
    assert "is not writable" in capsys.readouterr().err
