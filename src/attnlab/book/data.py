"""The chapter's running example: "Your journey starts with one step", six 3-d embeddings."""

from __future__ import annotations

import torch

TOKENS: tuple[str, ...] = ("Your", "journey", "starts", "with", "one", "step")
"""The six words of the example, one per row of INPUTS."""

INPUTS: torch.Tensor = torch.tensor(
    [
        [0.43, 0.15, 0.89],  # Your     (x^1)
        [0.55, 0.87, 0.66],  # journey  (x^2)
        [0.57, 0.85, 0.64],  # starts   (x^3)
        [0.22, 0.58, 0.33],  # with     (x^4)
        [0.77, 0.25, 0.10],  # one      (x^5)
        [0.05, 0.80, 0.55],  # step     (x^6)
    ]
)
"""The six token embeddings, shape (6, 3). Shared: clone before changing it in place."""


def example_batch() -> torch.Tensor:
    """The book's `batch`: the example stacked twice.

    Returns:
        A fresh (2, 6, 3) float32 tensor, INPUTS twice.
    """
    return torch.stack((INPUTS, INPUTS), dim=0)  # (2, 6, 3)
