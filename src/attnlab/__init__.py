"""attnlab: attention mechanisms for PyTorch, from the first dot product to production speed.

`attnlab.book` holds the book chapter's classes, faithful to its text; they are the
reference oracles the rest of the package is checked against. `MultiHeadAttention` is the
production module, `attnlab.functional.attention` the kernel under it, `attnlab.masks` the
masks both take, `attnlab.save`/`attnlab.load` its safetensors checkpoints, `attnlab.interop`
the conversions (PyTorch, the book, Hugging Face, ONNX), `attnlab.check` the auditor for
anyone's attention module, `attnlab.parallel` attention across processes and
`attnlab.explore` the interactive explorer of attention maps.

Shapes: `(batch, tokens, d)` at module boundaries, `(batch, heads, tokens, head_dim)` inside.
A boolean mask is True where a query may attend to a key.

Examples:
    >>> import torch, attnlab
    >>> module = attnlab.MultiHeadAttention(16, 16, context_length=32, dropout=0.0, num_heads=4)
    >>> module(torch.randn(2, 10, 16)).shape  # causal self-attention
    torch.Size([2, 10, 16])
"""

from importlib.metadata import PackageNotFoundError, version

from attnlab import debug
from attnlab.attention import MultiHeadAttention
from attnlab.kv_cache import KVCache
from attnlab.mla import MultiHeadLatentAttention

try:
    __version__ = version("attnlab")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

from attnlab.checkpoint import load, save  # after __version__, which checkpoints record

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "__version__",
    "debug",
    "explore",
    "load",
    "save",
]


def __getattr__(name: str):
    """`attnlab.explore`, imported on first use (it is callable: `attnlab.explore(model,
    inputs)` is `attnlab.explore.explore(model, inputs)`)."""
    if name == "explore":
        import importlib

        return importlib.import_module("attnlab.explore")
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
