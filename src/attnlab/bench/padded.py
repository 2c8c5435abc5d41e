"""`attnlab bench --padded`: a left-padded batch against an unpadded one, through a
GPT-2-small-sized stack of attnlab.MultiHeadAttention blocks and through attention alone,
with attnlab's default backend and with PyTorch's SDPA, side by side in one run.

A padded batch hands attention a causal & padding mask. attnlab runs it as the causal
kernel over each sequence's real keys (attnlab.padded); the "sdpa" backend runs SDPA's masked
path. The figures: padded over unpadded per backend, and attnlab over SDPA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from attnlab import masks
from attnlab.attention import MultiHeadAttention
from attnlab.bench.timing import interleaved_medians
from attnlab.functional import attention

GPT2_SMALL = {"layers": 12, "d_model": 768, "heads": 12, "tokens": 512, "batch": 4}
QUICK_PADDED = {"layers": 2, "d_model": 64, "heads": 4, "tokens": 64, "batch": 4}
BACKENDS = ("auto", "sdpa")


@dataclass
class PaddedReport:
    """Median seconds per forward, by (what, backend, batch kind)."""

    sizes: dict
    lengths: list[int]
    seconds: dict[str, float] = field(default_factory=dict)

    def ratio(self, numerator: str, denominator: str) -> float:
        return self.seconds[numerator] / self.seconds[denominator]

    def to_dict(self) -> dict:
        ratios = {
            f"{what} {backend} padded/unpadded": self.ratio(
                f"{what} {backend} padded", f"{what} {backend} unpadded"
            )
            for what in ("model", "attention")
            for backend in BACKENDS
        }
        ratios |= {
            f"{what} attnlab/sdpa {kind}": self.ratio(f"{what} auto {kind}", f"{what} sdpa {kind}")
            for what in ("model", "attention")
            for kind in ("unpadded", "padded")
        }
        return {**asdict(self), "ratios": ratios}


class _Block(nn.Module):
    """A GPT-2 block: pre-norm attention and MLP, residuals."""

    def __init__(self, d_model: int, heads: int, context: int, backend: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(
            d_model, d_model, context, 0.0, heads, qkv_bias=True, backend=backend
        )
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.mlp(self.ln2(x))


def _stack(sizes: dict, backend: str) -> nn.ModuleList:
    torch.manual_seed(0)
    blocks = [
        _Block(sizes["d_model"], sizes["heads"], sizes["tokens"], backend)
        for _ in range(sizes["layers"])
    ]
    return nn.ModuleList(blocks).eval()


def _model_call(stack: nn.ModuleList, x: torch.Tensor, mask) -> Callable[[], object]:
    def forward() -> torch.Tensor:
        with torch.no_grad():
            h = x
            for block in stack:
                h = block(h, mask)
            return h

    return forward


def left_padded_lengths(batch: int, tokens: int) -> list[int]:
    """Real tokens per sequence: the full length, then shorter by an eighth, a quarter, a
    half (and so on, cycling): a batch of prompts of different lengths."""
    fractions = (1.0, 0.875, 0.75, 0.5)
    return [max(1, int(tokens * fractions[i % len(fractions)])) for i in range(batch)]


def run_padded(
    *, quick: bool = False, progress: Callable[[str], None] | None = None
) -> PaddedReport:
    """Time the stack and attention alone, unpadded and left-padded, on both backends."""
    sizes = dict(QUICK_PADDED if quick else GPT2_SMALL)
    batch, tokens, d_model = sizes["batch"], sizes["tokens"], sizes["d_model"]
    lengths = left_padded_lengths(batch, tokens)
    keep = torch.arange(tokens) >= (tokens - torch.tensor(lengths))[:, None]  # (b, t)
    batch_masks = {"unpadded": None, "padded": masks.padding_mask(keep)}  # (b, 1, 1, t)
    x = torch.randn(batch, tokens, d_model, generator=torch.Generator().manual_seed(1))
    heads, head_dim = sizes["heads"], d_model // sizes["heads"]
    q, k, v = (torch.randn(batch, heads, tokens, head_dim) for _ in range(3))
    candidates = {}
    for backend in BACKENDS:
        stack = _stack(sizes, backend)
        for kind, mask in batch_masks.items():
            candidates[f"model {backend} {kind}"] = _model_call(stack, x, mask)
            candidates[f"attention {backend} {kind}"] = _attention_call(q, k, v, mask, backend)
    if progress:
        progress("timing")
    seconds = interleaved_medians(candidates, rounds=1 if quick else 3, min_run_time=0.05)
    return PaddedReport(sizes, lengths, seconds)


def _attention_call(q, k, v, mask, backend: str) -> Callable[[], object]:
    def call() -> torch.Tensor:
        with torch.no_grad():
            return attention(q, k, v, mask=mask, causal=True, backend=backend)

    return call


def print_padded(report: PaddedReport, console: Console | None = None) -> None:
    """The medians and the two ratios the padded batch is judged by."""
    console = console or Console()
    sizes = report.sizes
    table = Table(
        title=f"{sizes['layers']} layers x d_model {sizes['d_model']}, {sizes['heads']} heads, "
        f"batch {sizes['batch']} x {sizes['tokens']} tokens; padded lengths {report.lengths}"
    )
    for column in ("what", "backend", "unpadded ms", "padded ms", "padded / unpadded"):
        table.add_column(column, justify="left" if column in ("what", "backend") else "right")
    for what in ("model", "attention"):
        for backend in BACKENDS:
            unpadded = report.seconds[f"{what} {backend} unpadded"]
            padded = report.seconds[f"{what} {backend} padded"]
            name = "attnlab" if backend == "auto" else "sdpa"
            cells = (f"{unpadded * 1e3:.1f}", f"{padded * 1e3:.1f}", f"{padded / unpadded:.2f}")
            table.add_row(what, name, *cells)
    console.print(table)
    for what in ("model", "attention"):
        unpadded = report.ratio(f"{what} auto unpadded", f"{what} sdpa unpadded")
        padded = report.ratio(f"{what} auto padded", f"{what} sdpa padded")
        console.print(f"{what}: attnlab / sdpa = {unpadded:.2f} unpadded, {padded:.2f} padded")
