"""Heatmaps of attention weights, labelled with the tokens.

Uses matplotlib's object API with the Agg canvas (no pyplot), so drawing needs no display and
changes no global matplotlib state.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from attnlab._validate import check_tensor

MASKED_TEXT = ""  # a masked cell has no number: it is drawn grey and hatched (a zero reads 0.00)
_MASKED_FACE = "#d9d9d9"


def save_heatmap(
    weights: torch.Tensor,
    labels: Sequence[str],
    path: str | Path,
    *,
    title: str = "",
    key_labels: Sequence[str] | None = None,
    allowed: torch.Tensor | None = None,
    note: str = "",
) -> Path:
    """Write a (queries, keys) weight matrix as a PNG heatmap with each cell's value.

    Args:
        weights: (queries, keys) floating-point weights.
        labels: one label per query (the rows).
        path: the PNG file to write (its folder is created).
        title: drawn above the map.
        key_labels: one label per key (the columns); default `labels`.
        allowed: optional (queries, keys) bool mask, True where the query may attend to the
            key; the other cells are drawn grey and hatched, with no number, distinct from a
            weight that is zero (which reads 0.00 in the colour map).
        note: a line drawn under the map (wrapped), e.g. what dropout did to the scale.

    Returns:
        The path written.

    Raises:
        ValueError: empty weights, labels that do not match the shape, an `allowed` of
            another shape, or a path that is a folder.
        TypeError: labels that are not a sequence, an `allowed` that is not boolean.
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
    values, texts = cells(weights, allowed)
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"path {str(path)!r} is a folder; give a file name such as w.png")
    fig = _draw(values, texts, labels, key_labels, title, note)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")  # exactly `path`, whatever its suffix
    return path


def cells(
    weights: torch.Tensor, allowed: torch.Tensor | None = None
) -> tuple[np.ma.MaskedArray, np.ndarray]:
    """What each heatmap cell shows: the values (masked where `allowed` is False) and the
    text written in each cell ("0.12", or MASKED_TEXT, empty, for a masked cell).

    Args:
        weights: (queries, keys) weights.
        allowed: optional bool tensor of the same shape, True where attending is allowed.

    Returns:
        A float32 masked array (queries, keys) and an array of strings of the same shape.

    Raises:
        TypeError: `allowed` is not a bool tensor.
        ValueError: `allowed` has another shape than `weights`.
    """
    values = weights.detach().to(torch.float32).cpu().numpy()
    hidden = np.zeros(values.shape, dtype=bool)
    if allowed is not None:
        if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
            kind = allowed.dtype if isinstance(allowed, torch.Tensor) else type(allowed).__name__
            raise TypeError(f"allowed must be a bool tensor, got {kind}")
        if tuple(allowed.shape) != values.shape:
            raise ValueError(
                f"allowed's shape {tuple(allowed.shape)} must be the weights' {values.shape}"
            )
        hidden = ~allowed.cpu().numpy()
    texts = np.array([[f"{v:.2f}" for v in row] for row in values], dtype=object)
    texts[hidden] = MASKED_TEXT
    return np.ma.MaskedArray(values, mask=hidden), texts


def _draw(values, texts, labels, key_labels, title, note) -> Figure:
    """The figure: the colour map, grey hatched masked cells, each cell's text, the note."""
    width = 1.0 + 0.8 * len(key_labels)
    fig = Figure(figsize=(width, 0.8 + 0.7 * len(labels)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = float(values.max()) if values.count() else 1.0
    image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=max(1.0, top))
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set_xticks(range(len(key_labels)), labels=list(key_labels), rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels=list(labels))
    xlabel = "key (attended to)"
    if np.ma.is_masked(values):
        xlabel += "\ngrey hatched cells: masked (the query may not attend)"
    if note:
        xlabel += "\n" + "\n".join(textwrap.wrap(note, int(9 * width)))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("query")
    for (row, col), text in np.ndenumerate(texts):
        if values.mask is not np.ma.nomask and values.mask[row, col]:
            ax.add_patch(_masked_cell(row, col))
            color = "dimgrey"
        else:
            color = "white" if values[row, col] < 0.6 * image.norm.vmax else "black"
        ax.text(col, row, text, ha="center", va="center", fontsize=8, color=color)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def _masked_cell(row: int, col: int) -> Rectangle:
    return Rectangle(
        (col - 0.5, row - 0.5), 1, 1, facecolor=_MASKED_FACE, edgecolor="grey", hatch="//"
    )
