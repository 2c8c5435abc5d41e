"""Matrix-vector products for decoding: a few rows through a large weight on the CPU.

Producing one token multiplies a vector by each projection weight, which is bound by reading
the weight from memory. MKL's matrix-vector path reads an (out, in) weight at about half the
machine's read bandwidth; splitting the weight into blocks of rows and multiplying them in
one batched product reads it close to full speed (measured 1.7x to 1.9x faster for 1 or 2
rows with the weights in memory, about 1.2x for 16 rows, nothing past 32).

attnlab.plan decides when a projection may be computed here instead of called (a plain
nn.Linear without hooks, local or global); this module only multiplies.
"""

from __future__ import annotations

import torch

from attnlab import decode_cpu

_BLOCKS = 4  # blocks of weight rows, one batched matrix product each
# torch's own batched products, not the names torch.bmm / torch.baddbmm (which a user may
# patch): this module stands for F.linear, which never calls them
_BMM = torch._C._VariableFunctions.bmm
_BADDBMM = torch._C._VariableFunctions.baddbmm
_MAX_ROWS = 32  # beyond this, the GEMM path is as fast


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (..., in), weight (out, in) contiguous with out a
    multiple of 4 and bias None or (out,), by blocks of weight rows (helps says when); by
    the native decode step's projection kernel where it applies (_native_takes)."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    if _native_takes(x, weight, bias):
        flat = x.reshape(rows, in_features).contiguous()  # (m, in)
        y = decode_cpu.linear_rows(flat, weight, bias)  # (m, out)
        return y.view(*x.shape[:-1], out_features)  # (..., out)
    flat = x.reshape(1, rows, in_features).expand(_BLOCKS, rows, in_features)  # (p, m, in)
    blocks = weight.view(_BLOCKS, out_features // _BLOCKS, in_features)  # (p, out/p, in)
    if bias is None:
        y = _BMM(flat, blocks.transpose(1, 2))  # (p, m, out/p)
    else:
        y = _BADDBMM(bias.view(_BLOCKS, 1, -1), flat, blocks.transpose(1, 2))
    return y.transpose(0, 1).reshape(*x.shape[:-1], out_features)  # (p, m, out/p) -> (..., out)


def _native_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the native kernel computes this product: decode_cpu.computes (float32, no
    gradient, autocast or tangent wanted, the extension already loaded: a cache made for
    decoding builds it, a few rows never start a 15 s build) with a contiguous weight and
    bias."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    contiguous = weight.is_contiguous() and (bias is None or bias.is_contiguous())
    return contiguous and decode_cpu.computes(*tensors)


def few_rows(x: torch.Tensor) -> bool:
    """True when x (..., in) is few enough rows on the CPU for linear to be the faster."""
    return x.is_cpu and x.shape[-1] > 0 and x.numel() // x.shape[-1] <= _MAX_ROWS


def helps(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when linear is faster than F.linear for x: few rows on the CPU (few_rows), a
    weight whose rows split into the blocks."""
    return few_rows(x) and weight.shape[0] % _BLOCKS == 0
