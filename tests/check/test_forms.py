"""`attnlab check FILE:Class --init JSON` on the forms modern families publish (tests/check/
forms.py), with no adapter: a configuration object built from --init (a dataclass, an
attribute-read config, transformers' own config class), forward arguments the model would
pass (start_pos, freqs_cis real or complex, mask, input_pos, position_embeddings and
attention_mask), .cuda() in a constructor on a CPU-only machine. Each correct form exits 0
with the reference passed; each planted bug exits 1 with its cause named first."""

import json
from pathlib import Path

import pytest

from attnlab import cli

FORMS = str(Path(__file__).with_name("forms.py"))
FORMS_HF = str(Path(__file__).with_name("forms_hf.py"))  # imports transformers: its own file
LLAMA_CONFIG = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "vocab_size": 64,
    "max_position_embeddings": 16,
}
GPT2_CONFIG = {"n_embd": 32, "n_head": 4, "n_positions": 16, "n_layer": 1, "vocab_size": 64}
HF = ("LlamaAttention", "GPT2Attention")
MINGPT = {"n_embd": 32, "n_head": 4, "block_size": 16, "attn_pdrop": 0.0, "resid_pdrop": 0.0}


def _check(capsys, name: str, init: dict) -> tuple[int, dict]:
    file = FORMS_HF if name in HF else FORMS
    code = cli.main(["check", f"{file}:{name}", "--init", json.dumps(init), "--json"])
    report = json.loads(capsys.readouterr().out)
    return code, {result["name"]: result for result in report["results"]}


@pytest.mark.parametrize(
    ("name", "init"),
    [
        ("MetaAttention", {}),  # ModelArgs(), forward(x, start_pos, freqs_cis, mask), .cuda()
        ("FastAttention", {}),  # FastArgs(), forward(x, freqs_cis real, mask, input_pos)
        ("MinGPTSelfAttention", MINGPT),  # an unannotated config read by attribute
        ("LlamaAttention", LLAMA_CONFIG),  # transformers' class, LlamaConfig, layer_idx
        ("GPT2Attention", GPT2_CONFIG),  # unannotated config: its module's GPT2Config
    ],
)
def test_each_form_is_audited_without_an_adapter(capsys, name, init):
    if name in HF:
        pytest.importorskip("transformers")
    code, results = _check(capsys, name, init)
    failed = {
        n: (r["observed"], r["causes"]) for n, r in results.items() if r["status"] == "failed"
    }
    assert code == 0 and not failed, failed
    assert results["reference"]["status"] == "passed", results["reference"]["observed"]


@pytest.mark.parametrize(
    ("name", "init", "words"),
    [
        ("MetaAttention", {"scale_bug": True}, "scale is missing"),
        ("FastAttention", {"merge_bug": True}, "no transpose(1, 2) first"),
        ("MetaAttention", {"offset_bug": True}, "do not continue from start_pos"),
    ],
)
def test_a_planted_bug_in_each_form_is_named_first(capsys, name, init, words):
    code, results = _check(capsys, name, init)
    assert code == 1 and results["reference"]["status"] == "failed"
    assert words in results["reference"]["causes"][0], results["reference"]["causes"]


def test_a_gpt_returning_the_last_logits_alone_is_audited_as_a_model(capsys):
    """nanoGPT's GPT (examples/nanogpt.py): an unannotated config built as the file's own
    GPTConfig dataclass, and a forward returning only the last position's logits without
    targets, given the ids as targets so that it returns every position's."""
    example = Path(__file__).resolve().parents[2] / "examples" / "nanogpt.py"
    code = cli.main(["check", f"{example}:GPT", "--init", "{}", "--json"])
    report = json.loads(capsys.readouterr().out)
    results = {result["name"]: result["status"] for result in report["results"]}
    assert code == 0 and results["runs"] == results["causal"] == "passed", report
