"""ONNX export of attnlab.MultiHeadAttention with dynamic batch and token axes, through
PyTorch's exporter (torch.onnx.export with dynamo=True). onnx, onnxscript and onnxruntime
are the optional extra `pip install 'attnlab[onnx]'`.

The exported graph takes x (batch, tokens, d_in) and, with padding_mask=True, keep
(batch, tokens), a bool tensor True for real tokens; its output is (batch, tokens, d_out).
Causal masking, windows and rotary positions are part of the graph; the KV cache and
cross-attention are not (a graph per decoding step is out of scope here).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from attnlab import masks
from attnlab.attention import MultiHeadAttention


class _Exported(nn.Module):
    """The module as ONNX sees it: self-attention over x, optional padding keep-mask."""

    def __init__(self, module: MultiHeadAttention, padding_mask: bool) -> None:
        super().__init__()
        self.module = module
        self.padding_mask = padding_mask

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        mask = masks.padding_mask(keep) if self.padding_mask else None  # (b, 1, 1, t)
        return self.module(x, mask=mask)


def export_onnx(
    module: MultiHeadAttention, path: str | Path, *, padding_mask: bool = False
) -> Path:
    """Write `module` (self-attention, in eval mode) to `path` as ONNX; batch and token
    counts (2 to context_length) are dynamic. Returns the path."""
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(
            f"module must be an attnlab.MultiHeadAttention, got {type(module).__name__}"
        )
    if not module.fused:
        raise ValueError(
            f"ONNX export covers self-attention; this module reads keys and values from a "
            f"context of width {module.context_dim} != d_in ({module.d_in})"
        )
    if module.context_length < 3:
        raise ValueError(f"context_length ({module.context_length}) must be at least 3")
    path = Path(path)
    wrapper = _Exported(module, padding_mask).eval()
    tokens = min(8, module.context_length - 1)
    weight = module.out_proj.weight
    x = torch.randn(2, tokens, module.d_in, dtype=weight.dtype, device=weight.device)
    batch_dim = torch.export.Dim("batch", min=1, max=4096)
    token_dim = torch.export.Dim("tokens", min=2, max=module.context_length)
    inputs, shapes = (x,), {"x": {0: batch_dim, 1: token_dim}}
    if padding_mask:
        inputs += (torch.ones(2, tokens, dtype=torch.bool, device=weight.device),)
        shapes["keep"] = {0: batch_dim, 1: token_dim}
    with torch.no_grad(), _quiet_exporter():
        torch.onnx.export(
            wrapper,
            inputs,
            str(path),
            dynamo=True,
            dynamic_shapes=shapes,
            input_names=["x", "keep"][: len(inputs)],
            output_names=["out"],
            verbose=False,  # its progress lines on stdout
        )
    return path


# torch.export's own deepcopy of a pytree LeafSpec (in run_decompositions) trips torch's
# deprecation of that class: PyTorch's internals, nothing the caller or attnlab passes
_LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
# keep's axes are x's (one Dim object each): the exporter warns it renames them only once
_SHARED_AXIS = r"# The axis name: (batch|tokens) will not be used, since it shares the same shape"


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter without its chatter: torch.onnx's warning-level log lines (optional
    torchvision operators it skips), torch.export's LeafSpec FutureWarning and the note
    that keep's axes share x's names. Errors and
    every other warning still reach the caller; the log level is restored after."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_LEAFSPEC_DEPRECATION, category=FutureWarning)
            warnings.filterwarnings("ignore", message=_SHARED_AXIS, category=UserWarning)
            yield
    finally:
        logger.setLevel(level)
