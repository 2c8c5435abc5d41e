"""attnlab.parallel.ring_attention on spawned 2- and 4-process gloo groups (loopback):
outputs and gradients equal to single-process attention on the whole sequence (fp32,
1e-5), causal and not, grouped-query heads, batch > 1; bad input is a ValueError on every
rank, never a hang. Each spawn is bounded in time."""

import os
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnlab.functional import attention
from attnlab.parallel import LAYOUTS, ring_attention, shard_sequence
from attnlab.parallel.launch import exit_rank, free_loopback_port

TIMEOUT_S = 120


def _spawn(worker, world: int, *args) -> None:
    """Run worker(rank, world, *args) on `world` gloo processes; fail on any error or
    when they take longer than TIMEOUT_S."""
    port = free_loopback_port()
    context = mp.spawn(_entry, args=(world, port, worker, args), nprocs=world, join=False)
    for _ in range(TIMEOUT_S):
        if context.join(timeout=1):
            return
    for process in context.processes:
        process.kill()
    pytest.fail(f"{world} processes did not finish within {TIMEOUT_S} s (a hang?)")


def _entry(rank, world, port, worker, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        worker(rank, world, *args)
    except Exception:
        dist.destroy_process_group()
        raise RuntimeError(f"rank {rank}:\n{traceback.format_exc()}") from None
    exit_rank()


CASES = [  # (batch, query heads, key/value heads, tokens, head_dim, causal)
    (2, 4, 4, 24, 8, False),
    (2, 4, 4, 24, 8, True),
    (1, 6, 2, 16, 4, True),
    (3, 2, 1, 8, 16, False),
    (2, 4, 2, 32, 8, True),
]


def _check_against_one_process(case, layout, backend, dtype=torch.float32, tolerance=1e-5):
    """Output and q/k/v gradients of the ring equal single-process attention (the math
    backend) on the whole sequence, cut into this rank's part."""
    b, hq, hkv, tokens, d, causal = case
    g = torch.Generator().manual_seed(tokens + hq)
    q, k, v = (torch.randn(b, h, tokens, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv))
    grad_out = torch.randn(b, hq, tokens, d, generator=g, dtype=dtype)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attention(*full, causal=causal, backend="math")
    expected_grads = torch.autograd.grad(expected, full, grad_out)

    def mine(t):
        return shard_sequence(t, layout=layout)

    parts = [mine(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*parts, causal=causal, layout=layout, backend=backend)
    grads = torch.autograd.grad(out, parts, mine(grad_out))
    close = dict(atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(out, mine(expected), **close)
    for grad, full_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, mine(full_grad), **close)


def _equal_to_one_process(rank, world):
    from attnlab.parallel import ring  # (a fresh import in this spawned process)

    for case in CASES:
        for layout in LAYOUTS:
            _check_against_one_process(case, layout, "attnlab")
            if case[1] == case[2]:  # PyTorch's engine takes equal heads only
                _check_against_one_process(case, layout, "torch")
    for layout in LAYOUTS:  # float64 stays float64 (accumulated in it, not in float32)
        _check_against_one_process(CASES[2], layout, "attnlab", torch.float64, 1e-10)
    ring._fused = lambda q: False  # the explicit product that other devices and dtypes take
    for case in CASES:
        for layout in LAYOUTS:
            _check_against_one_process(case, layout, "attnlab")
    _check_against_one_process(CASES[2], "zigzag", "attnlab", torch.float64, 1e-10)


@pytest.mark.parametrize("world", [2, 4])
def test_equals_attention_on_the_whole_sequence(world):
    """Both backends, both layouts, causal or not, grouped-query heads, batch > 1; the
    attnlab ring with CPU flash blocks and with explicit blocks, in float32 and float64."""
    _spawn(_equal_to_one_process, world)


def _zigzag_pieces(rank, world):
    positions = torch.arange(4 * world)
    head, tail = positions.chunk(2 * world)[rank], positions.chunk(2 * world)[-1 - rank]
    assert shard_sequence(positions, 0, layout="zigzag").tolist() == [*head, *tail]
    assert shard_sequence(positions, 0).tolist() == positions.chunk(world)[rank].tolist()


def test_zigzag_holds_pieces_r_and_2w_minus_1_minus_r():
    _spawn(_zigzag_pieces, 4)


def _options_restored(rank, world):
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    before = (cp._cp_options.enable_load_balance, cp._cp_options.rotate_method)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = ring_attention(q, q, q, causal=True, layout="zigzag", backend="torch")
    assert (cp._cp_options.enable_load_balance, cp._cp_options.rotate_method) == before
    out.sum().backward()
    assert (cp._cp_options.enable_load_balance, cp._cp_options.rotate_method) == before


def test_torch_backend_restores_pytorchs_options():
    _spawn(_options_restored, 2)


def _raises(message: str, call, error=ValueError) -> None:
    try:
        call()
    except error as raised:
        assert message in str(raised), str(raised)
    else:
        raise AssertionError(f"expected {error.__name__} saying {message!r}")


def _bad_inputs(rank, world):
    x = torch.randn(1, 2, 6, 4)
    _raises("not divisible by the world size 2", lambda: shard_sequence(x[:, :, :5]))
    _raises("times 2 (4) for the zigzag", lambda: shard_sequence(x, layout="zigzag"))
    q = torch.randn(1, 2, 4 + rank, 4)  # rank 1 has a longer chunk
    _raises("differ across ranks", lambda: ring_attention(q, q, q))
    malformed = torch.randn(2, 4) if rank == 0 else torch.randn(1, 2, 4, 4)
    expected = "rank 0: q must be a 4-D tensor" if rank == 0 else "ranks [0] passed invalid"
    _raises(expected, lambda: ring_attention(malformed, malformed, malformed))
    odd = torch.randn(1, 2, 3, 4)
    _raises("local tokens (3) must be even", lambda: ring_attention(odd, odd, odd, layout="zigzag"))
    q = torch.randn(1, 2, 4, 4)
    for name, value in [("layout", "zigzag"), ("backend", "torch")]:
        other = {name: value} if rank == 0 else {}
        _raises("differ across ranks", lambda: ring_attention(q, q, q, causal=True, **other))  # noqa: B023
    double = q.double() if rank == 1 else q
    _raises("differ across ranks", lambda: ring_attention(double, double, double))
    kv = torch.randn(1, 1, 4, 4)
    _raises(
        "PyTorch's engine needs as many key/value heads (1) as query heads (2)",
        lambda: ring_attention(q, kv, kv, backend="torch"),
    )
    bad_layout = "ring" if rank == 0 else "contiguous"  # bad on one rank only
    expected = "layout must be one of" if rank == 0 else "ranks [0] passed invalid"
    _raises(expected, lambda: ring_attention(q, q, q, layout=bad_layout))
    _raises("backend must be one of", lambda: ring_attention(q, q, q, backend="nccl"))
    _raises("causal must be a bool", lambda: ring_attention(q, q, q, causal=1), TypeError)
    whole = torch.ones(1, 2, 4, 4, dtype=torch.long)
    _raises("floating-point", lambda: ring_attention(whole, whole, whole), TypeError)
    _raises("share one dtype and device", lambda: ring_attention(q, q.double(), q.double()))
    empty = torch.randn(1, 2, 0, 4)
    _raises("every dimension must be at least 1", lambda: ring_attention(empty, empty, empty))
    leaf, weight = q.clone().requires_grad_(), torch.ones_like(q, requires_grad=True)
    out = ring_attention(leaf, leaf, leaf)
    (grad,) = torch.autograd.grad(out, leaf, weight, create_graph=True)
    _raises("differentiate twice", lambda: grad.sum().backward(), RuntimeError)
    ring_attention(q, q, q)  # the group is still in step: this call does not hang


def test_bad_input_is_a_value_error_on_every_rank():
    _spawn(_bad_inputs, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_the_explicit_block_path_equals_the_fused_one(monkeypatch, causal):
    """Blocks off the CPU (or in half precision) use an explicit product: same results."""
    from attnlab.parallel import ring
    from attnlab.parallel.layout import Block

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 12, 8, generator=g)
    k, v = torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)
    grad_out = torch.randn(2, 4, 12, 8, generator=g)
    block = Block(slice(None), slice(None), causal)
    plan = SimpleNamespace(scale=0.35, acc=torch.float32)
    fused_out, fused_lse = ring._block(q, k, v, block, plan)
    fused_grads = ring._block_backward(grad_out, q, k, v, fused_out, fused_lse, block, plan)
    monkeypatch.setattr(ring, "_fused", lambda q: False)
    out, lse = ring._block(q, k, v, block, plan)
    grads = ring._block_backward(grad_out, q, k, v, out, lse, block, plan)
    torch.testing.assert_close(out, fused_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, fused_lse, atol=1e-5, rtol=1e-5)
    for grad, expected in zip(grads, fused_grads, strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5)
