"""Weights a constructor leaves unset, filled before the audit.

Reference implementations written to load a checkpoint often leave their projections
uninitialised: Meta's Llama builds fairscale's parallel layers with `init_method=lambda x: x`
over `torch.Tensor(out, in)`, whose values are whatever the memory held (NaN, 1e38, or all
zeros, or plausible values that differ from run to run). An audit of such weights says
little about the code and is not repeatable: NaN outputs read as a broken mask, zeros make
every output equal. The audit is of the computation, not of the values, so such a weight is
filled from the seed, as a fresh nn.Linear would be, and the report says which. A weight is
unset when two builds from the same random state disagree on it (`unseeded`), or when it
is non-finite, huge or all zero.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# no trained or freshly initialised projection holds a weight this large
_UNSET_MAGNITUDE = 1e4


def unseeded(first: nn.Module, second: nn.Module) -> set[str]:
    """Names of the floating parameters on which two builds from the same random state
    differ: the constructor did not set them from the seed."""
    theirs = dict(second.named_parameters())
    return {
        name
        for name, mine in first.named_parameters()
        if mine.is_floating_point()
        and name in theirs
        and not torch.equal(mine.detach(), theirs[name].detach())
    }


def fill_unset(module: nn.Module, seed: int, unseeded_names: set[str]) -> list[str]:
    """Fill every matrix parameter named in `unseeded_names`, or holding a non-finite value,
    a value above 1e4 in magnitude or only zeros, with uniform(-1/sqrt(fan_in),
    1/sqrt(fan_in)) drawn from `seed` and the parameter's name (the same values at every
    build).

    Returns:
        The names of the parameters filled, in registration order.
    """
    filled = []
    for name, parameter in module.named_parameters():
        matrix = parameter.dim() >= 2 and parameter.is_floating_point()
        if matrix and (name in unseeded_names or _unset(parameter)):
            _fill(parameter, seed, name)
            filled.append(name)
    return filled


def _unset(parameter: torch.Tensor) -> bool:
    values = parameter.detach()
    if not bool(torch.isfinite(values).all()):
        return True
    largest = float(values.abs().max()) if values.numel() else 0.0
    return largest == 0.0 or largest > _UNSET_MAGNITUDE


def _fill(parameter: nn.Parameter, seed: int, name: str) -> None:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, name)))
    bound = 1 / math.sqrt(parameter.shape[-1])  # weight (out, in): fan_in is the last size
    values = torch.rand(parameter.shape, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        parameter.copy_((values * 2 - 1) * bound)
