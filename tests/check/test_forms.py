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
FORMS_PARALLEL = str(Path(__file__).with_name("forms_parallel.py"))  # imports fairscale
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
GEMMA2_CONFIG = {  # a scale (1/sqrt(4)) and a cap that matter at these sizes
    **LLAMA_CONFIG,
    "head_dim": 8,
    "query_pre_attn_scalar": 4,
    "attn_logit_softcapping": 1.0,
}
QWEN3_CONFIG = {**LLAMA_CONFIG, "head_dim": 8}
HF = (
    "FalconAttention",
    "Qwen3Attention",
    "Qwen3AttentionUnscaled",
    "LlamaAttention",
    "GPT2Attention",
    "LlamaAttentionDroppingItsCache",
    "Gemma2Attention",
    "Gemma2AttentionIgnoringItsCap",
    "LlamaAttentionInterleaved",
)
MINGPT = {"n_embd": 32, "n_head": 4, "block_size": 16, "attn_pdrop": 0.0, "resid_pdrop": 0.0}


def _check(capsys, name: str, init: dict) -> tuple[int, dict]:
    code, report = _report(capsys, name, init)
    return code, {result["name"]: result for result in report["results"]}


def _report(capsys, name: str, init: dict) -> tuple[int, dict]:
    file = {"ParallelAttention": FORMS_PARALLEL}.get(name, FORMS_HF if name in HF else FORMS)
    code = cli.main(["check", f"{file}:{name}", "--init", json.dumps(init), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("name", "init"),
    [
        ("MetaAttention", {}),  # ModelArgs(), forward(x, start_pos, freqs_cis, mask), .cuda()
        ("FastAttention", {}),  # FastArgs(), forward(x, freqs_cis real, mask, input_pos)
        ("MinGPTSelfAttention", MINGPT),  # an unannotated config read by attribute
        ("LlamaAttention", LLAMA_CONFIG),  # transformers' class, LlamaConfig, layer_idx
        ("GPT2Attention", GPT2_CONFIG),  # unannotated config: its module's GPT2Config
        ("Gemma2Attention", GEMMA2_CONFIG),  # its declared scale and score cap
        ("Qwen3Attention", QWEN3_CONFIG),  # per-head query and key norms
        ("FalconAttention", LLAMA_CONFIG),  # alibi=None, one key/value head, fused qkv
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
        ("FastAttention", {"n_local_heads": 2, "tile_bug": True}, "shared in the wrong order"),
        ("MetaAttention", {"offset_bug": True}, "do not continue from start_pos"),
        ("Qwen3AttentionUnscaled", QWEN3_CONFIG, "scale is missing"),
        ("LlamaAttentionInterleaved", LLAMA_CONFIG, "rotary convention is swapped"),
    ],
)
def test_a_planted_bug_in_each_form_is_named_first(capsys, name, init, words):
    if name in HF:
        pytest.importorskip("transformers")
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


def test_a_transformers_layer_dropping_its_cache_is_named(capsys):
    """transformers' attention classes are continued through a DynamicCache given under the
    cache parameter the installed release names (probed, not assumed): the real
    LlamaAttention continues (the parametrised pass above), this one does not."""
    pytest.importorskip("transformers")
    code, results = _check(capsys, "LlamaAttentionDroppingItsCache", LLAMA_CONFIG)
    reference = results["reference"]
    assert code == 1 and "DynamicCache as cache" in reference["observed"], reference
    assert "cached keys and values are not attended" in reference["causes"][0]


@pytest.mark.parametrize("cap", [1.0, None])  # None: Gemma 2's default, 50
def test_a_transformers_layer_dropping_its_declared_cap_is_named(capsys, cap):
    """A transformers class is held to the scale and cap its config declares (Gemma 2's
    query_pre_attn_scalar and attn_logit_softcapping): a copy that drops the cap fails,
    also at the default cap of 50, which changes nothing at unit inputs (the check scales
    them until it does)."""
    pytest.importorskip("transformers")
    config = GEMMA2_CONFIG if cap else {**LLAMA_CONFIG, "head_dim": 8}
    code, results = _check(capsys, "Gemma2AttentionIgnoringItsCap", config)
    reference = results["reference"]
    assert code == 1 and reference["status"] == "failed", reference
    assert "the scores are not capped" in reference["causes"][0], reference["causes"]


def test_a_file_of_an_installed_package_is_imported_by_its_name(capsys):
    """transformers' own modeling file, given by path as a user finds it: its relative
    imports resolve (imported as transformers.models.gpt2.modeling_gpt2)."""
    modeling = pytest.importorskip("transformers.models.gpt2.modeling_gpt2")
    target = f"{modeling.__file__}:GPT2Attention"
    code = cli.main(["check", target, "--init", json.dumps(GPT2_CONFIG), "--json"])
    report = json.loads(capsys.readouterr().out)
    results = {result["name"]: result for result in report["results"]}
    assert code == 0 and results["reference"]["status"] == "passed", results["reference"]


def test_the_merge_bug_is_named_once_with_its_line(capsys):
    """The located source cause and the reference's fitted bug are one cause: said once."""
    _, results = _check(capsys, "FastMergedWithoutTranspose", {})
    causes = results["reference"]["causes"]
    assert len(causes) == 1 and "forms.py:" in causes[0], causes
    assert results["causal"]["causes"][0] == causes[0], results["causal"]["causes"]


def test_model_parallel_layers_on_one_process(capsys):
    """Meta's form on fairscale's ColumnParallelLinear/RowParallelLinear: the check makes a
    one-process group (the constructor asserts one exists), fills the weights that
    init_method=identity leaves as uninitialised memory, and audits the layer; the report
    says both."""
    pytest.importorskip("fairscale")
    code, report = _report(capsys, "ParallelAttention", {})
    results = {result["name"]: result for result in report["results"]}
    assert code == 0, results
    assert "4 heads" in results["reference"]["observed"], results["reference"]["observed"]
    setup = " ".join(report["setup"])
    assert "model-parallel group" in setup and "wq.weight, wk.weight, wv.weight" in setup


def test_a_scale_bug_on_model_parallel_layers_is_named_first(capsys):
    pytest.importorskip("fairscale")
    code, results = _check(capsys, "ParallelAttention", {"scale_bug": True})
    assert code == 1 and "scale is missing" in results["reference"]["causes"][0]


def test_caches_the_forward_moves_are_not_blamed_for_a_dtype_error(capsys):
    """Meta's form with a softmax-dim bug that keeps the weights in float32: follows_to
    fails for the fixed dtype, and not on the caches it keeps as plain attributes (the
    forward moves them: self.cache_k.to(xq)); causal and reference name the softmax."""
    code, results = _check(capsys, "MetaSoftmaxOverQueries", {})
    follows = results["follows_to"]
    assert code == 1 and follows["status"] == "failed", follows
    said = " ".join([follows["observed"], *follows["causes"]])
    assert "plain tensor attributes: cache_k" not in said and ".float()" in said, said
    assert "not the cause" in follows["observed"], follows
    assert "softmax" in results["reference"]["causes"][0], results["reference"]
