"""attnlab bench: the harness runs end to end on tiny sizes and its figures add up. No timing
is asserted (times on shared machines are noise): only that they exist and are consistent."""

import json

import pytest

from attnlab import cli


def test_decode_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert cli.main(["bench", "--decode", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "KV cache against recomputing" in printed and "multi-query" in printed
    report = json.loads(out.read_text())
    assert [row["context"] for row in report["rows"]] == [32, 128]
    weights = report["weight_bytes"]
    assert weights == 4 * 768 * 768 * 4 + 768 * 4  # fused qkv without bias, out_proj with
    for row in report["rows"]:
        assert row["cached_s"] > 0 and row["recompute_s"] > 0
        cache_read = 2 * row["context"] * 768 * 4  # keys and values of every token held
        assert row["floor_s"] == pytest.approx((weights + cache_read) / row["read_bytes_per_s"])
        assert row["over_floor"] == pytest.approx(row["cached_s"] / row["floor_s"])
    bandwidths = [row["read_bytes_per_s"] for row in report["rows"] + report["cache_rows"]]
    assert min(bandwidths) <= report["read_bytes_per_s"] <= max(bandwidths)
    per_token = {row["num_kv_heads"]: row["bytes_per_token"] for row in report["cache_rows"]}
    assert per_token == {12: 2 * 12 * 64 * 4, 4: 2 * 4 * 64 * 4, 1: 2 * 1 * 64 * 4}


def test_bench_needs_a_mode(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench"])
    assert exit_info.value.code == 2
    assert "--decode" in capsys.readouterr().err


@pytest.mark.parametrize("contexts", ["1,2", "a", ""])
def test_bad_contexts_are_a_usage_error(contexts, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--decode", "--contexts", contexts])
    assert exit_info.value.code == 2
    assert "expected integers >= 2" in capsys.readouterr().err
