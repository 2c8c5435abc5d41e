"""ring_attention's arguments, checked on every rank at once.

Each rank first judges its own arguments (types, dtypes, devices, settings); then one
all-gather carries every rank's shapes, settings and verdict, so that every rank raises:
the rank with a bad argument its own error, the others a ValueError naming that rank, and
all of them the same ValueError when shapes or settings differ across ranks. No rank goes
on to a transfer that a failed rank will never match, so bad input never hangs the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attnlab.parallel.layout import LAYOUTS, check_layout, pieces_per_rank

BACKENDS: tuple[str, ...] = ("auto", "attnlab", "torch")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DEVICE_TYPES = ("cpu", "cuda")
_UNKNOWN = -1


def check_arguments(q, k, v, *, causal, layout, backend, group) -> None:
    """Raise on every rank when any rank's arguments are invalid or differ from the others'."""
    rank = dist.get_rank(group)
    error = _local_error(q, k, v, causal, layout, backend)
    if error is not None:
        error.args = (f"rank {rank}: {error.args[0]}",)
    rows = _gather(_describe(q, k, v, causal, layout, backend, error), q, group)
    bad = [r for r, row in enumerate(rows) if row[-1]]
    if error is not None:
        raise error
    if bad:
        raise ValueError(f"ranks {bad} passed invalid arguments to ring_attention (see theirs)")
    _same_everywhere(rows)
    _shapes_fit(rows[0][:12], layout)


def _local_error(q, k, v, causal, layout, backend) -> Exception | None:
    """This rank's first invalid argument, as the exception to raise, or None."""
    try:
        check_layout(layout)
    except ValueError as error:
        return error
    if not isinstance(causal, bool):
        return TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        return ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            return ValueError(
                f"{name} must be a 4-D tensor (batch, heads, tokens, head_dim), got {got}"
            )
        if t.dtype not in FLOAT_DTYPES:
            return TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if len({(t.dtype, t.device) for t in tensors.values()}) > 1:
        found = ", ".join(f"{n} {t.dtype} on {t.device}" for n, t in tensors.items())
        return ValueError(f"q, k, v must share one dtype and device, got {found}")
    return None


def _describe(q, k, v, causal, layout, backend, error) -> list[int]:
    """Shapes (12), settings (5) and a verdict (1) of this rank, as integers."""
    if error is not None:
        return [_UNKNOWN] * 17 + [1]
    shapes = [*q.shape, *k.shape, *v.shape]
    known = q.device.type in _DEVICE_TYPES
    device = _DEVICE_TYPES.index(q.device.type) if known else len(_DEVICE_TYPES)  # "other"
    settings = [
        LAYOUTS.index(layout),
        int(causal),
        BACKENDS.index(backend),
        FLOAT_DTYPES.index(q.dtype),
        device,
    ]
    return [*shapes, *settings, 0]


def _gather(row: list[int], q, group) -> list[tuple[int, ...]]:
    """Every rank's row, in rank order (on q's device: nccl gathers CUDA tensors)."""
    known = isinstance(q, torch.Tensor) and q.device.type in _DEVICE_TYPES  # not meta
    device = q.device if known else torch.device("cpu")
    local = torch.tensor(row, dtype=torch.long, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return [tuple(g.tolist()) for g in gathered]


def _same_everywhere(rows: list[tuple[int, ...]]) -> None:
    shapes = [row[:12] for row in rows]
    if len(set(shapes)) > 1:
        raise ValueError(f"q, k, v chunk shapes differ across ranks: {shapes}")
    settings = [row[12:17] for row in rows]
    if len(set(settings)) > 1:
        devices = (*_DEVICE_TYPES, "other")
        named = [
            (LAYOUTS[lay], bool(causal), BACKENDS[back], str(FLOAT_DTYPES[dtype]), devices[where])
            for lay, causal, back, dtype, where in settings
        ]
        raise ValueError(
            f"(layout, causal, backend, dtype, device type) differ across ranks: {named}"
        )


def _shapes_fit(shapes: tuple[int, ...], layout: str) -> None:
    q, k, v = shapes[:4], shapes[4:8], shapes[8:12]
    if min(shapes) < 1:
        raise ValueError(f"q {q}, k {k}, v {v}: every dimension must be at least 1")
    (b, hq, n, d), (_, hkv, _, _) = q, k
    if (k[0], k[2], k[3]) != (b, n, d) or k != v or hq % hkv:
        raise ValueError(
            f"q {q}, k {k}, v {v}: batch, tokens and head_dim must agree and the key/value "
            f"heads must divide the query heads"
        )
    if n % pieces_per_rank(layout):
        raise ValueError(
            f"the {layout} layout holds two pieces per rank: local tokens ({n}) must be even"
        )
