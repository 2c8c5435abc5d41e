"""Heatmaps of attention weights, labelled with the tokens.

Uses matplotlib's object API with the Agg canvas (no pyplot), so drawing needs no display and
changes no global matplotlib state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from attnlab._validate import check_tensor


def save_heatmap(
    weights: torch.Tensor,
    labels: Sequence[str],
    path: str | Path,
    *,
    title: str = "",
    key_labels: Sequence[str] | None = None,
) -> Path:
    """Write a (queries, keys) weight matrix as a PNG heatmap with each cell's value.

    Rows are queries (labelled by `labels`), columns are keys (`key_labels`, default the same).
    """
    weights = check_tensor("weights", weights, ndims=(2,), layout="(queries, keys)")
    if weights.numel() == 0:
        raise ValueError(f"weights must not be empty, got shape {tuple(weights.shape)}")
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        raise TypeError(f"labels must be a sequence of strings, got {type(labels).__name__}")
    key_labels = labels if key_labels is None else key_labels
    if len(labels) != weights.shape[0] or len(key_labels) != weights.shape[1]:
        raise ValueError(
            f"labels ({len(labels)}) and key_labels ({len(key_labels)}) must match the weights' "
            f"shape {tuple(weights.shape)}"
        )
    values = weights.detach().to(torch.float32).cpu().numpy()
    fig = Figure(figsize=(1.0 + 0.8 * len(key_labels), 0.8 + 0.7 * len(labels)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=max(1.0, float(values.max())))
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set_xticks(range(len(key_labels)), labels=list(key_labels), rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels=list(labels))
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    for (row, col), value in np.ndenumerate(values):
        ax.text(
            col,
            row,
            f"{value:.2f}",
            ha="center",
            va="center",
            fontsize=8,
            color="white" if value < 0.6 * image.norm.vmax else "black",
        )
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"path {str(path)!r} is a folder; give a file name such as w.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")  # exactly `path`, whatever its suffix
    return path
