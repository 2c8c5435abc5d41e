"""The query/key/value projection layouts, known here and nowhere else.

attnlab.MultiHeadAttention stores its projections one of two ways: a fused `qkv_proj` whose
rows are [queries (d_out), keys (kv_dim), values (kv_dim)] when keys and values are read from
x itself, or `q_proj` (d_out rows) and `kv_proj` ([keys, values], 2 * kv_dim rows) for
cross-attention. The book's MultiHeadAttention stores `W_query`, `W_key`, `W_value` (d_out
rows each, one key/value head per query head), `out_proj` and a causal `mask` buffer.
Every conversion (the module's accessors, its load hook for book state_dicts, checkpoints,
interop with PyTorch, transformers and the book, tensor parallelism) goes through here.

Shapes: weights (rows, in_features), biases (rows,).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BOOK_PROJECTIONS = ("W_query", "W_key", "W_value")


class QKVWeights(NamedTuple):
    """Query, key and value projection weights (rows, in_features) and biases (rows,) or
    None, whatever layout a module stores them in."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    v_weight: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None

    @property
    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_weight, self.k_weight, self.v_weight

    @property
    def biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return self.q_bias, self.k_bias, self.v_bias


def split_rows(fused: torch.Tensor | None, q_rows: int, kv_rows: int) -> tuple:
    """A fused [queries, keys, values] weight or bias as three views (None stays None)."""
    if fused is None:
        return None, None, None
    return tuple(fused.split([q_rows, kv_rows, kv_rows]))


def fuse_rows(*parts: torch.Tensor | None) -> torch.Tensor | None:
    """Rows stacked in the given order: the fused layout of split_rows' parts."""
    return None if parts[0] is None else torch.cat(parts)


def book_to_module_state(state_dict: dict, prefix: str, fused: bool) -> None:
    """Rewrite, in place, the book's W_query/W_key/W_value entries under `prefix` as the
    module's layout (fused `qkv_proj`, or `q_proj` and `kv_proj`), and drop the book's
    causal `mask` buffer. A partial set of book entries is left for load_state_dict to
    report as missing/unexpected keys."""
    state_dict.pop(prefix + "mask", None)
    for kind in ("weight", "bias"):
        names = [f"{prefix}{p}.{kind}" for p in BOOK_PROJECTIONS]
        if not all(n in state_dict for n in names):
            continue
        q, k, v = (state_dict.pop(n) for n in names)
        if fused:
            state_dict[f"{prefix}qkv_proj.{kind}"] = fuse_rows(q, k, v)
        else:
            state_dict[f"{prefix}q_proj.{kind}"] = q
            state_dict[f"{prefix}kv_proj.{kind}"] = fuse_rows(k, v)


def is_book_state(state_dict: dict, prefix: str = "") -> bool:
    """True when the state_dict holds the book's query projection under `prefix`."""
    return prefix + "W_query.weight" in state_dict
