"""attnlab's CUDA paths against PyTorch's own on a real card, in about a minute.

Checks, each printed with its largest difference:
- MultiHeadAttention (MHA, GQA, MQA; causal and a padding mask; bfloat16 and float32)
  against F.scaled_dot_product_attention written out from the module's own weights.
- Cached decoding (KVCache and StaticKVCache, float32 and bfloat16) equal to the full
  forward.
- No host-device sync in a cached step: torch.cuda.set_sync_debug_mode("error") around a
  step of each cache, so any value read raises.
- A static-cache decode step captured in one CUDA graph
  (torch.compile(mode="reduce-overhead", fullgraph=True)) equal to the eager steps.

And, as information, which SDPA backend a static-cache decode step's call picks on the card
(report_decode_backends).

Usage: python scripts/gpu_checks.py   (exits 1 on any failed check)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from attnlab import MultiHeadAttention

FAILED: list[str] = []
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the checks


def report(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Print the largest difference of got against want and record a failure past tol."""
    diff = (got.float() - want.float()).abs().max().item()
    ok = diff <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max |diff| {diff:.2e} (tol {tol:.0e})")
    if not ok:
        FAILED.append(name)


def sdpa_reference(module: MultiHeadAttention, x: torch.Tensor, mask) -> torch.Tensor:
    """The module's forward written out with F.scaled_dot_product_attention, in float32."""
    b, t, _ = x.shape
    h, hkv, d = module.num_heads, module.num_kv_heads, module.head_dim
    qkv = F.linear(x.float(), module.qkv_proj.weight.float())  # (b, t, (h + 2 hkv) d)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q = q.view(b, t, h, d).transpose(1, 2)  # (b, h, t, d)
    k = k.view(b, t, hkv, d).transpose(1, 2)  # (b, hkv, t, d)
    v = v.view(b, t, hkv, d).transpose(1, 2)
    k = k.repeat_interleave(h // hkv, dim=1)  # (b, h, t, d)
    v = v.repeat_interleave(h // hkv, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask & causal)
    out = out.transpose(1, 2).reshape(b, t, h * d)  # (b, t, d_out)
    return F.linear(out, module.out_proj.weight.float(), module.out_proj.bias.float())


def check_forward(dtype: torch.dtype, kv_heads: int) -> None:
    """The module's causal forward, with and without a padding mask, against SDPA."""
    torch.manual_seed(0)
    module = MultiHeadAttention(
        768, 768, 1024, 0.0, 12, num_kv_heads=kv_heads, device=DEVICE, dtype=dtype
    ).eval()
    x = torch.randn(4, 512, 768, device=DEVICE, dtype=dtype)
    keep = torch.ones(4, 512, dtype=torch.bool, device=DEVICE)
    keep[1, :100] = False  # left padding in sequence 1
    mask = keep[:, None, None, :]  # (b, 1, 1, t): True where a key is seen
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    with torch.no_grad():
        report(f"forward {dtype} 12/{kv_heads}", module(x), sdpa_reference(module, x, None), tol)
        got = module(x, mask=mask)[:, 100:]  # rows that see at least one key in every sequence
        want = sdpa_reference(module, x, mask)[:, 100:]
        report(f"forward+mask {dtype} 12/{kv_heads}", got, want, tol)


def check_decode(dtype: torch.dtype, static: bool) -> None:
    """Cached token-by-token decoding equal to one full forward; no sync inside a step."""
    torch.manual_seed(0)
    module = MultiHeadAttention(
        256, 256, 128, 0.0, 8, num_kv_heads=2, rope=True, device=DEVICE, dtype=dtype
    ).eval()
    x = torch.randn(2, 40, 256, device=DEVICE, dtype=dtype)
    cache = module.make_cache(2, max_tokens=64, static=static)
    with torch.no_grad():
        steps = [module(x[:, :8], cache=cache)]
        for i in range(8, 40):
            refuse_sync = i == 20 and DEVICE == "cuda"  # one step with every value read refused
            if refuse_sync:
                torch.cuda.set_sync_debug_mode("error")
            steps.append(module(x[:, i : i + 1], cache=cache))
            if refuse_sync:
                torch.cuda.set_sync_debug_mode("default")
        full = module(x)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    report(f"decode {'static' if static else 'dynamic'} {dtype}", torch.cat(steps, 1), full, tol)


def check_graph() -> None:
    """A static-cache step compiled into a CUDA graph equal to the same steps run eagerly."""
    torch.manual_seed(0)
    module = MultiHeadAttention(
        256, 256, 128, 0.0, 8, num_kv_heads=2, rope=True, device=DEVICE, dtype=torch.bfloat16
    ).eval()
    x = torch.randn(1, 40, 256, device=DEVICE, dtype=torch.bfloat16)
    step = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    outputs = []
    for run in (module, step):
        cache = module.make_cache(1, max_tokens=64, static=True)
        with torch.no_grad():
            steps = [run(x[:, i : i + 1], cache=cache).clone() for i in range(40)]
        outputs.append(torch.cat(steps, 1))
    report("decode static, CUDA graph vs eager", outputs[1], outputs[0], 3e-2)


def report_decode_backends() -> None:
    """Which SDPA backend a one-token step over a static cache picks here (information, not a
    check): 12 query heads of 64 over 12 or 4 key/value heads, a bool mask over a capacity
    of 4112, bfloat16 on a GPU, with the strides attnlab's step and the gpt-fast-style peer
    both pass (q a view of the fused projection, the cache's buffers whole). On the H200 on
    2026-11-27 (torch 2.11) the peer's own eager step took 1.6-1.75x as long with 4 key/value
    heads as with 12, though it reads less: a fallback to the math backend would do that."""
    from torch.nn.attention import SDPBackend

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    h, hd, cap = 12, 64, 4112  # query heads, head_dim, capacity
    options = {"device": DEVICE, "dtype": dtype}
    for kv_heads in (12, 4):
        qkv = torch.randn(1, 1, (h + 2 * kv_heads) * hd, **options)  # (1, 1, fused rows)
        q = qkv[..., : h * hd].view(1, 1, h, hd).transpose(1, 2)  # (1, h, 1, hd)
        k = torch.randn(1, kv_heads, cap, hd, **options)  # (1, hkv, cap, hd)
        v = torch.randn_like(k)
        mask = (torch.arange(cap, device=DEVICE) < 1000).view(1, 1, 1, cap)  # (1, 1, 1, cap)
        choice = torch._fused_sdp_choice(
            q, k, v, mask, 0.0, False, scale=None, enable_gqa=kv_heads != h
        )
        print(f"info decode step's SDPA, 12/{kv_heads} heads, bool mask: {SDPBackend(choice).name}")


def main() -> int:
    card = torch.cuda.get_device_name() if DEVICE == "cuda" else "none (a CPU dry run)"
    print("torch", torch.__version__, "card", card)
    for dtype in (torch.bfloat16, torch.float32):
        for kv_heads in (12, 4, 1):
            check_forward(dtype, kv_heads)
        for static in (False, True):
            try:
                check_decode(dtype, static)
            except RuntimeError as error:  # a sync refused by the debug mode, or another
                print(f"FAIL decode {'static' if static else 'dynamic'} {dtype}: {error}")
                FAILED.append(f"decode {dtype} static={static}")
    report_decode_backends()
    try:
        if DEVICE == "cuda":
            check_graph()
    except Exception as error:  # any compile or capture failure is the finding
        print(f"FAIL CUDA graph: {type(error).__name__}: {str(error)[:2000]}")
        FAILED.append("graph")
    print("failed:", FAILED or "none")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
