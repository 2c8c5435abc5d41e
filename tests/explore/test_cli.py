"""`attnlab explore`: the chapter by default, a module the way `attnlab check` takes one,
a transformers model by path; usage errors exit 2; `attnlab demo` points to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab import cli, demo
from attnlab.explore.page import read_payload
from tests.explore import models

ROOT = Path(__file__).resolve().parents[2]


def test_the_chapter_by_default(tmp_path, capsys):
    out = tmp_path / "sub" / "chapter.html"
    assert cli.main(["explore", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "needs no network" in printed
    assert "3. MultiHeadAttention, 2 heads (seed 123): 1 x 2 maps of 6 x 6" in printed
    (data,) = read_payload(out.read_text(encoding="utf-8"))
    assert len(data["groups"]) == 3


def test_a_module_as_attnlab_check_takes_it(tmp_path, capsys):
    out = tmp_path / "seed.html"
    target = f"{ROOT / 'examples' / 'seed001_causal_attention.py'}:CausalAttention"
    code = cli.main(
        ["explore", target, "--init", "[3, 2, 6, 0.0]", "--text", "a b c", "-o", str(out)]
    )
    assert code == 0
    assert "attention: 1 x 1 maps of 3 x 3" in capsys.readouterr().out
    (data,) = read_payload(out.read_text(encoding="utf-8"))
    assert data["groups"][0]["queries"] == ["a", "b", "c"]


def test_a_transformers_model_by_path_with_a_cut(tmp_path, capsys):
    pytest.importorskip("transformers")
    models.tiny_gpt2().save_pretrained(tmp_path / "tiny")
    models.tokenizer().save_pretrained(tmp_path / "tiny")
    out = tmp_path / "gpt2.html"
    args = ["explore", "--hf", str(tmp_path / "tiny"), "--max-tokens", "4", "-o", str(out)]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "self-attention: 2 x 3 maps of 4 x 4" in printed
    assert "cut: inputs: 6 tokens, cut to the first 4" in printed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nofile.py:Cls"], "no such file: 'nofile.py'"),
        (["--init", "[1]"], "--init and --text need a target"),
        (["x.py:A", "--hf", "gpt2"], "either FILE.py:ClassName or --hf NAME"),
        (["--decoder-text", "a"], "--decoder-text applies to --hf"),
        (["--max-tokens", "0"], "expected an integer >= 1"),
        (["--precision", "12"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2_with_the_explore_usage(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["explore", *args, "-o", str(tmp_path / "x.html")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: attnlab explore" in err and message in err


def test_an_output_that_is_a_folder_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["explore", "-o", str(tmp_path)])
    assert "is a folder" in capsys.readouterr().err


def test_demo_points_to_the_explorer(tmp_path):
    lines: list[str] = []
    demo.run_demo(tmp_path, echo=lines.append)
    assert "attnlab explore -o attnlab-out/explore.html" in lines[-1]


def test_a_whole_model_through_its_sdpa_calls(tmp_path, capsys):
    """nanoGPT (examples/nanogpt.py) attends with F.scaled_dot_product_attention: each
    block's call is a layer, named after its module; text becomes hashed token ids."""
    out = tmp_path / "nano.html"
    init = '{"block_size": 32, "vocab_size": 100, "n_layer": 2, "n_head": 2, "n_embd": 16}'
    target = f"{ROOT / 'examples' / 'nanogpt.py'}:GPT"
    assert cli.main(["explore", target, "--init", init, "-o", str(out)]) == 0
    assert "attention: 2 x 2 maps of 6 x 6" in capsys.readouterr().out
    (data,) = read_payload(out.read_text(encoding="utf-8"))
    assert data["groups"][0]["layers"] == ["transformer.h.0.attn", "transformer.h.1.attn"]


def test_a_missing_transformers_model_is_a_usage_error(tmp_path, capsys):
    pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            ["explore", "--hf", str(tmp_path / "nothing-here"), "-o", str(tmp_path / "x.html")]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--hf '{tmp_path / 'nothing-here'}' is neither an existing path nor a model" in err


def test_a_model_raising_on_the_input_is_one_line_and_exit_1(tmp_path, capsys):
    """The seed's CausalAttention built for 2 tokens, given the chapter's 6 words: its own
    RuntimeError, said in one line, no traceback."""
    target = f"{ROOT / 'examples' / 'seed001_causal_attention.py'}:CausalAttention"
    args = ["explore", target, "--init", "[3, 2, 2, 0.0]", "-o", str(tmp_path / "x.html")]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the model raised RuntimeError:") and "Traceback" not in err
    assert not (tmp_path / "x.html").exists()


def test_an_output_that_cannot_be_written_is_a_usage_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["explore", "-o", str(blocker / "x.html")])
    assert exit_info.value.code == 2
    assert "cannot write it" in capsys.readouterr().err
