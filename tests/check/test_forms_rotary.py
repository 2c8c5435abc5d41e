"""`attnlab check` with no adapter on forwards taking the model's rotary tables as separate
arguments (tests/check/forms_rotary.py): the book's Llama 3 and Qwen3
`GroupedQueryAttention.forward(x, mask, cos, sin)`, its fast `forward(x, cos, sin)`,
llama2.c's `forward(x, freqs_cos, freqs_sin)`; the tables and the mask built as those
models build them; query/key norms under any name and at any depth; a forward whose
arguments no convention names is reported by what it needs; a cfg dict beside a file's
one ...Args dataclass."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from attnlab import cli
from attnlab.check import arguments, audit
from attnlab.check.causes import mask_convention
from attnlab.check.probe import make_probe
from tests.check import forms_rotary

FILE = str(Path(__file__).with_name("forms_rotary.py"))
GQA = {"d_in": 32, "num_heads": 4, "num_kv_groups": 2}
QWEN3 = {**GQA, "head_dim": 16, "qk_norm": True}  # d_out 64, not d_in: Qwen3's head width
CFG = {"emb_dim": 32, "n_heads": 4, "n_kv_groups": 2, "context_length": 16, "rope_base": 1e4}


def _check(capsys, name: str, init: dict, *options: str) -> tuple[int, dict]:
    code = cli.main(["check", f"{FILE}:{name}", "--init", json.dumps(init), "--json", *options])
    return code, json.loads(capsys.readouterr().out)


def _results(report: dict) -> dict:
    return {result["name"]: result for result in report["results"]}


@pytest.mark.parametrize(
    ("name", "init", "given"),
    [
        ("GroupedQueryAttention", GQA, "mask, cos, sin"),  # the book's Llama 3
        ("GroupedQueryAttention", QWEN3, "mask, cos, sin"),  # Qwen3: norms with a `scale`
        ("GroupedQueryAttention", {**QWEN3, "norm": "weight"}, "mask, cos, sin"),
        ("FastGroupedQueryAttention", GQA, "cos, sin"),  # no mask argument
        ("Attention", {}, "freqs_cos, freqs_sin"),  # llama2.c, ModelArgs() from {}
    ],
)
def test_forwards_taking_cos_and_sin_are_audited_without_an_adapter(capsys, name, init, given):
    code, report = _check(capsys, name, init)
    results = _results(report)
    failed = {n: r["observed"] for n, r in results.items() if r["status"] in ("failed", "error")}
    assert code == 0 and not failed, failed
    assert f"forward given {given}, made as a model makes them" in report["setup"]
    reference = results["reference"]["observed"]
    assert results["reference"]["status"] == "passed" and "rotary (" in reference, reference
    if init.get("qk_norm"):
        assert "normed by the module's own norms" in reference, reference


@pytest.mark.parametrize(
    ("name", "init", "failing", "words"),
    [
        ("GroupedQueryAttention", {**GQA, "scale_bug": True}, "reference", "1/sqrt(d_out)"),
        ("GroupedQueryAttention", {**GQA, "rope_bug": True}, "reference", "keys are not rotated"),
        ("GroupedQueryAttention", {**QWEN3, "scale_bug": True}, "reference",
         "1/sqrt(d_out)"),
        ("FastGroupedQueryAttention", {**GQA, "merge_bug": True}, "reference",
         "no transpose(1, 2) first"),
        ("Attention", {"causal_bug": True}, "causal", "without is_causal=True"),
    ],
)  # fmt: skip
def test_a_planted_bug_in_each_table_form_is_named_first(capsys, name, init, failing, words):
    code, report = _check(capsys, name, init)
    result = _results(report)[failing]
    assert code == 1 and result["status"] == "failed", result
    assert words in result["causes"][0], result["causes"]


def _form(module, d_in: int, head_dim: int) -> dict:
    """The arguments the audit gives module's forward, by name (the form it runs with)."""
    probe = make_probe(module, d_in, None)
    assert probe.extra, "no arguments supplied"
    assert arguments.builders(probe.module, head_dim, True).needs == []
    return probe.extra


