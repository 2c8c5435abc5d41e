"""attnlab check on whole causal language models: a tiny GPT as the chapter's reader builds
next (token and position embeddings, blocks of attention and a feed-forward with LayerNorm,
a head), its buggy copies (one bidirectional layer; a sequence-wide mean), a tiny
Hugging Face GPT-2 and Llama built from a config (attention_mask, position_ids and a KV
cache, found under whatever name the installed transformers gives it), wrappers that take
the cache under other names, and a Llama whose cached positions restart at 0."""

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import attnlab
from attnlab import cli
from attnlab.check.model import audit_model, find_cache_argument, takes_token_ids

HERE = str(Path(__file__))
CFG = {"vocab_size": 50, "context_length": 16, "emb_dim": 16, "n_heads": 2, "n_layers": 2}


class HandCausalAttention(nn.Module):
    """Single-head causal attention written by hand; causal=False makes it bidirectional."""

    def __init__(self, d, causal=True):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.causal = causal

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (b, t, d)
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5  # (b, t, t)
        if self.causal:
            t = x.shape[1]
            future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
            scores = scores.masked_fill(future, -torch.inf)
        return torch.softmax(scores, dim=-1) @ v


class SequenceMean(nn.Module):
    """Adds the mean over the whole sequence: a statistic that leaks the future."""

    def forward(self, x):
        return x + x.mean(dim=1, keepdim=True)


class Block(nn.Module):
    def __init__(self, cfg, attention):
        super().__init__()
        d = cfg["emb_dim"]
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.att = attention
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.att(self.norm1(x))
        return x + self.ff(self.norm2(x))


class TinyGPT(nn.Module):
    """The chapter's next step: a GPT of attnlab.MultiHeadAttention blocks."""

    def __init__(self, cfg):
        super().__init__()
        d, ctx = cfg["emb_dim"], cfg["context_length"]
        self.tok_emb = nn.Embedding(cfg["vocab_size"], d)
        self.pos_emb = nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[Block(cfg, self.attention(cfg, i)) for i in range(2)])
        self.final_norm = nn.LayerNorm(d)
        self.out_head = nn.Linear(d, cfg["vocab_size"], bias=False)

    def attention(self, cfg, layer):
        d, ctx = cfg["emb_dim"], cfg["context_length"]
        return attnlab.MultiHeadAttention(d, d, ctx, 0.0, cfg["n_heads"])

    def forward(self, in_idx):
        t = in_idx.shape[1]
        positions = torch.arange(t, device=in_idx.device)
        x = self.tok_emb(in_idx) + self.pos_emb(positions)  # (b, t, d)
        return self.out_head(self.final_norm(self.blocks(x)))  # (b, t, vocab)


class HandGPT(TinyGPT):
    """Correct too: hand-written causal attention."""

    def attention(self, cfg, layer):
        return HandCausalAttention(cfg["emb_dim"])


class OneBidirectionalLayer(TinyGPT):
    """Bug: the second block's attention has no causal mask."""

    def attention(self, cfg, layer):
        return HandCausalAttention(cfg["emb_dim"], causal=layer != 1)


class SequenceMeanGPT(TinyGPT):
    """Bug: the first block's attention is followed by a mean over the sequence."""

    def attention(self, cfg, layer):
        attention = HandCausalAttention(cfg["emb_dim"])
        return nn.Sequential(attention, SequenceMean()) if layer == 0 else attention


def _statuses(report):
    return {result.name: result.status for result in report.results}


@pytest.mark.parametrize("cls", [TinyGPT, HandGPT])
def test_a_correct_tiny_gpt_passes(cls):
    torch.manual_seed(0)
    report = audit_model(cls(CFG))
    assert report.ok, [(r.name, r.observed) for r in report.results if r.failed]
    statuses = _statuses(report)
    for name in ("runs", "causal", "batch_independent", "deterministic", "finite_gradients"):
        assert statuses[name] == "passed"
    assert statuses["left_padding"] == statuses["kv_cache"] == "skipped"  # takes no mask
    assert "takes no attention_mask" in report["left_padding"].observed
    assert "takes no cache argument" in report["kv_cache"].observed
    assert report.kind == "model" and report.vocab_size == 50 and report.context_length == 16


