"""Peak memory: how much a call adds at its peak, and the long-context table (forward, batch
1, 1k to 32k tokens; attnlab's attention core also forward + backward) that shows which
implementations grow with tokens and which with tokens squared.

The figure, "peak", is the memory a call adds at its highest point above what was live
before it (inputs and weights), its output included. On CUDA it is
torch.cuda.max_memory_allocated after a reset, minus the memory allocated before the call.
On the CPU (Linux) it is the process's resident memory: free heap pages are handed back to
the system first (glibc's malloc_trim, so that reused pages count), the kernel's high-water
mark is reset to the current resident size (writing 5 to /proc/self/clear_refs), and the
peak is the high-water mark after the call minus the resident size before it. Measured in
the same process, with no child to start. Where neither is available the figure is None.
The target for the attention core is linear growth: at most 2x the bytes of q, k, v and the
output, never the (tokens x tokens) scores.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from attnlab import functional
from attnlab.bench.peers import (
    Peer,
    Shape,
    machine_name,
    make_input,
    make_qkv,
    make_weights,
    module_peers,
)

MEMORY_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_MAX_BYTES = 2 * 2**30  # skip an implementation whose (b, h, t, t) scores exceed this
QUICK_MEMORY = {"lengths": (256, 512), "max_bytes": 8 * 2**20}  # 512 tokens skips the quadratic
MEMORY_PEERS = (
    "attnlab auto",
    "attnlab sdpa",
    "attnlab math",
    "nn.MultiheadAttention need_weights=True",
    "nanoGPT SDPA",
    "book MultiHeadAttention",
    "book MultiHeadAttentionWrapper",
)
CORE_NAME = "attnlab attention core"
CORE_BACKWARD_NAME = "attnlab attention core, forward + backward"
_WARMUP_TOKENS = 256  # a short call first: thread pools and libraries allocate once, not per call

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def peak_method(device: torch.device) -> str | None:
    """How peak_bytes measures on `device`, or None where it cannot."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated growth over the allocation before the call"
    if _STATUS.exists() and os.access(_CLEAR_REFS, os.W_OK):
        return "resident memory high-water mark (VmHWM, reset by /proc/self/clear_refs) growth"
    return None


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Bytes `fn()` adds at its peak above the memory live before it, its result included
    (see the module docstring); None where the device offers no way to measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del result
        return peak
    if peak_method(device) is None:
        return None
    _trim_heap()
    _CLEAR_REFS.write_text("5")  # the high-water mark restarts from the resident size
    before = _status_bytes("VmRSS")
    result = fn()
    peak = _status_bytes("VmHWM") - before
    del result
    return max(peak, 0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    library = ctypes.CDLL(name) if name else None
    return library if library is not None and hasattr(library, "malloc_trim") else None


def _trim_heap() -> None:
    """Hand free heap pages back to the system, so that a call reusing them shows up in the
    resident size (glibc only; elsewhere nothing)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _status_bytes(key: str) -> int:
    """A /proc/self/status figure given in kB (VmRSS, VmHWM), in bytes."""
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not found in {_STATUS}")


@dataclass
class MemoryRow:
    """One implementation at one length: its peak, against the bytes of q, k, v and the
    output; or why it was skipped and, for (t x t) scores, the bytes they would need."""

    name: str
    tokens: int
    io_bytes: int
    peak_bytes: int | None = None
    needs_bytes: int | None = None
    skipped: str = ""

    @property
    def ratio(self) -> float | None:
        """Peak over the bytes of q, k, v and the output (the target: at most 2)."""
        return None if self.peak_bytes is None else self.peak_bytes / self.io_bytes


@dataclass
class MemoryReport:
    machine: str
    device: str
    dtype: str
    batch: int
    d_model: int
    num_heads: int
    max_bytes: int
    method: str | None
    rows: list[MemoryRow] = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        return sorted({row.tokens for row in self.rows})

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(row.name for row in self.rows))

    def to_dict(self) -> dict:
        """Plain numbers for --json, the ratios included."""
        out = asdict(self)
        for row, raw in zip(self.rows, out["rows"], strict=True):
            raw["ratio"] = row.ratio
        return out


def memory_steps(lengths: Sequence[int] | None = None, *, quick: bool = False) -> int:
    """The number of progress steps run_memory reports."""
    return len(_settings(lengths, None, quick)[0]) * (len(MEMORY_PEERS) + 2)


def _settings(lengths, max_bytes, quick: bool) -> tuple[tuple[int, ...], int]:
    """The lengths and the scores limit: the ones given, else quick's or the defaults."""
    options = QUICK_MEMORY if quick else {"lengths": MEMORY_LENGTHS, "max_bytes": DEFAULT_MAX_BYTES}
    lengths = tuple(lengths or options["lengths"])
    return lengths, options["max_bytes"] if max_bytes is None else max_bytes


def run_memory(
    lengths: Sequence[int] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    d_model: int = 768,
    num_heads: int = 12,
    max_bytes: int | None = None,
    quick: bool = False,
    progress: Callable[[str], None] = lambda step: None,
) -> MemoryReport:
    """Forward peak memory (no_grad, batch 1) of each implementation and of attnlab's
    attention core alone at each length (default 1k to 32k tokens). Implementations that
    hold (b, h, t, t) float32 scores are skipped where those exceed max_bytes (default
    2 GiB), with the bytes they would need. quick: 256 and 512 tokens, limit 8 MiB."""
    device = torch.device(device)
    lengths, max_bytes = _settings(lengths, max_bytes, quick)
    peers = [peer for peer in module_peers() if peer.name in MEMORY_PEERS]
    peers.sort(key=lambda peer: MEMORY_PEERS.index(peer.name))
    report = MemoryReport(
        machine_name(device),
        str(device),
        str(dtype).removeprefix("torch."),
        1,
        d_model,
        num_heads,
        max_bytes,
        peak_method(device),
    )
    for tokens in lengths:
        shape = Shape(1, tokens, d_model, num_heads, dtype, device)
        weights, x = make_weights(shape), make_input(shape)
        for peer in peers:
            progress(f"{peer.name}, {tokens} tokens")
            report.rows.append(_module_row(peer, shape, weights, x, max_bytes))
        progress(f"{CORE_NAME}, {tokens} tokens")
        report.rows.append(_core_row(shape))
        progress(f"{CORE_BACKWARD_NAME}, {tokens} tokens")
        report.rows.append(_core_row(shape, backward=True))
        del weights, x
    return report


def _module_row(peer: Peer, shape: Shape, weights, x: torch.Tensor, max_bytes: int) -> MemoryRow:
    row = MemoryRow(peer.name, shape.tokens, shape.io_bytes)
    if peer.materialises_scores and shape.score_bytes > max_bytes:
        row.needs_bytes = shape.score_bytes
        row.skipped = f"(t x t) scores need {format_bytes(shape.score_bytes)}"
        return row
    try:
        module = peer.build(shape, weights).eval()

        def forward(tokens: int) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:
                with torch.no_grad():
                    return module(x[:, :tokens])

            return call

        forward(min(shape.tokens, _WARMUP_TOKENS))()
        row.peak_bytes = peak_bytes(forward(shape.tokens), shape.device)
    except (RuntimeError, NotImplementedError) as error:  # out of memory, unsupported dtype
        row.skipped = failure_reason(error)
    return row


def _core_row(shape: Shape, *, backward: bool = False) -> MemoryRow:
    """attnlab.functional.attention(q, k, v, causal=True) alone; q, k, v are inputs, so the
    peak is the output and whatever the kernel holds beside it. With `backward`, the call
    is forward + backward of the output's sum: the peak then also holds what the forward
    saves (output, logsumexp), the output's gradient and the gradients of q, k and v."""
    row = MemoryRow(CORE_BACKWARD_NAME if backward else CORE_NAME, shape.tokens, shape.io_bytes)
    q, k, v = make_qkv(shape)

    def attend(tokens: int) -> Callable[[], torch.Tensor]:
        first = slice(0, tokens)  # the first `tokens` positions, (b, h, tokens, hd)

        def call() -> torch.Tensor:
            with torch.no_grad():
                return functional.attention(
                    q[:, :, first], k[:, :, first], v[:, :, first], causal=True
                )

        def call_backward() -> tuple[torch.Tensor, ...]:
            leaves = [t[:, :, first].detach().requires_grad_() for t in (q, k, v)]
            out = functional.attention(*leaves, causal=True)
            return torch.autograd.grad(out.sum(), leaves)  # (b, h, tokens, hd) each

        return call_backward if backward else call

    try:
        attend(min(shape.tokens, _WARMUP_TOKENS))()
        row.peak_bytes = peak_bytes(attend(shape.tokens), shape.device)
    except (RuntimeError, NotImplementedError) as error:
        row.skipped = failure_reason(error)
    return row


def failure_reason(error: BaseException) -> str:
    """A one-line 'skipped' reason: the error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > 160:
        message = message[:157] + "..."
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def format_bytes(nbytes: float) -> str:
    """1536 -> '1.5 KiB', 3 * 2**30 -> '3.0 GiB': the unit that keeps the number readable."""
    units = ("B", "KiB", "MiB", "GiB")
    value, unit = float(nbytes), 0
    while abs(value) >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:,.0f} B" if unit == 0 else f"{value:,.1f} {units[unit]}"
