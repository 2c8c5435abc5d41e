"""Where each rank's tokens sit in the sequence, and which part of another rank's key/value
chunk its queries need.

Two layouts, over a world of W ranks and a sequence cut into equal pieces:

- "contiguous": rank r holds piece r of W (tokens [r n, (r + 1) n)). With causal attention
  rank r needs r + 1/2 chunks of scores, so rank W - 1 works about 2W - 1 times as long as
  rank 0.
- "zigzag": the sequence is cut into 2W pieces and rank r holds pieces r and 2W - 1 - r,
  concatenated (PyTorch's head-tail load balancer for context_parallel uses the same order).
  With causal attention every rank computes the same number of scores, 1/W of the total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from attnlab._validate import check_dim

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")

_EVERYTHING = slice(None)


def check_layout(layout: object) -> None:
    """A clear error for a layout that is not one of LAYOUTS.

    Args:
        layout: the value to check.

    Raises:
        ValueError: layout is not "contiguous" or "zigzag".
    """
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def pieces_per_rank(layout: Layout) -> int:
    """How many equal pieces of the sequence one rank holds.

    Args:
        layout: "contiguous" or "zigzag".

    Returns:
        2 for zigzag, 1 for contiguous.
    """
    return 2 if layout == "zigzag" else 1


def shard_sequence(
    x: torch.Tensor,
    dim: int = 2,
    *,
    layout: Layout = "contiguous",
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's part of the whole-sequence tensor `x` along `dim`, in `layout` (a clear
    ValueError, raised identically on every rank, when the length does not divide).

    Cut position ids the same way to know which tokens a rank holds, for rotary positions:
    `shard_sequence(torch.arange(T), 0, layout=layout)`.

    Args:
        x: the whole sequence, a tensor of at least one dimension.
        dim: the sequence axis (an int, a numpy integer too; negative counts from the end).
        layout: "contiguous" or "zigzag".
        group: the process group (default: the world).

    Returns:
        This rank's tokens of x along dim.

    Raises:
        TypeError: x not a tensor, dim not an int.
        ValueError: dim out of range, an unknown layout, or a length that does not divide.
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        got = "a 0-D tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a torch.Tensor with a sequence dimension, got {got}")
    dim = check_dim("dim", dim, x.dim())
    check_layout(layout)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = world * pieces_per_rank(layout)
    length = x.shape[dim]
    if length % pieces != 0:
        raise ValueError(
            f"sequence length {length} (dim {dim}) is not divisible by the world size "
            f"{world}" + (f" times 2 ({pieces}) for the zigzag layout" if pieces > world else "")
        )
    chunks = x.chunk(pieces, dim=dim)
    if layout == "zigzag":
        return torch.cat([chunks[rank], chunks[pieces - 1 - rank]], dim=dim)
    return chunks[rank].contiguous()


@dataclass(frozen=True)
class Block:
    """The part of one key/value chunk that this rank's queries attend to.

    Attributes:
        rows: the local queries concerned (a slice of the rank's tokens).
        cols: the columns of the chunk they read.
        causal: whether the causal mask applies inside the block.
    """

    rows: slice
    cols: slice
    causal: bool


def block_for(rank: int, source: int, tokens: int, *, causal: bool, layout: Layout) -> Block | None:
    """What rank `rank` computes against the key/value chunk of rank `source`.

    Args:
        rank: the rank whose queries attend.
        source: the rank whose keys and values they read.
        tokens: local tokens per rank.
        causal: whether attention is causal.
        layout: "contiguous" or "zigzag".

    Returns:
        The block, or None when every score there is in the future (skipped).
    """
    if not causal:
        return Block(_EVERYTHING, _EVERYTHING, False)
    if source == rank:  # the chunks keep their order, so the plain causal mask is exact
        return Block(_EVERYTHING, _EVERYTHING, True)
    if layout == "contiguous":
        return Block(_EVERYTHING, _EVERYTHING, False) if source < rank else None
    half = tokens // 2
    if source < rank:  # its early piece is past for both of ours, its late piece future
        return Block(_EVERYTHING, slice(0, half), False)
    return Block(slice(half, tokens), _EVERYTHING, False)  # only our late piece sees it


def scores_per_rank(world: int, tokens: int, *, causal: bool, layout: Layout) -> list[int]:
    """Query-key scores each rank computes for a sequence of `tokens`: the balance of the
    layout, equal for zigzag, growing with the rank for contiguous causal attention.

    Args:
        world: the number of ranks.
        tokens: the whole sequence's length, divisible into world (x2 for zigzag) pieces.
        causal: whether attention is causal.
        layout: "contiguous" or "zigzag".

    Returns:
        One count per rank, in rank order.

    Raises:
        ValueError: tokens does not divide into the layout's pieces.

    Examples:
        >>> scores_per_rank(4, 16, causal=True, layout="zigzag")
        [34, 34, 34, 34]
    """
    pieces = world * pieces_per_rank(layout)
    if tokens % pieces:
        raise ValueError(f"tokens ({tokens}) must divide into {pieces} pieces for {layout}")
    local = tokens // world
    counts = []
    for rank in range(world):
        total = 0
        for source in range(world):
            block = block_for(rank, source, local, causal=causal, layout=layout)
            if block is not None:
                rows = len(range(local)[block.rows])
                cols = len(range(local)[block.cols])
                total += rows * (cols + 1) // 2 if block.causal else rows * cols
        counts.append(total)
    return counts
