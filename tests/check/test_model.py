"""attnlab check on whole causal language models: a tiny GPT as the chapter's reader builds
next (token and position embeddings, blocks of attention and a feed-forward with LayerNorm,
a head), its buggy copies (one bidirectional layer; a sequence-wide mean), and a tiny
Hugging Face GPT-2 built from a config (attention_mask, position_ids and a KV cache)."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import attnlab
from attnlab import cli
from attnlab.check.model import audit_model, takes_token_ids

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


def test_a_tiny_hf_gpt2_passes_with_padding_and_cache():
    report = audit_model(_tiny_gpt2())
    assert report.ok, [(r.name, r.observed) for r in report.results if r.failed]
    assert all(status == "passed" for status in _statuses(report).values()), _statuses(report)
    assert report.context_length == 16 and report.vocab_size == 60


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
    assert code == 0 and report["exit"]["code"] == 0 and report["kind"] == "model"
    assert report["vocab_size"] == 40 and report["context_length"] == 8
