"""attnlab bench --hf: transformers models through attnlab against sdpa, end to end on tiny
configs, and the pair's checks before timing (a pair that differs or fails is a skipped
row). No timing is asserted: only that the figures exist and are consistent."""

import json
import math

import pytest
import torch

from attnlab import cli
from attnlab.bench import hf

pytest.importorskip("transformers")


def test_hf_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "hf.json"
    assert cli.main(["bench", "--hf", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "attn_implementation 'attnlab' against 'sdpa'" in printed and "generate" in printed
    report = json.loads(out.read_text())
    assert (report["device"], report["dtype"], report["compile_mode"]) == ("cpu", "float32", None)
    assert (report["batch"], report["tokens"], report["new_tokens"]) == (1, 32, 4)
    measures = [(row["model"], row["measure"], row["compiled"]) for row in report["rows"]]
    assert measures == [
        (model, measure, False)
        for model in ("GPT-2, tiny", "Llama, tiny, 4/2 heads")
        for measure in (hf.FORWARD, hf.BACKWARD, hf.GENERATE)
    ]
    for row in report["rows"]:
        assert row["skipped"] == ""
        for key in ("sdpa_s", "attnlab_s", "ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["ratio"] == pytest.approx(row["attnlab_s"] / row["sdpa_s"])


def _callers(sdpa, attnlab):
    return {hf.SDPA: sdpa, hf.ATTNLAB: attnlab}


def test_a_pair_whose_outputs_differ_is_skipped_untimed():
    logits = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    calls = []

    def sdpa():
        calls.append("sdpa")
        return logits

    row = hf._row("m", hf.FORWARD, False, _callers(sdpa, lambda: logits * 1.1), 1, {})
    assert row.ratio is None and calls == ["sdpa"]  # checked once, never timed
    assert row.skipped.startswith("differs from sdpa's by 0.1")


def test_generated_ids_must_be_identical():
    ids = torch.tensor([[5, 6, 7, 8]])
    other = torch.tensor([[5, 6, 9, 8]])
    row = hf._row("m", hf.GENERATE, True, _callers(lambda: ids, lambda: other), 4, {})
    assert row.skipped == "differs from sdpa's from token 2 on"


def test_a_pair_that_fails_to_compile_is_a_skipped_row():
    def broken():
        raise RuntimeError("backend failed\nsecond line")

    row = hf._row("m", hf.FORWARD, True, _callers(lambda: torch.ones(1), broken), 1, {})
    assert row.ratio is None and row.skipped == "RuntimeError: backend failed"


def test_agreeing_pairs_are_timed_per_token():
    ids = torch.tensor([[1, 2, 3]])
    timing = {"rounds": 1, "min_run_time": 0.0}
    row = hf._row("m", hf.GENERATE, False, _callers(lambda: ids, lambda: ids.clone()), 3, timing)
    assert row.skipped == "" and row.sdpa_s > 0 and row.attnlab_s > 0