def test_the_tables_and_the_mask_are_the_ones_the_books_model_passes():
    """cos and sin equal compute_rope_params's rows (the angles written twice, halves), the
    mask the book model's triu(diagonal=1) bool, True where a key is hidden."""
    torch.manual_seed(0)
    form = _form(forms_rotary.GroupedQueryAttention(**GQA), 32, 8)
    x = torch.randn(2, 5, 32)
    cos, sin = forms_rotary.compute_rope_params(8, 10_000, 16)
    torch.testing.assert_close(form["cos"](x), cos[:5], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(form["sin"](x), sin[:5], rtol=1e-6, atol=1e-6)
    mask = form["mask"](x)
    assert mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1))


def test_the_half_width_tables_are_the_ones_llama2c_passes():
    torch.manual_seed(0)
    form = _form(forms_rotary.Attention(forms_rotary.ModelArgs()), 32, 8)
    x = torch.randn(2, 5, 32)
    freqs_cos, freqs_sin = forms_rotary.precompute_freqs_cis(8, 16)
    torch.testing.assert_close(form["freqs_cos"](x), freqs_cos[:5], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(form["freqs_sin"](x), freqs_sin[:5], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("s = s.masked_fill(mask, -torch.inf)", "blocked"),  # the book's models
        ("s = s.masked_fill(mask[:t, :t].bool(), -torch.inf)", "blocked"),
        ("s.masked_fill_(~mask, float('-inf'))", "allowed"),
        ("s = s.masked_fill(mask == 0, float('-inf'))", "allowed"),  # minGPT's reading
        ("hidden = mask[:, :, :t, :t]\n        s = s.masked_fill(hidden, -1e9)", "blocked"),
        ("hidden = mask.logical_not()\n        s = s.masked_fill(hidden, -1e9)", "allowed"),
        ("s = torch.where(mask, s, torch.finfo(s.dtype).min)", "allowed"),
        ("s = torch.where(mask, -torch.inf, s)", "blocked"),
        ("s = s + mask", "additive"),  # Meta's Llama
        ("s = F.scaled_dot_product_attention(s, s, s, attn_mask=mask)", None),  # either
    ],
)
def test_the_mask_convention_is_read_from_the_forward(tmp_path, source, expected):
    file = tmp_path / "reads_mask.py"
    file.write_text(
        "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def forward(self, x, mask):\n"
        "        t, s = x.shape[1], x\n"
        f"        {source}\n"
        "        return s\n"
    )
    namespace: dict = {}
    exec(compile(file.read_text(), str(file), "exec"), namespace)
    assert mask_convention(namespace["M"](), "mask") == expected


def test_a_forward_needing_unknown_arguments_says_which(capsys):
    """Not "fails or reshapes wrongly": the arguments are named, the module is not called,
    and the audit stops (exit 3) with the rest skipped for that reason."""
    code, report = _check(capsys, "CachedRotaryAttention", GQA)
    runs = _results(report)["runs"]
    assert code == 3 and runs["status"] == "error", runs
    assert "needs these arguments: rope_cache, segment_ids" in runs["observed"], runs
    assert "fails or reshapes" not in json.dumps(report)
    assert "needs these arguments" in report["exit"]["reason"]
    assert {r["status"] for r in report["results"][1:]} == {"skipped"}


def test_audit_reports_the_arguments_a_forward_needs():
    torch.manual_seed(0)
    report = audit(forms_rotary.CachedRotaryAttention(**GQA), d_in=32)
    assert report["runs"].status == "error" and report.incomplete is not None
    assert "rope_cache, segment_ids" in report["runs"].observed


