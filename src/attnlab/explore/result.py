"""What `attnlab.explore` returns: the page, to save as a file or show in a notebook."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from attnlab.explore import page
from attnlab.explore.data import Capture
from attnlab.explore.encoding import choose_bits


class Exploration:
    """An explorer page of a source's attention maps.

    `save(path)` writes the self-contained HTML file; in Jupyter, JupyterLab and VS Code
    notebooks the object displays itself (`_repr_html_`, a <div> with its own id, so that
    several outputs of one notebook never clash). `exploration + other` puts two explorers'
    maps in one page, to compare two models side by side.

    Attributes:
        capture: the maps, notes and cuts.
        bits: bits per stored value, 8 or 16.
    """

    def __init__(self, capture: Capture, precision: int | str = "auto") -> None:
        """Wrap a capture.

        Args:
            capture: the maps to show.
            precision: "auto", 8 or 16 bits per stored value ("auto": 16 up to
                encoding.AUTO_16_BITS_UP_TO cells, else 8).

        Raises:
            TypeError: capture is not a Capture.
            ValueError: a capture with no group, or a precision other than "auto", 8 or 16.
        """
        if not isinstance(capture, Capture):
            raise TypeError(f"capture must be a Capture, got {type(capture).__name__}")
        if not capture.groups:
            raise ValueError(f"capture {capture.title!r} has no group of maps to show")
        cells = sum(group.weights.numel() for group in capture.groups)
        self.capture = capture
        self.bits = choose_bits(precision, cells)
        self._data: dict | None = None

    @property
    def data(self) -> dict:
        """The JSON the page holds (page.payload), computed once."""
        if self._data is None:
            self._data = page.payload(self.capture, self.bits)
        return self._data

    def html(self) -> str:
        """The whole HTML document (what `save` writes)."""
        return page.document(self.data)

    def save(self, path: str | Path) -> Path:
        """Write the page as one self-contained HTML file.

        Args:
            path: the file to write (its folder is created).

        Returns:
            The path written.

        Raises:
            TypeError: path is not a str or a Path.
            ValueError: path is an existing folder.
        """
        if not isinstance(path, (str, Path)):
            raise TypeError(f"path must be a str or a Path, got {type(path).__name__}")
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"path {str(path)!r} is a folder; give a file name such as a.html")
        text = self.html()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    def _repr_html_(self) -> str:
        return page.fragment(self.data)

    def __add__(self, other: object) -> Exploration:
        if not isinstance(other, Exploration):
            return NotImplemented
        return combine(self, other)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{g.name!r} {tuple(g.shape)}" for g in self.capture.groups)
        return f"Exploration({self.capture.title!r}: {shapes}; {self.bits} bits)"


def combine(*explorations: Exploration, names: tuple[str, ...] | None = None) -> Exploration:
    """One page holding several explorers' maps (two models side by side).

    Args:
        explorations: the explorers to put together.
        names: a prefix per explorer for its groups' names (default: each one's title).

    Returns:
        An Exploration with every group, in order; the finer of their precisions.

    Raises:
        TypeError: an argument that is not an Exploration.
        ValueError: fewer than one explorer, or names of another length.
    """
    for index, item in enumerate(explorations):
        if not isinstance(item, Exploration):
            raise TypeError(
                f"explorations[{index}] must be an Exploration, got {type(item).__name__}"
            )
    if not explorations:
        raise ValueError("combine needs at least one Exploration")
    names = tuple(e.capture.title for e in explorations) if names is None else tuple(names)
    if len(names) != len(explorations):
        raise ValueError(
            f"names ({len(names)}) must name each of the {len(explorations)} explorers"
        )
    groups, notes, cuts = [], [], []
    for name, item in zip(names, explorations, strict=True):
        groups += [replace(g, name=f"{name}: {g.name}") for g in item.capture.groups]
        notes += [f"{name}: {n}" for n in item.capture.notes]
        cuts += [f"{name}: {c}" for c in item.capture.cuts]
    title = " vs ".join(names)
    capture = Capture(title, tuple(groups), tuple(notes), tuple(cuts))
    return Exploration(capture, max(e.bits for e in explorations))
