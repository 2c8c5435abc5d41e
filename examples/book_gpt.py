"""The book's GPT (chapter 4) with attnlab's attention: swap it in, load the book model's
weights, decode with a KV cache, and go back to the book's class.

    python examples/book_gpt.py

The model below is written the way the book's chapter 4 builds it (GPTModel, TransformerBlock,
LayerNorm, GELU, FeedForward), on attnlab.book.MultiHeadAttention, the chapter 3 class.
tests/examples/test_book_gpt.py checks every claim printed here on a tiny configuration.
"""

from __future__ import annotations

import torch
from torch import nn

import attnlab
from attnlab import book, interop

GPT_CONFIG_TINY = {
    "vocab_size": 96,
    "context_length": 64,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": False,
}

# ---------------------------------------------------------------------------------------------
# the model, as chapter 4 builds it


class LayerNorm(nn.Module):
    def __init__(self, emb_dim):
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift


class GELU(nn.Module):
    def forward(self, x):
        return (
            0.5
            * x
            * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * x**3)))
        )


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]),
            GELU(),
            nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]),
        )

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = book.MultiHeadAttention(
            d_in=cfg["emb_dim"],
            d_out=cfg["emb_dim"],
            context_length=cfg["context_length"],
            num_heads=cfg["n_heads"],
            dropout=cfg["drop_rate"],
            qkv_bias=cfg["qkv_bias"],
        )
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg["emb_dim"])
        self.norm2 = LayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        shortcut = x
        x = self.norm1(x)
        x = self.att(x)
        x = self.drop_shortcut(x)
        x = x + shortcut
        shortcut = x
        x = self.norm2(x)
        x = self.ff(x)
        x = self.drop_shortcut(x)
        return x + shortcut


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx):
        seq_len = in_idx.shape[1]
        tok_embeds = self.tok_emb(in_idx)
        pos_embeds = self.pos_emb(torch.arange(seq_len, device=in_idx.device))
        x = self.drop_emb(tok_embeds + pos_embeds)
        x = self.trf_blocks(x)
        x = self.final_norm(x)
        return self.out_head(x)


def generate_text_simple(model, idx, max_new_tokens, context_size):
    """The book's greedy generation: the whole context recomputed for every token."""
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -context_size:]
        with torch.no_grad():
            logits = model(idx_cond)
        idx_next = torch.argmax(logits[:, -1, :], dim=-1, keepdim=True)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


# ---------------------------------------------------------------------------------------------
# the recipe


def swapped_copy(original: GPTModel, cfg: dict) -> GPTModel:
    """The book's model with attnlab's attention and the same weights and dropouts."""
    # --8<-- [start:swap]
    model = GPTModel(cfg)
    interop.swap_book_attention(model)  # each block's att: attnlab's MultiHeadAttention
    model.load_state_dict(original.state_dict())  # the book's own names load strictly
    # --8<-- [end:swap]
    return model


# --8<-- [start:cached]
def forward_cached(model: GPTModel, idx: torch.Tensor, caches, pad=None):
    """Logits of idx's tokens, which follow those the caches hold (one cache per block);
    pad (b,): left-padding tokens per row, masked and not counted as positions."""
    start = caches[0].position
    if start + idx.shape[1] > model.pos_emb.num_embeddings:  # no crop: the cache holds all
        raise ValueError(f"{start + idx.shape[1]} tokens exceed the context length")
    pos = torch.arange(start, start + idx.shape[1])  # (t,) absolute positions
    mask = None
    if pad is not None:
        pos = (pos - pad[:, None]).clamp(min=0)  # (b, t): each row's own positions
        mask = (torch.arange(start + idx.shape[1]) >= pad[:, None])[:, None, None]  # (b,1,1,k)
    x = model.drop_emb(model.tok_emb(idx) + model.pos_emb(pos))
    for block, cache in zip(model.trf_blocks, caches, strict=True):
        x = x + block.drop_shortcut(block.att(block.norm1(x), cache=cache, mask=mask))
        x = x + block.drop_shortcut(block.ff(block.norm2(x)))
    return model.out_head(model.final_norm(x))


@torch.no_grad()
def generate_cached(model: GPTModel, idx: torch.Tensor, max_new_tokens: int, pad=None):
    """Greedy decoding: the prompt once, then one token per step through the caches."""
    caches = attnlab.interop.make_caches(model, idx.shape[0], idx.shape[1] + max_new_tokens)
    logits = forward_cached(model, idx, caches, pad)
    for _ in range(max_new_tokens):
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        logits = forward_cached(model, idx[:, -1:], caches, pad)
    return idx


# --8<-- [end:cached]


def restored_copy(model: GPTModel, cfg: dict) -> GPTModel:
    """The book's class again, with the swapped model's weights."""
    # --8<-- [start:back]
    interop.restore_book_attention(model)  # attnlab's layers back to book.MultiHeadAttention
    original = GPTModel(cfg)
    original.load_state_dict(model.state_dict())  # strict
    # --8<-- [end:back]
    return original


def main() -> None:
    torch.manual_seed(0)
    cfg = GPT_CONFIG_TINY
    original = GPTModel(cfg).eval()
    model = swapped_copy(original, cfg).eval()
    idx = torch.randint(0, cfg["vocab_size"], (2, 10))
    with torch.no_grad():
        difference = (model(idx) - original(idx)).abs().max().item()
    print(f"logits, swapped against the book's attention: max difference {difference:.1e}")
    want = generate_text_simple(original, idx, 20, cfg["context_length"])
    same = torch.equal(generate_cached(model, idx, 20), want)
    print(f"greedy ids, cached against the book's generation: identical {same}")
    back = restored_copy(model, cfg).eval()
    same = torch.equal(generate_text_simple(back, idx, 5, cfg["context_length"]), want[:, :15])
    print(f"back to the book's class: the same ids {same}")


if __name__ == "__main__":
    main()
