"""Both ways of scaling attention out, on however many processes torchrun starts:

    torchrun --standalone --nproc-per-node 4 examples/scale_out.py

(gloo on the CPU; with one GPU per process, set DEVICE=cuda for nccl). Every rank checks its
part against single-process attention on the whole input and prints the largest difference.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from attnlab import MultiHeadAttention
from attnlab.functional import attention
from attnlab.parallel import ring_attention, shard_sequence, tensor_parallel

device = torch.device(os.environ.get("DEVICE", "cpu"))
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if device.type == "cuda":
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)

# 1. Sequence parallel: each rank holds 1/world of a long sequence (zigzag: balanced causal
#    work). Every rank draws the same whole tensors here only to check the result.
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 8, 64 * world, 32, generator=g).to(device) for _ in range(3))
mine = [shard_sequence(t, layout="zigzag").requires_grad_() for t in (q, k, v)]
out = ring_attention(*mine, causal=True, layout="zigzag")
out.sum().backward()  # gradients flow back around the ring
expected = shard_sequence(attention(q, k, v, causal=True, backend="math"), layout="zigzag")
ring_error = (out - expected).abs().max().item()

# 2. Head parallel: each rank holds num_heads / world heads of one module.
torch.manual_seed(0)  # the same weights on every rank
full = MultiHeadAttention(256, 256, 512, 0.0, num_heads=8, num_kv_heads=4, rope=True)
full = full.to(device).eval()
sharded = tensor_parallel(copy.deepcopy(full), init_device_mesh(device.type, (world,)))
x = torch.randn(2, 100, 256, generator=g).to(device)
with torch.no_grad():
    head_error = (sharded(x) - full(x)).abs().max().item()

print(f"rank {rank}/{world}: ring {ring_error:.1e}, heads {sharded.num_heads}: {head_error:.1e}")
if max(ring_error, head_error) > 1e-4:
    raise SystemExit(f"rank {rank}: the parallel result differs from one process's")
dist.destroy_process_group()
# Leave without the interpreter's shutdown: on gloo, a worker thread of PyTorch's process
# group may still release a tensor of the functional collectives (DTensor's all-reduce) while
# the interpreter finalises, which aborts the process (about 1 run in 30 here).
sys.stdout.flush()
os._exit(0)
