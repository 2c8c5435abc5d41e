"""attnlab.parallel: attention across processes on torch.distributed (gloo on CPU, nccl on
CUDA). ring_attention splits the sequence: each rank holds a contiguous chunk, keys and
values travel around the ring. tensor_parallel splits a MultiHeadAttention by heads."""

from attnlab.parallel.ring import ring_attention, shard_sequence
from attnlab.parallel.tensor import tensor_parallel

__all__ = ["ring_attention", "shard_sequence", "tensor_parallel"]
