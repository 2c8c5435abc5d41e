"""attnlab bench --hf: transformers models through attnlab against sdpa, end to end on tiny
configs, and the pair's checks before timing (a pair that differs or fails is a skipped
row). No timing is asserted: only that the figures exist and are consistent."""

import json
import math
from types import SimpleNamespace

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


def _measured(measure, callers, per=1, timing=None, dtype=torch.float32):
    row = hf.HFRow("m", measure, compiled=False)
    return hf._measured(row, callers, per, timing or {}, dtype)


def test_a_pair_whose_outputs_differ_is_skipped_untimed():
    logits = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    calls = []

    def sdpa():
        calls.append("sdpa")
        return logits

    row = _measured(hf.FORWARD, _callers(sdpa, lambda: logits * 1.1))
    assert row.ratio is None and calls == ["sdpa"]  # checked once, never timed
    assert row.skipped.startswith("differs from sdpa's by 0.1")


def _generated(ids, logits):
    """A generate output: sequences (b, t) and one (b, vocab) logits per new token."""
    return SimpleNamespace(sequences=torch.tensor(ids), logits=list(torch.tensor(logits)))


# prompt token 9, then 3 new tokens, each the argmax of its logits; a near-tie at the second
PROMPTED = ([[9, 1, 0, 1]], [[[0.0, 1.0]], [[0.5004, 0.5]], [[0.0, 1.0]]])


def test_identical_ids_pass_and_a_near_tie_is_timed_with_a_note():
    reference = _generated(*PROMPTED)
    assert hf.generation_differs(reference, reference, torch.float32) == ("", "")
    tied = _generated([[9, 1, 1, 1]], [[[0.0, 1.0]], [[0.5, 0.5005]], [[0.0, 1.0]]])
    problem, note = hf.generation_differs(tied, reference, torch.float32)
    assert problem == ""
    assert note.startswith("ids part from sdpa's at new token 1: a near-tie, the logits up to")


def test_ids_that_part_after_logits_that_differ_are_skipped():
    reference = _generated(*PROMPTED)
    apart = _generated([[9, 1, 1, 1]], [[[0.0, 1.0]], [[0.0, 1.0]], [[0.0, 1.0]]])
    problem, note = hf.generation_differs(apart, reference, torch.float32)
    assert note == ""
    assert problem == (
        "ids part from sdpa's at new token 1, after logits that differ by 0.5 of their "
        "largest value"
    )
    assert hf.generation_differs(apart, reference, torch.bfloat16)[0].startswith("ids part")
    shorter = _generated([[9, 1, 0]], PROMPTED[1][:2])
    assert hf.generation_differs(shorter, reference, torch.float32)[0] == (
        "generated (1, 3) ids against sdpa's (1, 4)"
    )


def test_a_pair_that_fails_to_compile_is_a_skipped_row():
    def broken():
        raise RuntimeError("backend failed\nsecond line")

    row = _measured(hf.FORWARD, _callers(lambda: torch.ones(1), broken))
    assert row.ratio is None and row.skipped == "RuntimeError: backend failed"


def test_agreeing_pairs_are_timed_per_token():
    reference = _generated(*PROMPTED)
    timing = {"rounds": 1, "min_run_time": 0.0}
    row = _measured(hf.GENERATE, _callers(lambda: reference, lambda: reference), 3, timing)
    assert row.skipped == "" and row.note == "" and row.sdpa_s > 0 and row.attnlab_s > 0


def test_a_run_stopped_midway_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """--json is rewritten after each row: a GPU run cut by its time limit keeps its rows."""
    measured = []

    def measure_twice(row, callers, per, timing, dtype):
        if len(measured) == 2:
            raise KeyboardInterrupt  # the run is stopped here
        measured.append(row)
        return row

    monkeypatch.setattr(hf, "_measured", measure_twice)
    out = tmp_path / "hf.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["bench", "--hf", "--quick", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(row["model"], row["measure"]) for row in rows] == [
        ("GPT-2, tiny", hf.FORWARD),
        ("GPT-2, tiny", hf.BACKWARD),
    ]