@pytest.mark.parametrize(
    ("cls", "layer"),
    [(OneBidirectionalLayer, "blocks.1.att"), (SequenceMeanGPT, "blocks.0.att.1")],
)
def test_a_leak_through_one_layer_is_found_and_located(cls, layer):
    torch.manual_seed(0)
    report = audit_model(cls(CFG))
    assert report.failed == ["causal"]
    assert f"the leak starts in {layer} (" in report["causal"].observed


def test_the_audit_leaves_the_model_unchanged():
    torch.manual_seed(0)
    model = TinyGPT(CFG).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    audit_model(model)
    assert model.training
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_a_model_is_detected_from_the_input_it_accepts():
    torch.manual_seed(0)
    assert takes_token_ids(TinyGPT(CFG))
    assert not takes_token_ids(HandCausalAttention(8))


def _tiny_gpt2(**changes):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=60, n_positions=16, n_embd=16, n_layer=2, n_head=2, **changes
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _hf_cache_name(model):
    """The name the installed transformers gives the cache, in and out (one name for both
    since the rename to `cache` in 5.24; `past_key_values` before), read independently of
    the audit: from the forward's parameters."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def test_a_tiny_hf_gpt2_passes_with_padding_and_cache():
    model = _tiny_gpt2()
    report = audit_model(model)
    assert report.ok, [(r.name, r.observed) for r in report.results if r.failed]
    assert all(status == "passed" for status in _statuses(report).values()), _statuses(report)
    assert report.context_length == 16 and report.vocab_size == 60
    name = _hf_cache_name(model)
    assert f"cache passed as `{name}=`, returned as `.{name}`" in report["kv_cache"].observed


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=60,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        initializer_range=0.3,  # weights large enough that a position shift shows
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _restart_positions(model):
    """Plant the bug: the inner model's positions start at 0 on every call, ignoring the
    tokens already in the cache (HF's offset is cache.get_seq_length())."""
    base = type(model.model)

    class PositionsFromZero(base):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
            if position_ids is None:
                t = input_ids.shape[1]
                position_ids = torch.arange(t, device=input_ids.device)[None]  # (1, t)
            return super().forward(
                input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
            )

    model.model.__class__ = PositionsFromZero
    return model


def test_a_tiny_hf_llama_passes_and_its_restarting_positions_fail_kv_cache():
    model = _tiny_llama()
    name = _hf_cache_name(model)
    report = audit_model(model)
    assert all(status == "passed" for status in _statuses(report).values()), _statuses(report)
    buggy = audit_model(_restart_positions(_tiny_llama()))
    assert buggy.failed == ["kv_cache"], _statuses(buggy)  # without a cache all is right
    observed = buggy["kv_cache"].observed
    assert "differs from the full forward from position 6" in observed  # the first cached
    assert f"cache passed as `{name}=`, returned as `.{name}`" in observed
    assert "positions restart at 0" in buggy["kv_cache"].causes[0]


class PastKeyValuesWrapper(nn.Module):
    """A user's model around HF GPT-2 that takes and returns the cache as past_key_values
    (the name before transformers 5.24), its output an object, a tuple or a dict; `none`
    returns the logits alone although the forward takes a cache."""

    def __init__(self, output="object"):
        super().__init__()
        self.model, self.output = _tiny_gpt2(), output

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
    ):
        kwargs = {_hf_cache_name(self.model): past_key_values}
        out = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **kwargs,
        )
        cache = out[_hf_cache_name(self.model)] if use_cache else None
        if self.output == "object":
            return SimpleNamespace(logits=out.logits, past_key_values=cache)
        if self.output == "tuple":
            return out.logits, cache
        if self.output == "dict":
            return {"logits": out.logits, "past_key_values": cache}
        return out.logits


