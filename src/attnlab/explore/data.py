"""What the explorer shows: groups of attention maps over the same tokens.

A `Group` is one layers x heads grid of (queries, keys) maps: the layers of a model, the
encoder's self-attention, the decoder's cross-attention, or the chapter's stages. A
`Capture` is what a source gives: its title, its groups and the notes the page shows (what
was cut, how the inputs were made).

Shapes: weights (layers, heads, queries, keys); allowed broadcastable to it, False where a
query may not attend to a key (a masked cell, drawn apart from a weight that is zero).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Group:
    """One layers x heads grid of attention maps over the same query and key tokens.

    Attributes:
        name: the group's title in the page, e.g. "decoder cross-attention".
        weights: (layers, heads, queries, keys) float values; what a masked cell holds is
            ignored.
        allowed: bool, broadcastable to weights' shape, False where the cell is masked.
        query_tokens: one label per query (the rows).
        key_tokens: one label per key (the columns).
        layer_names: one name per layer (a stage of the chapter, a module's name).
        scores: True when the maps are scores (any real value) rather than weights; the
            per-head statistics are given for weights only.
    """

    name: str
    weights: torch.Tensor  # (layers, heads, queries, keys)
    allowed: torch.Tensor  # bool, broadcastable to (layers, heads, queries, keys)
    query_tokens: tuple[str, ...]
    key_tokens: tuple[str, ...]
    layer_names: tuple[str, ...]
    scores: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.weights, torch.Tensor) or not self.weights.is_floating_point():
            raise TypeError(f"weights must be a floating-point tensor, got {_kind(self.weights)}")
        if self.weights.dim() != 4:
            raise ValueError(
                "weights must be (layers, heads, queries, keys), got shape "
                f"{tuple(self.weights.shape)}"
            )
        if not isinstance(self.allowed, torch.Tensor) or self.allowed.dtype != torch.bool:
            raise TypeError(f"allowed must be a bool tensor, got {_kind(self.allowed)}")
        try:
            torch.broadcast_shapes(self.allowed.shape, self.weights.shape)
        except RuntimeError:
            raise ValueError(
                f"allowed {tuple(self.allowed.shape)} must broadcast to the weights' shape "
                f"{tuple(self.weights.shape)}"
            ) from None
        layers, _, queries, keys = self.weights.shape
        if len(self.layer_names) != layers:
            raise ValueError(
                f"layer_names ({len(self.layer_names)}) must name each of the {layers} layers"
            )
        if (len(self.query_tokens), len(self.key_tokens)) != (queries, keys):
            raise ValueError(
                f"query_tokens ({len(self.query_tokens)}) and key_tokens "
                f"({len(self.key_tokens)}) must match the maps' (queries, keys) "
                f"({queries}, {keys})"
            )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(layers, heads, queries, keys)."""
        return tuple(self.weights.shape)

    def full_mask(self) -> torch.Tensor:
        """`allowed` expanded to (layers, heads, queries, keys)."""
        return self.allowed.expand(self.weights.shape)


@dataclass(frozen=True)
class Capture:
    """A source's attention maps, ready to be drawn.

    Attributes:
        title: the page's title.
        groups: the grids, in the order the page lists them.
        notes: lines shown at the top of the page (how the inputs were made).
        cuts: what was left out to keep the page small, shown in bold at the top.
    """

    title: str
    groups: tuple[Group, ...]
    notes: tuple[str, ...] = field(default=())
    cuts: tuple[str, ...] = field(default=())


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return type(value).__name__
