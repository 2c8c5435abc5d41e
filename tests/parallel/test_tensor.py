"""attnlab.parallel.tensor_parallel on spawned 2- and 4-process gloo groups: the sharded
module equals the unsharded one on every rank, with and without a KV cache, with
grouped-query heads; heads not divisible by the mesh size are a ValueError on every rank."""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import attnlab
from attnlab import MultiHeadAttention
from attnlab.parallel import tensor_parallel
from tests.definitions import decode
from tests.parallel.test_ring import _spawn

CONFIGS = [
    dict(num_heads=4),
    dict(num_heads=8, num_kv_heads=4, rope=True, qkv_bias=True),
]


def _equal_to_unsharded(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for config in CONFIGS:
        torch.manual_seed(0)  # the same weights on every rank
        full = MultiHeadAttention(32, 32, 64, 0.0, **config).eval()
        sharded = tensor_parallel(copy.deepcopy(full), mesh)
        assert sharded.num_heads == config["num_heads"] // world
        assert sharded.shards == world and sharded.config == full.config  # the whole module
        try:
            attnlab.save(sharded, "unused.safetensors")
        except ValueError as error:
            assert f"one shard of {world}" in str(error)
        else:
            raise AssertionError("saving a shard should be refused")
        x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(sharded(x), full(x), atol=1e-5, rtol=1e-5)
            full_cache, local_cache = full.make_cache(2, 16), sharded.make_cache(2, 16)
            assert local_cache.num_kv_heads == full_cache.num_kv_heads // world
            expected, got = (decode(m, x, None, chunks=[5, 1]) for m in (full, sharded))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_module_equals_the_unsharded_one(world):
    _spawn(_equal_to_unsharded, world)


def _indivisible(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    module = MultiHeadAttention(24, 24, 16, 0.0, 6, num_kv_heads=3)
    try:
        tensor_parallel(module, mesh)
    except ValueError as error:
        assert "num_kv_heads (3) is not divisible by the mesh size (2)" in str(error)
    else:
        raise AssertionError("3 key/value heads over 2 ranks should be refused")


def test_heads_not_divisible_is_a_value_error_on_every_rank():
    _spawn(_indivisible, 2)
