"""Whether two implementations computed the same thing, checked before either is timed (a
comparison of two different functions means nothing), and what a candidate that fails to
build, compile or run raises (it becomes a skipped row with the reason, not a crash)."""

from __future__ import annotations

import torch

# what torch.compile, a layer refusing its input or a missing kernel raise
FAILURES = (RuntimeError, ValueError, TypeError, NotImplementedError)
_RELATIVE = {4: 1e-3, 2: 5e-2}  # by element size: float32, and bfloat16/float16


def differs(out: torch.Tensor, reference: torch.Tensor, reference_name: str) -> str:
    """'' when `out` matches `reference` (max |difference| / max |reference| within the
    dtype's tolerance; integer tensors exactly), else a one-line reason naming the
    reference."""
    if not reference.dtype.is_floating_point:
        if out.shape == reference.shape and torch.equal(out, reference):
            return ""
        return f"differs from {reference_name}'s {_first_difference(out, reference)}"
    error = relative_error(out, reference)
    if error <= tolerance(reference.dtype):
        return ""
    return f"differs from {reference_name}'s by {error:.2g} of its largest value"


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """max |out - reference| / max |reference| (over 1 where the reference is all zeros)."""
    scale = reference.abs().max().item() or 1.0
    return (out.float() - reference.float()).abs().max().item() / scale


def tolerance(dtype: torch.dtype) -> float:
    """The relative_error two implementations computing in `dtype` may show."""
    return _RELATIVE.get(dtype.itemsize, 1e-3)


def _first_difference(out: torch.Tensor, reference: torch.Tensor) -> str:
    """Where two integer sequences (b, t) part: 'at token k', or their shapes."""
    if out.shape != reference.shape:
        return f"in shape: {tuple(out.shape)} against {tuple(reference.shape)}"
    columns = (out != reference).any(dim=0).nonzero()  # (k, 1): the differing tokens
    return f"from token {columns[0, 0].item()} on"
