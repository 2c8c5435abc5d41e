"""`attnlab check FILE.py:ClassName`: exit 0 when no property fails, 1 when one fails (with
--strict, warns or is skipped), 2 for a usage error with a clear message and the check
subcommand's usage, 3 when the audit could not finish; --json prints the report with the
exit code and its reason; a skipped property is printed with why."""

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnlab import cli
from attnlab.check.report import AuditReport, PropertyResult, exit_status

ZOO = str(Path(__file__).with_name("zoo.py"))
MODEL = str(Path(__file__).with_name("test_model.py"))
SINGLE = json.dumps({"d_in": 8, "d_out": 8, "context_length": 6, "dropout": 0.0})


def test_a_correct_class_exits_0(capsys):
    assert cli.main(["check", f"{ZOO}:BookCausalAttention", "--init", SINGLE]) == 0
    printed = capsys.readouterr().out
    assert "every applicable property passed" in printed and "BookCausalAttention" in printed


def test_a_buggy_class_exits_1_and_says_why(capsys):
    assert cli.main(["check", f"{ZOO}:NoUnderscoreMaskedFill", "--init", SINGLE]) == 1
    printed = capsys.readouterr().out
    assert "FAILED" in printed and "masked_fill" in printed


def test_positional_init_and_json(capsys):
    code = cli.main(["check", f"{ZOO}:MissingScale", "--init", "[8, 8, 6, 0.0]", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["ok"] is False and "reference" in report["failed"]
    assert report["d_in"] == 8 and report["context_length"] == 6
    assert report["exit"] == {"code": 1, "reason": f"1 failed: {', '.join(report['failed'])}"}
    assert {"name", "status", "observed", "causes"} <= set(report["results"][0])


def test_the_header_shows_the_d_in_of_init(tmp_path, capsys):
    # d_in read from --init, not from the first nn.Linear (which takes d_out)
    file = tmp_path / "wide.py"
    file.write_text(
        "import torch\nfrom torch import nn\n"
        "class Wide(nn.Module):\n"
        "    def __init__(self, d_model, block_size):\n"
        "        super().__init__()\n"
        "        self.up = nn.Linear(d_model, 2 * d_model)\n"
        "        self.block_size = block_size\n"
        "    def forward(self, x):\n"
        "        return self.up(x).cumsum(dim=1)\n"
    )
    init = json.dumps({"d_model": 6, "block_size": 5})
    assert cli.main(["check", f"{file}:Wide", "--init", init, "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    assert report["d_in"] == 6 and report["context_length"] == 5
    assert report["results"][0]["status"] == "passed"


def test_no_causal_skips_causality(capsys):
    args = ["check", f"{ZOO}:NoUnderscoreMaskedFill", "--init", SINGLE, "--no-causal", "--json"]
    cli.main(args)
    report = json.loads(capsys.readouterr().out)
    causal = next(r for r in report["results"] if r["name"] == "causal")
    assert causal["status"] == "skipped"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py:Foo"], "no such file"),
        ([f"{ZOO}"], "expected FILE.py:ClassName"),
        ([f"{ZOO}:NoSuchClass"], "no nn.Module class named 'NoSuchClass'"),
        ([f"{ZOO}:SINGLE"], "no nn.Module class named 'SINGLE'"),
        ([f"{ZOO}:BookCausalAttention", "--init", "{bad json"], "not valid JSON"),
        ([f"{ZOO}:BookCausalAttention", "--init", "3"], "JSON object or array"),
        ([f"{ZOO}:BookCausalAttention", "--init", '{"d_in": 8}'], "missing a required"),
        ([f"{ZOO}:BookCausalAttention", "--init", "[" * 30000 + "]" * 30000], "too deeply"),
        ([f"{ZOO}:BookCausalAttention", "--context-length", "-3"], "--context-length"),
        ([f"{ZOO}:BookCausalAttention", "--d-in", "0"], "--d-in: expected an integer >= 1"),
        ([f"{ZOO}:BookCausalAttention", "--timeout", "0"], "--timeout"),
        ([f"{ZOO}:BookCausalAttention", "--timeout", "nan"], "--timeout"),
        ([f"{ZOO}:BookCausalAttention", "--seed", "-1"], "--seed"),
    ],
)
def test_usage_errors_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("usage: attnlab check ")  # the subcommand's usage, not attnlab's


def test_an_input_width_not_found_names_the_option(tmp_path, capsys):
    file = tmp_path / "bare.py"
    file.write_text(
        "from torch import nn\nclass Bare(nn.Module):\n    def forward(self, x):\n"
        "        return x\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check", f"{file}:Bare"])
    assert exit_info.value.code == 2 and "--d-in" in capsys.readouterr().err


def test_a_file_that_fails_to_import_is_reported_exit_3(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no such dependency')\n")
    assert cli.main(["check", f"{broken}:Anything"]) == 3
    printed = capsys.readouterr().out
    assert "ImportError: no such dependency" in printed and "did not finish" in printed


def test_the_readme_example_seed_001(capsys):
    example = Path(__file__).parents[2] / "examples" / "seed001_causal_attention.py"
    code = cli.main(["check", f"{example}:CausalAttention", "--init", "[3, 2, 6, 0.0]", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and set(report["failed"]) == {"causal", "reference"}
    assert report["warnings"] == ["long_input"]  # its RuntimeError past context_length


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"context_length": -3}, ValueError, "context_length must be at least 1, got -3"),
        ({"d_in": 0}, ValueError, "d_in must be at least 1, got 0"),
        ({"d_in": 2.5}, TypeError, "d_in must be an int"),
        ({"causal": "yes"}, TypeError, "causal must be a bool"),
        ({"factory": 3}, TypeError, "factory must be callable"),
    ],
)
def test_audit_refuses_bad_arguments_by_name(kwargs, error, words):
    from attnlab.book import CausalAttention
    from attnlab.check import audit

    with pytest.raises(error, match=re.escape(words)):
        audit(CausalAttention(4, 4, 6, 0.0), **kwargs)


