"""Conversions between attnlab.MultiHeadAttention and its neighbours: PyTorch's
nn.MultiheadAttention (`attnlab.interop.pytorch`), the book's MultiHeadAttention
(`attnlab.interop.book`), transformers (`attnlab.interop.hf`, extra `hf`) and ONNX
(`export_onnx`, extra `onnx`, loaded on use); and whole models with attnlab's attention
swapped in (`swap_book_attention`, `attnlab.interop.nanogpt`, `attnlab.interop.llama`,
`make_caches` for their cached forward: docs/guide/recipes.md). Weights are copied, never
shared, and each conversion gives the same outputs as its source.
"""

from attnlab.interop.book import (
    from_book,
    restore_book_attention,
    swap_book_attention,
    to_book,
)
from attnlab.interop.onnx import export_onnx
from attnlab.interop.pytorch import (
    DEFAULT_CONTEXT_LENGTH,
    from_torch,
    from_torch_masks,
    to_torch,
)
from attnlab.interop.swap import make_caches, replace_modules

__all__ = [
    "DEFAULT_CONTEXT_LENGTH",
    "export_onnx",
    "from_book",
    "from_torch",
    "from_torch_masks",
    "make_caches",
    "replace_modules",
    "restore_book_attention",
    "swap_book_attention",
    "to_book",
    "to_torch",
]
