"""`attnlab bench --parallel N`: ring attention over N CPU processes (gloo on loopback)
against one process, for one long sequence: per-rank peak memory, bytes each rank sends,
and time.

Every process builds its own chunk of q, k, v (batch 1, 12 heads of 64, causal) from the
same seed and runs attnlab.parallel.ring_attention forward under no_grad. Memory per rank
is its inputs plus the peak the call adds above them (the resident high-water mark, as in
--memory); one process holds the whole sequence and runs the same function on a group of
one. Bytes sent are counted from the ring's transfers: (N - 1) key/value chunks per rank.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnlab.bench.memory import peak_bytes


@dataclass
class RankRow:
    """One process of one run."""

    world: int
    rank: int
    input_bytes: int
    call_peak_bytes: int
    sent_bytes: int
    seconds: float

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

    def worst(self, world: int) -> RankRow:
        """The rank of a run with the most memory."""
        return max((r for r in self.rows if r.world == world), key=lambda r: r.total_bytes)

    @property
    def memory_ratio(self) -> float:
        """Largest per-rank memory at N processes over one process's."""
        return self.worst(self.world).total_bytes / self.worst(1).total_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        for row, raw in zip(self.rows, out["rows"], strict=True):
            raw["total_bytes"] = row.total_bytes
        out["memory_ratio"] = self.memory_ratio
        return out


def run_parallel(
    world: int, *, tokens: int = 16384, heads: int = 12, head_dim: int = 64
) -> ParallelReport:
    """One process on the whole sequence, then `world` processes on chunks of it."""
    if world < 2:
        raise ValueError(f"world must be at least 2 processes, got {world}")
    if tokens % world != 0:
        raise ValueError(f"tokens ({tokens}) must divide by the number of processes ({world})")
    report = ParallelReport(tokens, heads, head_dim, world)
    for size in (1, world):
        report.rows += _spawn(size, tokens, heads, head_dim)
    return report


def _spawn(world: int, tokens: int, heads: int, head_dim: int) -> list[RankRow]:
    queue = mp.get_context("spawn").SimpleQueue()
    port = free_loopback_port()
    mp.spawn(_rank, args=(world, port, tokens, heads, head_dim, queue), nprocs=world, join=True)
    rows = [queue.get() for _ in range(world)]
    return sorted((RankRow(**row) for row in rows), key=lambda r: r.rank)


def _rank(rank, world, port, tokens, heads, head_dim, queue) -> None:
    from attnlab.parallel import ring_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        chunk = tokens // world
        generator = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, heads, chunk, head_dim, generator=generator) for _ in range(3))
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            peak = peak_bytes(lambda: ring_attention(q, k, v, causal=True), q.device)
        seconds = time.perf_counter() - start
        sent = (world - 1) * (k.nbytes + v.nbytes)
        queue.put(
            dict(
                world=world,
                rank=rank,
                input_bytes=q.nbytes + k.nbytes + v.nbytes,
                call_peak_bytes=peak or 0,
                sent_bytes=sent,
                seconds=seconds,
            )
        )
    finally:
        dist.destroy_process_group()


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
