"""Head-parallel (tensor-parallel) MultiHeadAttention with torch.distributed.tensor.parallel:
each rank of a 1-D DeviceMesh keeps num_heads / world query heads and num_kv_heads / world
key/value heads. The fused query/key/value projection is sharded column-wise (its rows
first regrouped so that each rank's contiguous block holds its own q, k and v heads), the
output projection row-wise (an all-reduce sums the heads' contributions). Input and output
stay replicated: every rank's output equals the unsharded module's.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from attnlab import qkv
from attnlab.attention import MultiHeadAttention


def tensor_parallel(module: MultiHeadAttention, mesh: DeviceMesh) -> MultiHeadAttention:
    """Shard `module` in place over the 1-D `mesh` by heads.

    Afterwards its num_heads, num_kv_heads and d_out attributes are this rank's share and
    `module.shards` is the mesh size, while `module.config` still describes the whole
    module (MultiHeadAttention(**config) builds the unsharded twin). A KV cache made from
    it (make_cache) holds only the local key/value heads. Input and output stay
    replicated: every rank's output equals the unsharded module's. attnlab.save refuses a
    shard: save the unsharded module.

    Args:
        module: a self-attention attnlab.MultiHeadAttention (context_dim == d_in) whose
            num_heads and num_kv_heads divide by the mesh size; changed in place.
        mesh: a 1-D DeviceMesh over the ranks (e.g. init_device_mesh("cpu", (world,))).

    Returns:
        The module itself, sharded.

    Raises:
        TypeError: module is not an attnlab.MultiHeadAttention.
        ValueError: mesh is not a 1-D DeviceMesh, module is cross-attention only, or a head
            count does not divide by the mesh size.
    """
    world = _check(module, mesh)
    _regroup_qkv_rows(module, world)
    parallelize_module(module, mesh, {"qkv_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    module.num_heads //= world  # this rank's heads; config still gives the whole module's
    module.num_kv_heads //= world
    module.d_out //= world  # this rank's width of the concatenated heads
    module.shards = world
    return module


def _check(module: object, mesh: object) -> int:
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(
            f"module must be an attnlab.MultiHeadAttention, got {type(module).__name__}"
        )
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"mesh must be a 1-D DeviceMesh, got {mesh!r}")
    if not module.fused:
        raise ValueError("tensor_parallel shards self-attention modules (context_dim == d_in)")
    world = mesh.size()
    for name in ("num_heads", "num_kv_heads"):
        heads = getattr(module, name)
        if heads % world != 0:
            raise ValueError(
                f"{name} ({heads}) is not divisible by the mesh size ({world}): each rank "
                f"must hold whole heads"
            )
    return world


def _regroup_qkv_rows(module: MultiHeadAttention, world: int) -> None:
    """Rows [q heads | k heads | v heads] -> [q, k, v of rank 0 | q, k, v of rank 1 | ...],
    so that a contiguous column-wise shard is one rank's heads."""
    q_rows, kv_rows = module.d_out // world, module.kv_dim // world
    with torch.no_grad():
        for tensor in (module.qkv_proj.weight, module.qkv_proj.bias):
            if tensor is None:
                continue
            q, k, v = qkv.split_rows(tensor, module.d_out, module.kv_dim)
            shards = [
                torch.cat([q.split(q_rows)[r], k.split(kv_rows)[r], v.split(kv_rows)[r]])
                for r in range(world)
            ]
            tensor.copy_(qkv.fuse_rows(*shards))
