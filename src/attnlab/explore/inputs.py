"""What the explorer runs a module on: the tokens' labels and the tensor a module takes.

Text is split on whitespace; a list of strings is taken as the tokens. A module that takes
embeddings gets one per token: the chapter's own for its six words when d_in is 3, else a
random vector seeded by the token's text (the same word, the same vector; not learned). A
module that takes token ids (it holds an nn.Embedding) gets each token's CRC-32 modulo its
vocabulary. A tensor is used as it is: float for embeddings, integer for ids.

Shapes: embeddings (1, tokens, d_in); ids (1, tokens).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from attnlab import book


def token_labels(inputs: object, name: str = "inputs") -> tuple[str, ...]:
    """The tokens of a text (split on whitespace) or of a list of strings.

    Raises:
        TypeError: neither a str nor a sequence of str.
        ValueError: no token.
    """
    if isinstance(inputs, str):
        labels = tuple(inputs.split())
    elif isinstance(inputs, Sequence) and all(isinstance(t, str) for t in inputs):
        labels = tuple(inputs)
    else:
        raise TypeError(
            f"{name} must be a text, a list of token strings or a tensor, got "
            f"{type(inputs).__name__}"
        )
    if not labels:
        raise ValueError(f"{name} must hold at least one token, got {inputs!r}")
    return labels


def tensor_labels(x: torch.Tensor, tokens: object, name: str = "inputs") -> tuple[str, ...]:
    """Labels for a tensor input of `x.shape[1]` tokens: `tokens`, or their positions.

    Raises:
        TypeError: tokens that are not a sequence of str.
        ValueError: tokens of another length than the tensor's.
    """
    count = x.shape[1]
    if tokens is None:
        return tuple(str(i) for i in range(count))
    labels = token_labels(tokens, "tokens")
    if len(labels) != count:
        raise ValueError(f"tokens ({len(labels)}) must label each of the {count} {name} tokens")
    return labels


def as_batch(x: torch.Tensor, name: str = "inputs") -> torch.Tensor:
    """A tensor input as one sequence: ids (1, t), embeddings (1, t, d).

    Raises:
        ValueError: empty, of the wrong rank, or a batch of more than one sequence.
    """
    integer = not (x.is_floating_point() or x.is_complex())
    if x.dim() == (1 if integer else 2):
        x = x.unsqueeze(0)  # (1, t) or (1, t, d)
    expected = "(tokens,) or (1, tokens) token ids" if integer else "(tokens, d) or (1, tokens, d)"
    if x.dim() != (2 if integer else 3) or x.shape[0] != 1 or x.shape[1] == 0:
        raise ValueError(f"{name} must be {expected}, got shape {tuple(x.shape)}")
    return x


def embed(labels: Sequence[str], d_in: int, like: torch.Tensor) -> torch.Tensor:
    """(1, tokens, d_in) embeddings of `labels`, in `like`'s dtype and device: the
    chapter's for its six words when d_in is 3, else a vector seeded by each token's text."""
    if tuple(labels) == book.TOKENS and d_in == 3:
        rows = book.INPUTS.clone()
    else:
        rows = torch.stack([_seeded(label, d_in) for label in labels])  # (t, d_in)
    return rows.unsqueeze(0).to(like.device, like.dtype)


def hashed_ids(labels: Sequence[str], vocab: int) -> torch.Tensor:
    """(1, tokens) ids: each token's CRC-32 modulo `vocab`."""
    return torch.tensor([[zlib.crc32(label.encode()) % vocab for label in labels]])


def _seeded(label: str, d_in: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(label.encode()))
    return torch.randn(d_in, generator=generator)
