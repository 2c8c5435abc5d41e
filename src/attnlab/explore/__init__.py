"""attnlab.explore: an interactive attention explorer in one self-contained HTML file.

`explore(source, inputs)` captures the attention maps of a source (the chapter's example
stage by stage, an attnlab or PyTorch attention module, a Hugging Face model) and returns an
`Exploration`: `.save(path)` writes the page, `_repr_html_` shows it in a notebook. The page
holds its scripts, styles and data inline (no network, no CDN, no server): a layers x heads
grid of thumbnails, a head view with token-to-token lines, a heatmap with exact values on
hover, masked cells drawn as masked, per-head statistics, and two maps side by side.

The package is callable: `attnlab.explore(model, inputs)` is `explore(model, inputs)`.

Shapes: maps are (layers, heads, queries, keys); a boolean `allowed` is False where a cell
is masked.
"""

import sys
import types

from attnlab.explore.data import Capture, Group
from attnlab.explore.explorer import explore
from attnlab.explore.result import Exploration, combine

__all__ = ["Capture", "Exploration", "Group", "combine", "explore"]


class _CallableModule(types.ModuleType):
    """attnlab.explore itself calls explore(): `attnlab.explore(model, inputs)`."""

    def __call__(self, *args, **kwargs) -> Exploration:
        return explore(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
