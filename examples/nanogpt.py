"""nanoGPT's GPT with attnlab's attention: swap it in, load a nanoGPT checkpoint, decode with a
KV cache, and go back to nanoGPT's own class.

    python examples/nanogpt.py

The model below is written in the style of nanoGPT's model.py (karpathy/nanoGPT): a GPT of
pre-norm blocks whose attention is one fused `c_attn`, SDPA, `c_proj` and a residual dropout.
tests/examples/test_nanogpt.py checks every claim printed here on a tiny configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

import attnlab
from attnlab.interop import nanogpt

# ---------------------------------------------------------------------------------------------
# the model, nanoGPT style


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806 (nanoGPT's names)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        dropout_p = self.dropout if self.training else 0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # scaled init of the residual projections
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            return logits, loss
        return self.lm_head(x[:, [-1], :]), None  # inference: the last position only

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size :]
            logits, _ = self(idx_cond)
            idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        return idx


# ---------------------------------------------------------------------------------------------
# the recipe


def swapped_copy(original: GPT) -> GPT:
    """nanoGPT's model with attnlab's attention, the same weights (c_proj's scaled init
    included) and dropouts."""
    # --8<-- [start:swap]
    model = GPT(original.config)
    nanogpt.swap(model)  # each block's attn: attnlab's MultiHeadAttention + resid_dropout
    model.load_state_dict(nanogpt.from_nanogpt_state(original.state_dict()))  # strict
    # --8<-- [end:swap]
    return model


# --8<-- [start:cached]
def forward_cached(model: GPT, idx: torch.Tensor, caches, pad: torch.Tensor | None = None):
    """Logits of idx's tokens, which follow those the caches hold (one cache per layer);
    pad (b,): left-padding tokens per row, masked and not counted as positions."""
    start = caches[0].position
    if start + idx.shape[1] > model.config.block_size:  # no crop: the cache holds all
        raise ValueError(f"{start + idx.shape[1]} tokens exceed block_size")
    pos = torch.arange(start, start + idx.shape[1])  # (t,) absolute positions
    mask = None
    if pad is not None:
        pos = (pos - pad[:, None]).clamp(min=0)  # (b, t): each row's own positions
        mask = (torch.arange(start + idx.shape[1]) >= pad[:, None])[:, None, None]  # (b,1,1,k)
    t = model.transformer
    x = t.drop(t.wte(idx) + t.wpe(pos))
    for block, cache in zip(t.h, caches, strict=True):
        x = x + block.attn(block.ln_1(x), cache=cache, mask=mask)
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(t.ln_f(x))


@torch.no_grad()
def generate_cached(model: GPT, idx: torch.Tensor, max_new_tokens: int, pad=None):
    """Greedy decoding: the prompt once, then one token per step through the caches."""
    caches = attnlab.interop.make_caches(model, idx.shape[0], idx.shape[1] + max_new_tokens)
    logits = forward_cached(model, idx, caches, pad)
    for _ in range(max_new_tokens):
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        logits = forward_cached(model, idx[:, -1:], caches, pad)
    return idx


# --8<-- [end:cached]


def restored_copy(model: GPT) -> GPT:
    """nanoGPT's own class again, with the swapped model's weights."""
    # --8<-- [start:back]
    original = GPT(model.config)
    original.load_state_dict(nanogpt.to_nanogpt_state(model.state_dict()))  # strict
    # --8<-- [end:back]
    return original


def main() -> None:
    torch.manual_seed(0)
    original = GPT(GPTConfig()).eval()
    model = swapped_copy(original).eval()
    idx = torch.randint(0, original.config.vocab_size, (2, 10))
    with torch.no_grad():
        targets = torch.roll(idx, -1, dims=1)
        difference = (model(idx, targets)[0] - original(idx, targets)[0]).abs().max().item()
    print(f"logits, swapped against nanoGPT's attention: max difference {difference:.1e}")
    same = torch.equal(generate_cached(model, idx, 20), original.generate(idx, 20))
    print(f"greedy ids, cached through attnlab against nanoGPT's generate: identical {same}")
    back = restored_copy(model).eval()
    same = torch.equal(back.generate(idx, 5), original.generate(idx, 5))
    print(f"back to nanoGPT's class: the same ids {same}")


if __name__ == "__main__":
    main()
