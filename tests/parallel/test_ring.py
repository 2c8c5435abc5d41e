"""attnlab.parallel.ring_attention on spawned 2- and 4-process gloo groups (loopback):
outputs and gradients equal to single-process attention on the whole sequence (fp32,
1e-5), causal and not, grouped-query heads, batch > 1; bad input is a ValueError on every
rank, never a hang. Each spawn is bounded in time."""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnlab.bench.parallel import free_loopback_port
from attnlab.functional import attention
from attnlab.parallel import ring_attention, shard_sequence

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
        raise RuntimeError(f"rank {rank}:\n{traceback.format_exc()}") from None
    finally:
        dist.destroy_process_group()


CASES = [  # (batch, query heads, key/value heads, tokens, head_dim, causal)
    (2, 4, 4, 24, 8, False),
    (2, 4, 4, 24, 8, True),
    (1, 6, 2, 16, 4, True),
    (3, 2, 1, 8, 16, False),
]


def _equal_to_one_process(rank, world):
    for b, hq, hkv, tokens, d, causal in CASES:
        g = torch.Generator().manual_seed(tokens + hq)
        q, k, v = (torch.randn(b, h, tokens, d, generator=g) for h in (hq, hkv, hkv))
        grad_out = torch.randn(b, hq, tokens, d, generator=g)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = attention(*full, causal=causal, backend="math")
        expected_grads = torch.autograd.grad(expected, full, grad_out)
        parts = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*parts, causal=causal)
        grads = torch.autograd.grad(out, parts, shard_sequence(grad_out))
        torch.testing.assert_close(out, shard_sequence(expected), atol=1e-5, rtol=1e-5)
        for grad, full_grad in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(grad, shard_sequence(full_grad), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_equals_attention_on_the_whole_sequence(world):
    _spawn(_equal_to_one_process, world)


def _bad_inputs(rank, world):
    x = torch.randn(1, 2, 7, 4)
    try:
        shard_sequence(x)
    except ValueError as error:
        assert "not divisible by the world size" in str(error)
    else:
        raise AssertionError("7 tokens over 2 ranks should be refused")
    q = torch.randn(1, 2, 4 + rank, 4)  # rank 1 has a longer chunk
    try:
        ring_attention(q, q, q)
    except ValueError as error:
        assert "differ across ranks" in str(error)
    else:
        raise AssertionError("mismatched chunks should be refused")
    malformed = torch.randn(2, 4) if rank == 0 else torch.randn(1, 2, 4, 4)
    try:
        ring_attention(malformed, malformed, malformed)
    except ValueError as error:
        assert "ranks [0]" in str(error)
    else:
        raise AssertionError("a 2-D input on rank 0 should be refused on every rank")


def test_bad_input_is_a_value_error_on_every_rank():
    _spawn(_bad_inputs, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_the_explicit_block_path_equals_the_fused_one(monkeypatch, causal):
    """Blocks off the CPU (or in half precision) use an explicit product: same results."""
    from attnlab.parallel import ring

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 12, 8, generator=g)
    k, v = torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)
    grad_out = torch.randn(2, 4, 12, 8, generator=g)
    fused_out, fused_lse = ring._block(q, k, v, causal, 0.35)
    fused_grads = ring._block_backward(grad_out, q, k, v, fused_out, fused_lse, causal, 0.35)
    monkeypatch.setattr(ring, "_fused", lambda q: False)
    out, lse = ring._block(q, k, v, causal, 0.35)
    grads = ring._block_backward(grad_out, q, k, v, out, lse, causal, 0.35)
    torch.testing.assert_close(out, fused_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, fused_lse, atol=1e-5, rtol=1e-5)
    for grad, expected in zip(grads, fused_grads, strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5)
