"""attnlab: attention mechanisms for PyTorch, from the first dot product to production speed.

`attnlab.book` holds the chapter's classes, faithful to the seed documents; they are the
reference oracles the rest of the package is checked against.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("attnlab")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
