"""`attnlab bench --kernel`: attnlab's causal CPU kernel against PyTorch's SDPA by context
length and head layout, forward and forward + backward, side by side in one run.

The attention core alone, (2, 12, t, 64) queries against 12, 4 or 1 key/value heads
(multi-head, grouped-query, multi-query), at 256 to 4096 tokens, float32: attnlab's kernel
(`backend="flash"`: its forward and its own backward, grouped heads read in place) against
`F.scaled_dot_product_attention(is_causal=True, enable_gqa=...)`, and the "auto" backend's
own choice beside them. Forward runs under torch.no_grad; forward + backward is the sum of
the output, backward, and the gradients set to None. Each shape's four timed calls (and
auto's two) are measured in interleaved rounds (attnlab.bench.timing), so that drift on a
shared machine hits every candidate alike; the figure of merit is SDPA's time over the
kernel's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from attnlab.bench.peers import machine_name
from attnlab.bench.timing import interleaved_medians
from attnlab.functional import attention

KERNEL_SHAPE = {"batch": 2, "heads": 12, "head_dim": 64}
KERNEL_LENGTHS = (256, 512, 1024, 2048, 4096)
KERNEL_KV_HEADS = (12, 4, 1)
DEFAULT_KERNEL = {"lengths": KERNEL_LENGTHS, "rounds": 3, "min_run_time": 0.3}
QUICK_KERNEL = {"lengths": (64, 128), "rounds": 1, "min_run_time": 0.01}
FORWARD, BACKWARD = "forward", "forward+backward"
CANDIDATES = ("kernel", "sdpa", "auto")


@dataclass
class KernelRow:
    """Median seconds per call of each candidate at one length and head layout, one mode."""

    tokens: int
    kv_heads: int
    mode: str
    seconds: dict[str, float]

    @property
    def speedup(self) -> float:
        """SDPA's time over the kernel's (> 1: the kernel is faster)."""
        return self.seconds["sdpa"] / self.seconds["kernel"]

    @property
    def auto_over_best(self) -> float:
        """auto's time over the faster of kernel and SDPA (1.0: auto chose the faster)."""
        return self.seconds["auto"] / min(self.seconds["kernel"], self.seconds["sdpa"])


@dataclass
class KernelReport:
    machine: str
    threads: int
    torch_version: str
    batch: int
    heads: int
    head_dim: int
    rows: list[KernelRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain numbers for --json, the ratios included."""
        out = asdict(self)
        for row, raw in zip(self.rows, out["rows"], strict=True):
            raw.update(speedup=row.speedup, auto_over_best=row.auto_over_best)
        return out


def kernel_steps(quick: bool = False) -> int:
    """The number of progress steps run_kernel reports."""
    sizes = QUICK_KERNEL if quick else DEFAULT_KERNEL
    return len(sizes["lengths"]) * len(KERNEL_KV_HEADS)


def run_kernel(
    *, quick: bool = False, progress: Callable[[str], None] = lambda step: None
) -> KernelReport:
    """Time kernel, SDPA and auto, forward and forward + backward, at every length of
    KERNEL_LENGTHS (quick: 64 and 128 tokens, one short round) for each of KERNEL_KV_HEADS."""
    sizes = QUICK_KERNEL if quick else DEFAULT_KERNEL
    report = KernelReport(
        machine_name(torch.device("cpu")),
        torch.get_num_threads(),
        torch.__version__,
        KERNEL_SHAPE["batch"],
        KERNEL_SHAPE["heads"],
        KERNEL_SHAPE["head_dim"],
    )
    for tokens in sizes["lengths"]:
        for kv_heads in KERNEL_KV_HEADS:
            progress(f"{tokens} tokens, {KERNEL_SHAPE['heads']}/{kv_heads} heads")
            q, k, v = _qkv(tokens, kv_heads)
            calls = {
                (mode, name): _step(_attend(name, kv_heads), q, k, v, mode)
                for mode in (FORWARD, BACKWARD)
                for name in CANDIDATES
            }
            medians = interleaved_medians(
                {f"{mode} {name}": call for (mode, name), call in calls.items()},
                rounds=sizes["rounds"],
                min_run_time=sizes["min_run_time"],
            )
            for mode in (FORWARD, BACKWARD):
                seconds = {name: medians[f"{mode} {name}"] for name in CANDIDATES}
                report.rows.append(KernelRow(tokens, kv_heads, mode, seconds))
    return report


def _qkv(tokens: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    b, h, d = KERNEL_SHAPE["batch"], KERNEL_SHAPE["heads"], KERNEL_SHAPE["head_dim"]
    q = torch.randn(b, h, tokens, d, generator=g)  # (b, hq, t, hd)
    k, v = (torch.randn(b, kv_heads, tokens, d, generator=g) for _ in "kv")  # (b, hkv, t, hd)
    return q, k, v


def _attend(name: str, kv_heads: int) -> Callable[..., torch.Tensor]:
    if name == "sdpa":
        gqa = kv_heads != KERNEL_SHAPE["heads"]
        return lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=gqa
        )
    backend = "flash" if name == "kernel" else "auto"
    return lambda q, k, v: attention(q, k, v, causal=True, backend=backend)


def _step(fn, q, k, v, mode: str) -> Callable[[], object]:
    if mode == FORWARD:

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return fn(q, k, v)

        return forward
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def forward_backward() -> None:
        fn(*leaves).sum().backward()
        for t in leaves:
            t.grad = None

    return forward_backward


def print_kernel(report: KernelReport, console: Console | None = None) -> None:
    """One row per length and head layout: each mode's kernel and SDPA medians, SDPA over
    kernel, and auto over the faster of the two."""
    console = console or Console()
    console.print(
        f"{report.machine}, {report.threads} threads, torch {report.torch_version}; attention "
        f"core ({report.batch}, {report.heads}, t, {report.head_dim}) float32, causal; x = SDPA "
        f"ms / kernel ms; auto = auto ms / the faster's ms"
    )
    table = Table(title="attnlab's causal kernel against SDPA")
    columns = ("tokens", "heads q/kv", "fwd kernel", "fwd SDPA", "x", "auto", "f+b kernel")
    for column in (*columns, "f+b SDPA", "x ", "auto "):
        table.add_column(column, justify="right")
    rows = {(row.tokens, row.kv_heads, row.mode): row for row in report.rows}
    for tokens, kv_heads in dict.fromkeys((row.tokens, row.kv_heads) for row in report.rows):
        cells = [str(tokens), f"{report.heads}/{kv_heads}"]
        for mode in (FORWARD, BACKWARD):
            row = rows[tokens, kv_heads, mode]
            cells += [
                f"{row.seconds['kernel'] * 1e3:.1f}",
                f"{row.seconds['sdpa'] * 1e3:.1f}",
                f"{row.speedup:.2f}",
                f"{row.auto_over_best:.2f}",
            ]
        table.add_row(*cells)
    console.print(table)
