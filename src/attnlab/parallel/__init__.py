"""attnlab.parallel: attention across processes on torch.distributed (gloo on CPU, nccl on
CUDA). ring_attention splits the sequence: each rank holds part of it (a contiguous chunk,
or two pieces in the load-balanced zigzag layout) and keys and values travel around the
ring. tensor_parallel splits a MultiHeadAttention by heads."""

from attnlab.parallel.layout import LAYOUTS, shard_sequence
from attnlab.parallel.ring import ring_attention
from attnlab.parallel.tensor import tensor_parallel

__all__ = ["LAYOUTS", "ring_attention", "shard_sequence", "tensor_parallel"]