@given(
    statuses=st.lists(st.sampled_from(["passed", "failed", "warning", "skipped", "error"])),
    incomplete=st.sampled_from([None, "stopped"]),
    strict=st.booleans(),
)
def test_exit_status_follows_the_rules(statuses, incomplete, strict):
    results = [PropertyResult(f"p{i}", "t", s) for i, s in enumerate(statuses)]
    report = AuditReport("M", True, 4, None, results, incomplete=incomplete)
    code, reason = exit_status(report, strict)
    skipped = [r.name for r in results if r.status == "skipped"]
    if incomplete or "error" in statuses:
        assert code == 3 and "did not finish" in reason
    elif "failed" in statuses or (strict and {"warning", "skipped"} & set(statuses)):
        assert code == 1 and "failed" in reason
        if strict and skipped:
            assert f"the skipped: {', '.join(skipped)}" in reason
    else:
        assert code == 0 and "passed" in reason
        if skipped:
            assert f"{len(skipped)} skipped: {', '.join(skipped)}" in reason


def test_strict_forgives_only_the_causal_skip_that_no_causal_asked_for():
    results = [PropertyResult("causal", "t", "skipped"), PropertyResult("runs", "t", "passed")]
    assert exit_status(AuditReport("M", False, 4, None, results), strict=True)[0] == 0
    assert exit_status(AuditReport("M", True, 4, None, results), strict=True)[0] == 1
    results.append(PropertyResult("reference", "t", "skipped"))
    code, reason = exit_status(AuditReport("M", False, 4, None, results), strict=True)
    assert code == 1 and reason.endswith("(--strict counts the skipped: reference)")


def test_skipped_properties_are_printed_with_why_and_fail_strict(capsys, monkeypatch):
    # the tiny GPT takes no attention_mask and no cache: left_padding and kv_cache skip
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    target = [f"{MODEL}:TinyGPTFile", "--init", '{"vocab_size": 40, "context_length": 8}']
    assert cli.main(["check", *target]) == 0
    printed = capsys.readouterr().out
    assert "2 skipped: left_padding, kv_cache" in printed
    row = next(line for line in printed.splitlines() if line.startswith("│ kv_cache"))
    assert "skipped" in row and "the forward takes no cache argument" in row

    assert cli.main(["check", *target, "--strict", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["skipped"] == ["left_padding", "kv_cache"] and report["failed"] == []
    assert report["exit"] == {
        "code": 1,
        "reason": "2 failed: left_padding, kv_cache (--strict counts the skipped: "
        "left_padding, kv_cache)",
    }
    kv_cache = next(r for r in report["results"] if r["name"] == "kv_cache")
    assert kv_cache["status"] == "skipped" and "no cache argument" in kv_cache["observed"]
