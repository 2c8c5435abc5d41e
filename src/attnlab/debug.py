"""Value checks: the argument checks that read tensor values, and the one switch for them.

Most of attnlab's checks read what a tensor's metadata says (shapes, dtypes, devices, sizes)
and run on every call. A few must read values: that the inputs are finite (q, k, v, x,
sinks) and that an additive mask holds no NaN or +inf. On a CPU tensor such a read is a
memory read, so those checks run by default there. On a GPU each read is a host-device
synchronisation: it stalls the launch queue and makes CUDA-graph capture impossible, so on
any device other than the CPU they run only when debug checks are on:

- the environment variable ``ATTNLAB_DEBUG=1`` (read once, when attnlab is imported), or
- ``with attnlab.debug.checks():`` around the calls (``checks(False)`` turns them off,
  the CPU's included).

Without them, a NaN or infinite input on a GPU propagates as it does through PyTorch's
``scaled_dot_product_attention`` (the rows that read it come out NaN); a fully masked row
still gives zeros. No value is read while torch.compile traces, whatever the switch says.

Examples:
    >>> import torch, attnlab
    >>> with attnlab.debug.checks():
    ...     attnlab.debug.reads_values(torch.zeros(1))
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

ENV_VAR = "ATTNLAB_DEBUG"
_FROM_ENV = os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")
_forced: contextvars.ContextVar[bool | None] = contextvars.ContextVar("attnlab_debug", default=None)


def enabled() -> bool | None:
    """Whether debug checks are forced on (True) or off (False) by `checks`, else whether
    ATTNLAB_DEBUG turned them on (True) or not (None: the default, per device)."""
    forced = _forced.get()
    if forced is not None:
        return forced
    return True if _FROM_ENV else None


@contextlib.contextmanager
def checks(on: bool = True) -> Iterator[None]:
    """Run the value checks on every device (on=True), or on none (on=False), inside the
    block; the setting before it comes back after, also when the block raises.

    Args:
        on: the checks' state inside the block.

    Yields:
        None.

    Raises:
        TypeError: `on` is not a bool.
    """
    if not isinstance(on, bool):
        raise TypeError(f"on must be a bool, got {type(on).__name__}")
    token = _forced.set(on)
    try:
        yield
    finally:
        _forced.reset(token)


def in_func_transform() -> bool:
    """True inside a torch.func transform (vmap, grad, jvp, functionalize), where tensors
    are wrappers and in-place writes to captured tensors are refused. False while
    torch.compile traces (its own tracing keeps such a stack; it handles transforms itself)."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._functorch.peek_interpreter_stack() is not None
    )


def under_transform() -> bool:
    """True inside a torch.func transform (in_func_transform) or a forward-mode AD level
    (torch.autograd.forward_ad.dual_level): there a tensor may be a wrapper whose memory is
    not its values, and a value read (.item()) is refused. False while torch.compile
    traces."""
    if torch.compiler.is_compiling():
        return False
    return in_func_transform() or torch.autograd.forward_ad._current_level >= 0


def reads_values(t: torch.Tensor) -> bool:
    """Whether a value check runs on `t` now: never while torch.compile traces or a
    torch.func transform or forward-mode AD level is active (under_transform), nor on a
    tensor without values (meta); then as the switch says; by default only on the CPU.

    Args:
        t: the tensor a check would read.

    Returns:
        True when the check runs.
    """
    if torch.compiler.is_compiling():  # first: dynamo cannot trace the switch's read
        return False
    switch = enabled()  # then: on a GPU by default the answer needs nothing else
    would_read = t.is_cpu if switch is None else switch and t.device.type != "meta"
    return would_read and not under_transform()
