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

from attnlab.bench.parallel import exit_rank, free_loopback_port
from attnlab.functional import attention
from attnlab.parallel import LAYOUTS, ring_attention, shard_sequence

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


def _check_against_one_process(case, layout, backend):
    """Output and q/k/v gradients of the ring equal single-process attention (the math
    backend) on the whole sequence, cut into this rank's part."""
    b, hq, hkv, tokens, d, causal = case
    g = torch.Generator().manual_seed(tokens + hq)
    q, k, v = (torch.randn(b, h, tokens, d, generator=g) for h in (hq, hkv, hkv))
    grad_out = torch.randn(b, hq, tokens, d, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attention(*full, causal=causal, backend="math")
    expected_grads = torch.autograd.grad(expected, full, grad_out)

    def mine(t):
        return shard_sequence(t, layout=layout)

    parts = [mine(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*parts, causal=causal, layout=layout, backend=backend)
    grads = torch.autograd.grad(out, parts, mine(grad_out))
    torch.testing.assert_close(out, mine(expected), atol=1e-5, rtol=1e-5)
    for grad, full_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, mine(full_grad), atol=1e-5, rtol=1e-5)


def _equal_to_one_process(rank, world):
    from attnlab.parallel import ring  # (a fresh import in this spawned process)

    for case in CASES:
        for layout in LAYOUTS:
            _check_against_one_process(case, layout, "attnlab")
            if case[1] == case[2]:  # PyTorch's engine takes equal heads only
                _check_against_one_process(case, layout, "torch")
    ring._fused = lambda q: False  # the explicit product that other devices and dtypes take
    for case in CASES:
        for layout in LAYOUTS:
            _check_against_one_process(case, layout, "attnlab")


@pytest.mark.parametrize("world", [2, 4])
def test_equals_attention_on_the_whole_sequence(world):
    """Both backends, both layouts, causal or not, grouped-query heads, batch > 1; the
    attnlab ring with CPU flash blocks and with explicit blocks."""
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


def _raises_everywhere(message: str, call) -> None:
    try:
        call()
    except ValueError as error:
        assert message in str(error), str(error)
    else:
        raise AssertionError(f"expected a ValueError saying {message!r}")


def _bad_inputs(rank, world):
    x = torch.randn(1, 2, 6, 4)
    _raises_everywhere("not divisible by the world size 2", lambda: shard_sequence(x[:, :, :5]))
    _raises_everywhere("times 2 (4) for the zigzag", lambda: shard_sequence(x, layout="zigzag"))
    q = torch.randn(1, 2, 4 + rank, 4)  # rank 1 has a longer chunk
    _raises_everywhere("differ across ranks", lambda: ring_attention(q, q, q))
    malformed = torch.randn(2, 4) if rank == 0 else torch.randn(1, 2, 4, 4)
    _raises_everywhere("ranks [0]", lambda: ring_attention(malformed, malformed, malformed))
    odd = torch.randn(1, 2, 3, 4)
    _raises_everywhere(
        "local tokens (3) must be even", lambda: ring_attention(odd, odd, odd, layout="zigzag")
    )
    q = torch.randn(1, 2, 4, 4)
    layout = "zigzag" if rank == 0 else "contiguous"
    _raises_everywhere(
        "(layout, causal) differ across ranks",
        lambda: ring_attention(q, q, q, causal=True, layout=layout),
    )
    kv = torch.randn(1, 1, 4, 4)
    _raises_everywhere(
        "backend 'torch' needs as many key/value heads (1) as query heads (2)",
        lambda: ring_attention(q, kv, kv, backend="torch"),
    )
    _raises_everywhere("layout must be one of", lambda: ring_attention(q, q, q, layout="ring"))
    _raises_everywhere("backend must be one of", lambda: ring_attention(q, q, q, backend="nccl"))


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
    block, plan = Block(slice(None), slice(None), causal), SimpleNamespace(scale=0.35)
    fused_out, fused_lse = ring._block(q, k, v, block, plan)
    fused_grads = ring._block_backward(grad_out, q, k, v, fused_out, fused_lse, block, plan)
    monkeypatch.setattr(ring, "_fused", lambda q: False)
    out, lse = ring._block(q, k, v, block, plan)
    grads = ring._block_backward(grad_out, q, k, v, out, lse, block, plan)
    torch.testing.assert_close(out, fused_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, fused_lse, atol=1e-5, rtol=1e-5)
    for grad, expected in zip(grads, fused_grads, strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5)
