"""`attnlab bench --parallel N`: ring attention over N CPU processes (gloo on loopback)
against one process, for one long causal sequence, forward and forward+backward: per-rank
peak memory, bytes each rank sends, the scores it computes, and its time.

One process runs PyTorch's F.scaled_dot_product_attention (its CPU flash kernel) on the
whole sequence. Then N processes run attnlab.parallel.ring_attention, once per
configuration: attnlab's ring in the contiguous and the zigzag layout, and PyTorch's
context-parallel engine (backend "torch") in the zigzag layout. Every process builds its own
part of q, k, v (batch 1, 12 heads of 64) from a seed and calls once on a short sequence
first (thread pools, gloo's connections). The forward runs under no_grad; the training pass
is the forward and torch.autograd.grad of q, k, v for a given output gradient. Memory per
rank is its inputs (q, k, v, and the output gradient for the training pass) plus the peak
the call adds above them (the resident high-water mark, as in --memory). Bytes sent are the
forward's ring transfers, (N - 1) key/value chunks per rank, the same for every
configuration (the backward sends them again, with their gradients);
scores are the query-key pairs the layout gives the rank (the balance of its work); CPU
seconds are the process's own, which stay meaningful when N processes share fewer cores.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from attnlab.bench.memory import peak_bytes
from attnlab.parallel.launch import exit_rank, free_loopback_port
from attnlab.parallel.layout import scores_per_rank

SINGLE = "1 process: PyTorch SDPA"
PASSES = ("forward", "forward+backward")
CONFIGS = {  # label: (backend, layout)
    "attnlab ring, contiguous": ("attnlab", "contiguous"),
    "attnlab ring, zigzag": ("attnlab", "zigzag"),
    "torch ring, zigzag": ("torch", "zigzag"),
}
_WARMUP_TOKENS = 64  # per rank


@dataclass
class RankRow:
    """One process of one run."""

    label: str
    step: str  # one of PASSES
    world: int
    rank: int
    input_bytes: int
    call_peak_bytes: int
    sent_bytes: int
    scores: int
    seconds: float
    cpu_seconds: float

    @property
    def total_bytes(self) -> int:
        return self.input_bytes + self.call_peak_bytes


@dataclass
class ParallelReport:
    tokens: int
    heads: int
    head_dim: int
    world: int
    rows: list[RankRow] = field(default_factory=list)

    def worst(self, label: str, step: str) -> RankRow:
        """The rank of a run with the most memory."""
        rows = (r for r in self.rows if (r.label, r.step) == (label, step))
        return max(rows, key=lambda r: r.total_bytes)

    def memory_ratio(self, label: str, step: str = "forward") -> float:
        """Largest per-rank memory of run `label` over one process's, in pass `step`."""
        return self.worst(label, step).total_bytes / self.worst(SINGLE, step).total_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        for row, raw in zip(self.rows, out["rows"], strict=True):
            raw["total_bytes"] = row.total_bytes
        out["memory_ratio"] = {
            step: {label: self.memory_ratio(label, step) for label in CONFIGS} for step in PASSES
        }
        return out


def run_parallel(
    world: int, *, tokens: int = 16384, heads: int = 12, head_dim: int = 64
) -> ParallelReport:
    """One process on the whole sequence, then `world` processes per configuration."""
    if world < 2:
        raise ValueError(f"world must be at least 2 processes, got {world}")
    if tokens % (2 * world) != 0:
        raise ValueError(
            f"tokens ({tokens}) must divide by twice the number of processes ({2 * world}) "
            f"for the zigzag layout"
        )
    report = ParallelReport(tokens, heads, head_dim, world)
    shape = (tokens, heads, head_dim)
    report.rows += _spawn(1, SINGLE, shape)
    for label in CONFIGS:
        report.rows += _spawn(world, label, shape)
    return report


def _spawn(world: int, label: str, shape: tuple[int, int, int]) -> list[RankRow]:
    queue = mp.get_context("spawn").SimpleQueue()
    port = free_loopback_port()
    mp.spawn(_rank, args=(world, port, label, shape, queue), nprocs=world, join=True)
    rows = [RankRow(**queue.get()) for _ in range(world * len(PASSES))]
    return sorted(rows, key=lambda r: (PASSES.index(r.step), r.rank))


def _attention_call(label: str):
    """What one process of run `label` calls on its q, k, v."""
    if label == SINGLE:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from attnlab.parallel import ring_attention

    backend, layout = CONFIGS[label]
    return lambda q, k, v: ring_attention(q, k, v, causal=True, layout=layout, backend=backend)


def _rank(rank, world, port, label, shape, queue) -> None:
    tokens, heads, head_dim = shape
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        call = _attention_call(label)
        generator = torch.Generator().manual_seed(rank)
        size = (1, heads, tokens // world, head_dim)
        layout = CONFIGS[label][1] if label in CONFIGS else "contiguous"
        facts = dict(
            label=label,
            world=world,
            rank=rank,
            sent_bytes=(world - 1) * 2 * math.prod(size) * 4,
            scores=heads * scores_per_rank(world, tokens, causal=True, layout=layout)[rank],
        )
        for step in PASSES:
            inputs = [torch.randn(size, generator=generator) for _ in range(4)]
            measure = _training_step if step == "forward+backward" else _forward
            measure(call, [t[:, :, :_WARMUP_TOKENS] for t in inputs])
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            peak = peak_bytes(functools.partial(measure, call, inputs), inputs[0].device)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            used = inputs if step == "forward+backward" else inputs[:3]
            queue.put(
                dict(
                    facts,
                    step=step,
                    input_bytes=sum(t.nbytes for t in used),
                    call_peak_bytes=peak or 0,
                    seconds=seconds,
                    cpu_seconds=cpu_seconds,
                )
            )
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_rank()


def _forward(call, inputs):
    """The forward alone, under no_grad."""
    with torch.no_grad():
        return call(*inputs[:3])


def _training_step(call, inputs):
    """Forward, then the gradients of q, k, v for the output gradient inputs[3]."""
    q, k, v = (t.detach().requires_grad_() for t in inputs[:3])
    return torch.autograd.grad(call(q, k, v), (q, k, v), inputs[3].contiguous())
