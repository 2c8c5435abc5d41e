"""`explore(source, inputs)`: the public entry point, checks at the door, then the source's
capture, cut to the page's limits."""

from __future__ import annotations

from attnlab.explore.chapter import chapter_capture
from attnlab.explore.result import Exploration


def explore(source=None, inputs=None, *, precision="auto") -> Exploration:
    """The chapter only, for now."""
    return Exploration(chapter_capture(), precision)
