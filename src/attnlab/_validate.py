"""Argument checks shared by every public class and function.

Each check raises ValueError or TypeError whose message names the argument and the value it
got, so a user reads what to fix instead of a torch internal error. No `assert`: `python -O`
strips those.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch

from attnlab import debug


def check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """Return `value` if it is an int >= minimum (bool is refused: True is not a size)."""
    if type(value) is int and value >= minimum:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


# The one bound on every size, count and position attnlab takes (tokens, keys, heads,
# widths, positions, offsets; a window wider than any position means no window and is
# clamped instead) and on the elements of a tensor built from them (queries x keys,
# positions x head_dim): 2**40, about 1.1e12. No real run comes near it (a million-token
# context is 2**20; 2**40 one-byte elements are a terabyte), and below it position
# arithmetic stays exact: offset + tokens, key - query and the like stay far from int64's
# 2**63 (no wrap-around) and below 2**53, where float64 (RoPE's angles) still holds every
# integer. A value past it is a mistake, refused by name before a loop, a list or a tensor
# of that size is started (which would hang, or overflow inside torch).
MAX_SIZE = 2**40


def check_size(name: str, value: object, *, minimum: int = 1) -> int:
    """Return `value` if it is an int in [minimum, MAX_SIZE] (check_int, bounded).

    Args:
        name: the argument's name for the message; for a product of sizes, the product in
            words with its factors, e.g. "num_queries x num_keys (3 x 4)".
        value: what the caller passed (a numpy integer included; bool refused).
        minimum: the smallest accepted value.

    Returns:
        `value` as a Python int.

    Raises:
        TypeError: not an integer.
        ValueError: below minimum, or above MAX_SIZE.
    """
    if type(value) is int and minimum <= value <= MAX_SIZE:  # the common case, cheaply
        return value
    if isinstance(value, torch.SymInt):  # a traced tensor's size (export): bounded by it,
        return value  # and int() or formatting it would specialise the trace
    value = check_int(name, value, minimum=minimum)
    if value > MAX_SIZE:
        raise ValueError(
            f"{name} must be at most {MAX_SIZE:,} (2**40, attnlab's bound on any size or "
            f"position), got {value:,}"
        )
    return value


def check_product(names: str, *sizes: int) -> int:
    """Return the product of checked sizes if it is at most MAX_SIZE (a tensor's elements).

    Args:
        names: the factors' names joined by " x ", e.g. "batch_size x max_tokens".
        *sizes: the factors, each already checked by check_size.

    Returns:
        The product, as a Python int.

    Raises:
        ValueError: the product is past MAX_SIZE (2**40).
    """
    product = math.prod(sizes)
    if isinstance(product, torch.SymInt):  # traced: formatting would specialise the trace
        return product
    factors = " x ".join(str(size) for size in sizes)
    return check_size(f"{names} ({factors})", product, minimum=0)


def check_bool(name: str, value: object) -> bool:
    """Return `value` if it is a bool (a string such as "no" would silently mean True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def check_dropout(name: str, value: object) -> float:
    """Return `value` as a float if it is a probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(value).__name__} ({value!r})")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


def check_divides(divisor_name: str, divisor: int, dividend_name: str, dividend: int) -> None:
    """Raise unless `divisor` divides `dividend` (e.g. num_heads must divide d_out)."""
    if dividend % divisor != 0:
        raise ValueError(f"{divisor_name} ({divisor}) must divide {dividend_name} ({dividend})")


def check_tensor(
    name: str,
    x: object,
    *,
    ndims: Sequence[int],
    layout: str,
    last_dim: int | None = None,
    last_dim_name: str = "d_in",
    floating: bool = True,
) -> torch.Tensor:
    """Check that `x` is a tensor of one of `ndims` ranks (floating-point unless `floating` is
    False) with last dimension `last_dim`.

    `layout` is the expected shape in words, e.g. "(batch, tokens, d_in)", for the message.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() not in ndims:
        raise ValueError(
            f"{name} must have shape {layout} ({_ranks(ndims)}), got shape {tuple(x.shape)}"
        )
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if last_dim is not None and x.shape[-1] != last_dim:
        raise ValueError(
            f"{name} has last dimension {x.shape[-1]} but {last_dim_name} is {last_dim} "
            f"(shape {tuple(x.shape)})"
        )
    return x


def check_like_module(name: str, x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """Raise if `x` has another dtype or device than the module's parameters, naming the fix."""
    param = next(module.parameters(), None)
    return x if param is None else check_like_parameter(name, x, param)


def check_like_parameter(name: str, x: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """check_like_module against one parameter (cheaper, for per-token calls)."""
    if x.dtype != param.dtype:
        raise TypeError(
            f"{name} has dtype {x.dtype} but the module's parameters are {param.dtype}; "
            f"convert one of them (module.to({x.dtype}) or {name}.to({param.dtype}))"
        )
    if not (x.is_cpu and param.is_cpu) and x.device != param.device:  # devices built once
        raise ValueError(
            f"{name} is on {x.device} but the module's parameters are on {param.device}"
        )
    return x


def check_broadcasts_to(name: str, mask: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """Raise unless `mask` broadcasts to exactly `shape` (`what` names that shape's axes)."""
    try:
        fits = torch.broadcast_shapes(mask.shape, shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to the scores' {what} = "
            f"{shape}"
        )


def check_mask_kind(name: str, mask: object) -> torch.Tensor:
    """Return `mask` if it is a bool tensor (True = may attend) or an additive float one."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool or float tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{name} must be bool (True = may attend) or an additive float mask, "
            f"got dtype {mask.dtype}"
        )
    return mask


def check_tokens(name: str, num_tokens: int, context_length: int) -> None:
    """Raise if a sequence is longer than the causal mask the module was built for."""
    if num_tokens > context_length:
        raise ValueError(
            f"{name} has {num_tokens} tokens, more than context_length ({context_length})"
        )


def _ranks(ndims: Sequence[int]) -> str:
    return " or ".join(f"{n}-D" for n in ndims)


def check_finite(name: str, t: torch.Tensor) -> torch.Tensor:
    """Return `t` if every value is finite, else raise ValueError naming the first bad index.

    Runs where attnlab.debug.reads_values says (by default on CPU tensors only: elsewhere a
    read is a host-device synchronisation), never while compiling or exporting.
    """
    if not debug.reads_values(t) or bool(torch.isfinite(t.sum())):  # one read; exact below
        return t
    bad = ~torch.isfinite(t)  # a sum can overflow with finite values: look at each one
    if bool(bad.any()):
        index = tuple(torch.nonzero(bad)[0].tolist())
        raise ValueError(f"{name} has a non-finite value ({t[index].item()}) at index {index}")
    return t


def largest_magnitude(t: torch.Tensor) -> float:
    """max |t| as a Python float, NaN if t holds a NaN, 0.0 if it is empty (a value read: the
    caller checks debug.reads_values), from one pass that makes no |t| copy (t may be a
    static cache's whole buffer): `aminmax`, about 10x faster on the CPU than
    `vector_norm(ord=inf)` over a 12 MB cache (0.66 against 7.1 ms, 2 threads)."""
    if not t.numel():
        return 0.0
    low, high = torch.stack(torch.aminmax(t.detach())).tolist()  # NaN in both if t has one
    return max(-low, high)


_MODULE_OVERFLOW = (
    "the projections or the scores overflowed (x's values times the weights, or the scale "
    "times q . k, past the dtype's largest value)"
)


def check_finite_result(result: object, cause: str = _MODULE_OVERFLOW) -> object:
    """Return `result` (an output tensor, or a tuple whose first item is one) if the output
    is finite, else raise ValueError: every input was finite, so the arithmetic overflowed,
    and `cause` says where (default: a module's projections or scores). Runs where
    attnlab.debug.reads_values says (CPU by default)."""
    out = result[0] if isinstance(result, tuple) else result
    if not debug.reads_values(out) or bool(torch.isfinite(out.sum())):  # one read
        return result
    if not bool(torch.isfinite(out).all()):  # a sum can overflow with finite values
        raise ValueError(f"the output is not finite though every input is: {cause}")
    return result


def check_additive_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """Return a float mask if its values are finite or -inf (blocked); NaN and +inf have no
    meaning as an additive mask (NaN would be read as blocked, +inf makes the row NaN).
    Runs where attnlab.debug.reads_values says (by default on CPU tensors only)."""
    if mask.dtype == torch.bool or not debug.reads_values(mask):
        return mask
    bad = torch.isnan(mask) | (mask == torch.inf)
    if bool(bad.any()):
        index = tuple(torch.nonzero(bad)[0].tolist())
        raise ValueError(
            f"{name} holds {mask[index].item()} at index {index}: an additive mask takes "
            f"finite values, or -inf where a query may not attend"
        )
    return mask


def check_float(
    name: str, value: object, *, greater_than: float | None = None, at_least: float | None = None
) -> float:
    """Return `value` as a float if it is a finite real number (a numpy float or integer
    included; bool refused) above `greater_than` / at least `at_least`.

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
        greater_than: an exclusive lower bound, or None.
        at_least: an inclusive lower bound, or None.

    Returns:
        `value` as a Python float.

    Raises:
        TypeError: `value` is not a real number (or is a bool).
        ValueError: it is NaN, infinite or below the bound.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} ({value!r})")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value}")
    if greater_than is not None and not number > greater_than:
        raise ValueError(f"{name} must be > {greater_than}, got {value}")
    if at_least is not None and not number >= at_least:
        raise ValueError(f"{name} must be >= {at_least}, got {value}")
    return number


def check_dim(name: str, dim: object, ndim: int) -> int:
    """Return `dim` as a non-negative axis of a tensor of `ndim` dimensions.

    Args:
        name: the argument's name, for the message.
        dim: an int (a numpy integer included, bool refused), negative counting from the end.
        ndim: the tensor's number of dimensions.

    Returns:
        The axis in [0, ndim).

    Raises:
        TypeError: `dim` is not an integer.
        ValueError: it is outside [-ndim, ndim).
    """
    if isinstance(dim, bool):
        raise TypeError(f"{name} must be an int, got bool ({dim!r})")
    try:
        axis = operator.index(dim)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(dim).__name__} ({dim!r})") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name} ({axis}) is out of range for a {ndim}-D tensor")
    return axis % ndim


def check_index_tensor(name: str, x: object, *, ndims: Sequence[int] = (1,)) -> torch.Tensor:
    """Return `x` if it is an integer tensor (not bool, not floating) of one of `ndims` ranks.

    Args:
        name: the argument's name, for the message.
        x: what the caller passed.
        ndims: the accepted numbers of dimensions.

    Returns:
        `x`, unchanged.

    Raises:
        TypeError: `x` is not a tensor, or not of an integer dtype.
        ValueError: it has another number of dimensions.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    if x.dim() not in ndims:
        raise ValueError(f"{name} must be {_ranks(ndims)}, got shape {tuple(x.shape)}")
    return x


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor given by keyword is on one device, naming each."""
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        found = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"{' and '.join(tensors)} must be on one device, got {found}")


def check_float_dtype(name: str, dtype: object) -> torch.dtype:
    """Return `dtype` if it is a floating-point torch.dtype (a string such as "float32" is
    refused: torch takes none)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__} ({dtype!r})")
    if not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point dtype, got {dtype}")
    return dtype


def check_device(name: str, device: object) -> torch.device | None:
    """Return `device` as a torch.device (None stays None: torch's default).

    Args:
        name: the argument's name, for the message.
        device: a torch.device, a str such as "cpu" or "cuda:0", an int (a CUDA index), or
            None.

    Returns:
        The torch.device, or None.

    Raises:
        TypeError: another type (bool refused).
        ValueError: a string torch does not know as a device.
    """
    if device is None or isinstance(device, torch.device):
        return device
    if not isinstance(device, (str, int)) or isinstance(device, bool):
        raise TypeError(f"{name} must be a torch.device, str or None, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"{name} {device!r} is not a device torch knows: {error}") from None
