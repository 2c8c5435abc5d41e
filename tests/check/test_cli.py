"""`attnlab check FILE.py:ClassName`: exit 0 when every applicable property passes, 1 when
one fails, 2 for a usage error with a clear message; --json prints the report."""

import json
from pathlib import Path

import pytest

from attnlab import cli

ZOO = str(Path(__file__).with_name("zoo.py"))
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
        ([f"{ZOO}:BookCausalAttention", "--init", '{"d_in": 8}'], "raised TypeError"),
    ],
)
def test_usage_errors_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_file_that_fails_to_import_is_a_usage_error(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no such dependency')\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check", f"{broken}:Anything"])
    assert exit_info.value.code == 2
    assert "importing" in capsys.readouterr().err


def test_the_readme_example_seed_001(capsys):
    example = Path(__file__).parents[2] / "examples" / "seed001_causal_attention.py"
    code = cli.main(["check", f"{example}:CausalAttention", "--init", "[3, 2, 6, 0.0]", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and set(report["failed"]) == {"causal", "long_input", "reference"}