def test_a_cfg_dict_beside_one_args_dataclass_is_a_dict(capsys):
    """The file's one ...Args dataclass (llama2.c's ModelArgs) does not take the book's cfg
    keys: the cfg is the dict-like config the class reads, said in the setup lines."""
    code, report = _check(capsys, "ConfiguredGroupedQueryAttention", CFG)
    assert code == 0, _results(report)
    setup = " ".join(report["setup"])
    assert "cfg built from --init as a ConfigDict" in setup and "ModelArgs" in setup


def test_an_annotated_dataclass_refusing_the_keys_is_still_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["check", f"{FILE}:Attention", "--init", json.dumps({"emb_dim": 32})])
    assert exited.value.code == 2
    assert "ModelArgs(**--init)" in capsys.readouterr().err


class _Adapter(nn.Module):
    """A wrapper as a user writes one: the Qwen3 layer one level down (its norms at
    `att.q_norm`), the tables and the mask made in the forward."""

    def __init__(self, norm="scale"):
        super().__init__()
        self.att = forms_rotary.GroupedQueryAttention(**QWEN3, norm=norm)
        cos, sin = forms_rotary.compute_rope_params(16, 10_000, 16)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.context_length = 16

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        return self.att(x, mask, self.cos, self.sin)


class _RenamedNorms(_Adapter):
    """The norms under other names (query_layernorm, norm_k), with a LayerNorm-like bias."""

    def __init__(self):
        super().__init__(norm="weight")
        self.att.query_layernorm = self.att.q_norm
        self.att.norm_k = self.att.k_norm
        del self.att.q_norm, self.att.k_norm
        self.att.q_norm = self.att.query_layernorm  # the forward's names, now aliases
        self.att.k_norm = self.att.norm_k


@pytest.mark.parametrize("make", [_Adapter, lambda: _Adapter("weight"), _RenamedNorms])
def test_query_and_key_norms_are_found_under_any_name_at_any_depth(make):
    torch.manual_seed(0)
    module = make()
    with torch.no_grad():  # norms of their own: a reference without them cannot match
        for norm in (module.att.q_norm, module.att.k_norm):
            next(norm.parameters()).uniform_(0.5, 1.5)
    result = audit(module)["reference"]
    assert result.status == "passed", result.observed
    assert "normed by the module's own norms" in result.observed


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("target", "init", "given"),
    [
        ("llama32.py:GroupedQueryAttention", {**GQA, "d_out": 32}, "mask, cos, sin"),
        ("llama32.py:GroupedQueryAttentionFast", {**GQA, "d_out": 32}, "cos, sin"),
        ("qwen3.py:GroupedQueryAttention", QWEN3, "mask, cos, sin"),
    ],
)
def test_the_recipes_book_layers_are_audited_without_an_adapter(capsys, target, init, given):
    """The book's layers as the repository's recipes hold them (examples/llama32.py,
    qwen3.py, the bonus chapters' code): no adapter, the reference passed."""
    code = cli.main(["check", str(EXAMPLES / target), "--init", json.dumps(init), "--json"])
    report = json.loads(capsys.readouterr().out)
    reference = _results(report)["reference"]
    assert code == 0 and reference["status"] == "passed", reference
    assert f"forward given {given}, made as a model makes them" in report["setup"]


class _KeywordTables(forms_rotary.GroupedQueryAttention):
    """The tables keyword-only, and a keyword-only argument no convention names."""

    def forward(self, x, *, cos, sin, segment_ids=None):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        return super().forward(x, mask, cos, sin)


class _KeywordSegments(forms_rotary.GroupedQueryAttention):
    def forward(self, x, *, segment_ids):
        return x


def test_keyword_only_arguments_are_supplied_or_named():
    torch.manual_seed(0)
    report = audit(_KeywordTables(**GQA), d_in=32)
    assert report.ok and report["reference"].status == "passed", report["reference"]
    report = audit(_KeywordSegments(**GQA), d_in=32)
    assert "needs these arguments: segment_ids" in report["runs"].observed
