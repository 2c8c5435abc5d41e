"""Independent float64 references, one head at a time, written from the definitions (no
attnlab code): what the production layer is compared against."""

import math

import torch


def reference(q, k, v, allowed=None, scale=None):
    """One head at a time, kv head h // groups, plain softmax; empty rows set to zero."""
    b, hq, tq, hd = q.shape
    groups = hq // k.shape[1]
    scale = 1 / math.sqrt(hd) if scale is None else scale
    out = torch.zeros(b, hq, tq, v.shape[-1], dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            s = q[i, h].double() @ k[i, h // groups].double().T * scale
            if allowed is not None:
                ok = allowed.expand(b, hq, tq, k.shape[2])[i, h]
                s = s.masked_fill(~ok, -math.inf)
            w = torch.softmax(s, dim=-1).nan_to_num(0.0)
            out[i, h] = w @ v[i, h // groups].double()
    return out.to(q.dtype)


def rope_reference(x, positions, base=10000.0):
    """Rotary embedding as complex numbers: features (i, i + hd/2) form z_i, multiplied by
    exp(1j * position * base^(-2i/hd)). x is (..., t, hd); positions (t,)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    theta = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    angles = positions.double()[:, None] * theta  # (t, hd/2)
    z = z * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1)


def window_allowed(num_tokens, window=None):
    """(t, t) bool: query i may see key j when j <= i and, with a window, i - j < window."""
    i = torch.arange(num_tokens)[:, None]
    j = torch.arange(num_tokens)[None, :]
    return (j <= i) & ((i - j < window) if window is not None else True)


def module_reference(m, x, context=None, allowed=None, rope_base=None):
    """attnlab.MultiHeadAttention `m` recomputed from its documented parameter layout (fused
    qkv_proj rows: queries, keys, values; or q_proj and kv_proj), without dropout; with
    rope_base, queries and keys rotated at positions 0 .. t - 1."""
    d_out, kv_dim, hd = m.d_out, m.num_kv_heads * (m.d_out // m.num_heads), m.d_out // m.num_heads
    if hasattr(m, "qkv_proj"):
        w, bias = m.qkv_proj.weight.double(), m.qkv_proj.bias
        wq, wkv = w[:d_out], w[d_out:]
        bq, bkv = (None, None) if bias is None else (bias[:d_out].double(), bias[d_out:].double())
    else:
        wq, wkv = m.q_proj.weight.double(), m.kv_proj.weight.double()
        bq = None if m.q_proj.bias is None else m.q_proj.bias.double()
        bkv = None if m.kv_proj.bias is None else m.kv_proj.bias.double()
    source = x if context is None else context
    q = torch.nn.functional.linear(x.double(), wq, bq)
    kv = torch.nn.functional.linear(source.double(), wkv, bkv)
    k, v = kv[..., :kv_dim], kv[..., kv_dim:]
    b, tq, tk = x.shape[0], x.shape[1], source.shape[1]
    q = q.view(b, tq, m.num_heads, hd).transpose(1, 2)  # (b, h, tq, hd)
    k = k.reshape(b, tk, m.num_kv_heads, hd).transpose(1, 2)  # (b, hkv, tk, hd)
    v = v.reshape(b, tk, m.num_kv_heads, hd).transpose(1, 2)  # (b, hkv, tk, hd)
    if rope_base is not None:
        q, k = (
            rope_reference(q, torch.arange(tq), rope_base),
            rope_reference(k, torch.arange(tk), rope_base),
        )
    out = reference(q, k, v, allowed)  # (b, h, tq, hd)
    out = out.transpose(1, 2).reshape(b, tq, d_out)  # (b, tq, d_out)
    return torch.nn.functional.linear(out, m.out_proj.weight.double(), m.out_proj.bias.double())


def decode(m, x, mask, chunks):
    """Feed x through a cache in chunks of the given sizes (the last one repeated)."""
    cache = m.make_cache(x.shape[0])
    outputs, start, i = [], 0, 0
    while start < x.shape[1]:
        end = min(start + chunks[min(i, len(chunks) - 1)], x.shape[1])
        step_mask = None if mask is None else mask[..., :end]  # keys: every position so far
        outputs.append(m(x[:, start:end], mask=step_mask, cache=cache))
        start, i = end, i + 1
    assert cache.position == x.shape[1]
    return torch.cat(outputs, dim=1)  # (b, t, d_out)