@dataclass
class Remembered:
    logits: torch.Tensor
    state: object


class AnnotatedCacheWrapper(nn.Module):
    """Takes the cache under a name no list holds, annotated with transformers' Cache, and
    returns it under another: found by the annotation and by the returned value's type."""

    def __init__(self):
        super().__init__()
        self.model = _tiny_gpt2()

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        memory: "Cache | None" = None,  # noqa: F821
        use_cache=False,
    ):
        kwargs = {_hf_cache_name(self.model): memory, "attention_mask": attention_mask}
        out = self.model(input_ids, position_ids=position_ids, use_cache=use_cache, **kwargs)
        return Remembered(out.logits, out[_hf_cache_name(self.model)] if use_cache else None)


@pytest.mark.parametrize(
    ("model", "argument", "where"),
    [
        (lambda: PastKeyValuesWrapper("object"), "past_key_values", ".past_key_values"),
        (lambda: PastKeyValuesWrapper("tuple"), "past_key_values", "[1]"),
        (lambda: PastKeyValuesWrapper("dict"), "past_key_values", "['past_key_values']"),
        (AnnotatedCacheWrapper, "memory", ".state"),
    ],
)
def test_the_cache_is_found_under_any_name(model, argument, where):
    report = audit_model(model())
    assert all(status == "passed" for status in _statuses(report).values()), _statuses(report)
    names = f"cache passed as `{argument}=`, returned as `{where}`"
    assert names in report["kv_cache"].observed


def test_a_forward_that_takes_a_cache_but_returns_none_is_a_visible_skip():
    report = audit_model(PastKeyValuesWrapper("none"))
    result = report["kv_cache"]
    assert result.status == "skipped" and report.skipped == ["kv_cache"]
    assert "use_cache=True returned no cache" in result.observed
    assert "`past_key_values=`" in result.observed


class DynamicCache:  # a class named like transformers' caches, for annotations
    pass


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def forward(self, ids, cache_position=None, use_cache=False): ...", None),
        ("def forward(self, ids, **kwargs): ...", None),
        ("def forward(self, ids, layer_past=None): ...", "layer_past"),
        ("def forward(self, ids, past=None, cache=None): ...", "cache"),
        ("def forward(self, ids, past_key_values=None, kv=None): ...", "past_key_values"),
        ("def forward(self, ids, cache=None, *, s: DynamicCache | None = None): ...", "s"),
        ("def forward(self, ids, past=None, state: 'Cache' = None): ...", "state"),
        ("def forward(self, ids, cache, /): ...", None),  # positional-only: no keyword
    ],
)
def test_the_cache_argument_is_read_from_the_signature(source, expected):
    namespace = {"DynamicCache": DynamicCache}
    exec(source, namespace)  # a signature written for the test
    module = type("M", (nn.Module,), {"forward": namespace["forward"]})()
    assert find_cache_argument(module) == expected


def test_hf_gpt2_with_a_bidirectional_layer_leaks():
    model = _tiny_gpt2()
    model.transformer.h[1].attn.is_causal = False  # the layer SDPA/eager asks for causality
    report = audit_model(model)
    assert "causal" in report.failed
    assert "transformer.h.1" in report["causal"].observed


class TinyGPTFile(TinyGPT):
    """For the command line: built from keyword arguments."""

    def __init__(self, vocab_size=50, context_length=16):
        super().__init__({**CFG, "vocab_size": vocab_size, "context_length": context_length})


def test_the_command_audits_a_model_and_exits_0(capsys):
    init = json.dumps({"vocab_size": 40, "context_length": 8})
    code = cli.main(["check", f"{HERE}:TinyGPTFile", "--init", init, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["exit"]["code"] == 0, report["exit"]
    assert report["kind"] == "model"
    assert report["vocab_size"] == 40 and report["context_length"] == 8
