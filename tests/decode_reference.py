"""A minimal static-cache SDPA decode layer, gpt-fast's shape, and a counter of the aten ops
a call dispatches: the reference for how many ops (GPU kernel launches) attnlab's decode
steps may dispatch."""

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class GptFastLayer(nn.Module):
    """A minimal static-cache SDPA layer as gpt-fast and transformers' StaticCache write it:
    the reference for the number of ops a decode step dispatches."""

    def __init__(self, d, heads, kv_heads, capacity, batch, device):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        kv = kv_heads * self.hd
        self.wqkv = nn.Linear(d, d + 2 * kv, bias=False, device=device)
        self.wo = nn.Linear(d, d, device=device)
        shape = (batch, kv_heads, capacity, self.hd)
        self.k_cache = torch.zeros(shape, device=device)
        self.v_cache = torch.zeros(shape, device=device)
        self.causal = torch.ones(capacity, capacity, dtype=torch.bool, device=device).tril()

    def forward(self, x, input_pos):
        b, t, d = x.shape
        kv = self.kv_heads * self.hd
        q, k, v = self.wqkv(x).split([d, kv, kv], dim=-1)
        q = q.view(b, t, self.heads, self.hd).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        mask = self.causal[None, None, input_pos]
        grouped = self.kv_heads != self.heads
        y = F.scaled_dot_product_attention(
            q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=grouped
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class DispatchedOps(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, by name (views included)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))
