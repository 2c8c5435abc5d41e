"""attnlab.parallel: attention across processes on torch.distributed (gloo on CPU, nccl on
CUDA). ring_attention splits the sequence: each rank holds a contiguous chunk, keys and
values travel around the ring. Tensor (head) parallelism is not here yet."""

from attnlab.parallel.ring import ring_attention, shard_sequence

__all__ = ["ring_attention", "shard_sequence"]
