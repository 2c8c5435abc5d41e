"""The implementations `attnlab bench` compares: causal self-attention modules built with the
same weights (the book's two classes, attnlab's module per backend, PyTorch's
nn.MultiheadAttention both ways, a nanoGPT-style module, FlexAttention), and the attention
cores alone (attnlab.functional.attention against F.scaled_dot_product_attention).

Shapes: x is (b, t, d) with b batch, t tokens, d = d_model; inside, q, k, v are
(b, h, t, hd) with h heads of hd = d / h features; every module returns (b, t, d) (the
book's wrapper returns its heads side by side, before any output projection).
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attnlab import book, functional
from attnlab.attention import MultiHeadAttention
from attnlab.qkv import QKVWeights

SCORE_ITEMSIZE = 4  # a (t x t) score tensor is float32: the math backend's softmax is


@dataclass(frozen=True)
class Shape:
    """What every peer is measured at: (batch, tokens, d_model) inputs, num_heads heads."""

    batch: int
    tokens: int
    d_model: int
    num_heads: int
    dtype: torch.dtype
    device: torch.device

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def score_bytes(self) -> int:
        """Bytes of one float32 (b, h, t, t) score tensor: what materialising peers hold."""
        return self.batch * self.num_heads * self.tokens**2 * SCORE_ITEMSIZE

    @property
    def io_bytes(self) -> int:
        """Bytes of q, k, v and the output: 4 tensors of (b, t, d)."""
        return 4 * self.batch * self.tokens * self.d_model * self.dtype.itemsize


@dataclass(frozen=True)
class Weights:
    """One set of projection weights every module is loaded with, so that they all compute
    the same function: query, key, value and out are (d, d), out_bias (d,); no qkv bias."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor
    out_bias: torch.Tensor

    @property
    def qkv(self) -> torch.Tensor:
        """The fused projection's weight: query rows, then key rows, then value rows."""
        return torch.cat([self.query, self.key, self.value])  # (3d, d)


def make_weights(shape: Shape, seed: int = 0) -> Weights:
    """nn.Linear's default initialisation, U(-1/sqrt(d), 1/sqrt(d)), from a private
    generator (the global random state is left alone)."""
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(shape.d_model)

    def uniform(*size: int) -> torch.Tensor:
        values = (torch.rand(*size, generator=generator) * 2 - 1) * bound
        return values.to(shape.device, shape.dtype)

    d = shape.d_model
    return Weights(uniform(d, d), uniform(d, d), uniform(d, d), uniform(d, d), uniform(d))


def make_input(shape: Shape, seed: int = 1) -> torch.Tensor:
    """Random tokens (b, t, d) from a private generator."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.batch, shape.tokens, shape.d_model, generator=generator)
    return x.to(shape.device, shape.dtype)


@dataclass(frozen=True)
class Peer:
    """One module compared: its name, how to build it loaded with `Weights`, and whether it
    materialises (b, h, t, t) scores (then it is skipped at lengths where they do not fit).
    projects_output is False for the book's wrapper, which has no output projection."""

    name: str
    build: Callable[[Shape, Weights], nn.Module]
    materialises_scores: bool = False
    projects_output: bool = True


def _book_wrapper(shape: Shape, weights: Weights) -> nn.Module:
    """Listing 3.4: one CausalAttention per head, run one after another."""
    hd = shape.head_dim
    module = book.MultiHeadAttentionWrapper(shape.d_model, hd, shape.tokens, 0.0, shape.num_heads)
    with torch.no_grad():
        for i, head in enumerate(module.heads):
            rows = slice(i * hd, (i + 1) * hd)  # head i's rows of each (d, d) projection
            head.W_query.weight.copy_(weights.query[rows])
            head.W_key.weight.copy_(weights.key[rows])
            head.W_value.weight.copy_(weights.value[rows])
    return module.to(shape.device, shape.dtype)


def _book_mha(shape: Shape, weights: Weights) -> nn.Module:
    """Listing 3.5: three projections split into heads, scores masked, out_proj."""
    module = book.MultiHeadAttention(
        shape.d_model, shape.d_model, shape.tokens, 0.0, shape.num_heads
    ).to(shape.device, shape.dtype)
    with torch.no_grad():
        module.W_query.weight.copy_(weights.query)
        module.W_key.weight.copy_(weights.key)
        module.W_value.weight.copy_(weights.value)
        module.out_proj.weight.copy_(weights.out)
        module.out_proj.bias.copy_(weights.out_bias)
    return module


def _attnlab(backend: str) -> Callable[[Shape, Weights], nn.Module]:
    def build(shape: Shape, weights: Weights) -> nn.Module:
        """attnlab's production module, causal, with one backend pinned."""
        module = MultiHeadAttention(
            shape.d_model,
            shape.d_model,
            shape.tokens,
            0.0,
            shape.num_heads,
            backend=backend,
            device=shape.device,
            dtype=shape.dtype,
        )
        module.load_qkv_weights(QKVWeights(weights.query, weights.key, weights.value))
        with torch.no_grad():
            module.out_proj.weight.copy_(weights.out)
            module.out_proj.bias.copy_(weights.out_bias)
        return module

    return build


class TorchCausalMHA(nn.Module):
    """nn.MultiheadAttention(batch_first=True) as self-attention with a causal mask: with
    need_weights it also averages the heads' weights (and so materialises them); without,
    it passes is_causal beside the mask, the way PyTorch's fast path wants it. Either way,
    in eval mode under no_grad the fast path (torch._native_multi_head_attention) applies
    the mask with a masked softmax over the full (t x t) scores."""

    def __init__(self, shape: Shape, weights: Weights, *, need_weights: bool) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.mha = nn.MultiheadAttention(
            shape.d_model,
            shape.num_heads,
            batch_first=True,
            device=shape.device,
            dtype=shape.dtype,
        )
        with torch.no_grad():
            self.mha.in_proj_weight.copy_(weights.qkv)
            self.mha.in_proj_bias.zero_()
            self.mha.out_proj.weight.copy_(weights.out)
            self.mha.out_proj.bias.copy_(weights.out_bias)
        blocked = torch.ones(shape.tokens, shape.tokens, dtype=torch.bool, device=shape.device)
        self.register_buffer("blocked", blocked.triu(1), persistent=False)  # True = future

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(b, t, d) -> (b, t, d)."""
        blocked = self.blocked[: x.shape[1], : x.shape[1]]
        if self.need_weights:
            out, _ = self.mha(x, x, x, attn_mask=blocked, need_weights=True)
        else:
            out, _ = self.mha(x, x, x, attn_mask=blocked, need_weights=False, is_causal=True)
        return out


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: one fused Linear to q, k, v, split into heads, PyTorch's
    fused causal kernel, heads merged, output Linear."""

    def __init__(self, shape: Shape, weights: Weights) -> None:
        super().__init__()
        factory = {"device": shape.device, "dtype": shape.dtype}
        self.n_head, self.n_embd = shape.num_heads, shape.d_model
        self.c_attn = nn.Linear(self.n_embd, 3 * self.n_embd, bias=False, **factory)
        self.c_proj = nn.Linear(self.n_embd, self.n_embd, **factory)
        with torch.no_grad():
            self.c_attn.weight.copy_(weights.qkv)
            self.c_proj.weight.copy_(weights.out)
            self.c_proj.bias.copy_(weights.out_bias)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(b, t, d) -> (b, t, d)."""
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # each (b, t, d)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (b, h, t, hd)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = self.attend(q, k, v)  # (b, h, t, hd)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (b, t, d)
        return self.c_proj(y)


class FlexCausalAttention(NanoGPTAttention):
    """The nanoGPT module with FlexAttention and a causal block mask, compiled (uncompiled,
    flex_attention materialises the scores). On the CPU it has no backward."""

    def __init__(self, shape: Shape, weights: Weights) -> None:
        super().__init__(shape, weights)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.block_mask = create_block_mask(
            _causal, None, None, shape.tokens, shape.tokens, device=shape.device
        )
        self.flex = torch.compile(flex_attention)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.flex(q, k, v, block_mask=self.block_mask)


def _causal(b, h, q_idx, kv_idx):
    """FlexAttention's mask_mod: query q_idx may attend to keys at or before it."""
    return q_idx >= kv_idx


def module_peers(*, flex: bool = False) -> list[Peer]:
    """Every module compared, in table order; FlexAttention only when flex is true."""
    peers = [
        Peer("book MultiHeadAttentionWrapper", _book_wrapper, True, projects_output=False),
        Peer("book MultiHeadAttention", _book_mha, True),
        Peer("attnlab auto", _attnlab("auto")),
        Peer("attnlab sdpa", _attnlab("sdpa")),
        Peer("attnlab math", _attnlab("math"), True),
        Peer(
            "nn.MultiheadAttention need_weights=True",
            lambda s, w: TorchCausalMHA(s, w, need_weights=True),
            True,
        ),
        Peer(  # its fast path (eval, no grad) takes any mask through a masked softmax
            "nn.MultiheadAttention need_weights=False",
            lambda s, w: TorchCausalMHA(s, w, need_weights=False),
            True,
        ),
        Peer("nanoGPT SDPA", NanoGPTAttention),
    ]
    if flex:
        peers.append(Peer("FlexAttention (compiled)", FlexCausalAttention))
    return peers


@dataclass(frozen=True)
class CorePeer:
    """One attention core on (b, h, t, hd) q, k, v; causal False is the unmasked reference,
    which does the full (t x t) work instead of the causal half."""

    name: str
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    causal: bool = True


def core_peers() -> list[CorePeer]:
    """attnlab's public causal attention against PyTorch's, and PyTorch's with no mask."""
    return [
        CorePeer("attnlab attention causal", _attnlab_causal),
        CorePeer("SDPA is_causal", _sdpa_causal),
        CorePeer("SDPA no mask (full work)", F.scaled_dot_product_attention, causal=False),
    ]


def _attnlab_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return functional.attention(q, k, v, causal=True)


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def make_qkv(shape: Shape, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v, each (b, h, t, hd), from a private generator."""
    generator = torch.Generator().manual_seed(seed)
    size = (shape.batch, shape.num_heads, shape.tokens, shape.head_dim)
    q, k, v = (
        torch.randn(*size, generator=generator).to(shape.device, shape.dtype) for _ in range(3)
    )
    return q, k, v


def machine_name(device: torch.device) -> str:
    """The processor the figures come from: the GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


class StaticCacheSDPA(nn.Module):
    """gpt-fast's attention layer, minimal: one fused Linear to q, k, v, fixed-capacity key
    and value buffers (b, hkv, capacity, hd) written with index_copy_ at positions held on
    the device, F.scaled_dot_product_attention over the whole capacity with a boolean mask
    (given by the model, StaticCacheSDPAStack; enable_gqa where heads are grouped), heads
    merged, output Linear. Its shapes are the same at every position, so a decode
    loop compiles once. Built as a copy of a plain causal attnlab module (its weights,
    heads, dtype and device; no rotary positions or window).

    Args:
        module: the MultiHeadAttention whose weights it takes.
        batch_size: sequences held.
        capacity: positions each sequence may reach.
    """

    def __init__(self, module: MultiHeadAttention, batch_size: int, capacity: int) -> None:
        super().__init__()
        weights, out = module.qkv_weights(), module.out_proj
        self.num_heads, self.num_kv_heads = module.num_heads, module.num_kv_heads
        self.head_dim, self.kv_dim = module.head_dim, module.kv_dim
        factory = {"device": out.weight.device, "dtype": out.weight.dtype}
        rows = module.d_out + 2 * module.kv_dim
        self.wqkv = nn.Linear(module.d_in, rows, bias=weights.q_bias is not None, **factory)
        self.wo = nn.Linear(module.d_out, out.out_features, bias=out.bias is not None, **factory)
        with torch.no_grad():
            self.wqkv.weight.copy_(torch.cat(weights.weights))  # (d + 2 kv, d_in)
            if weights.q_bias is not None:
                self.wqkv.bias.copy_(torch.cat(weights.biases))
            self.wo.load_state_dict(out.state_dict())
        shape = (batch_size, self.num_kv_heads, capacity, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, **factory), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, **factory), persistent=False)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (b, t, d_in) at positions input_pos (t,) (int64, on x's device), mask (1, 1, t,
        capacity) bool, True where a query may see a slot -> (b, t, d_out)."""
        b, t, _ = x.shape
        d = self.num_heads * self.head_dim
        q, k, v = self.wqkv(x).split([d, self.kv_dim, self.kv_dim], dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (b, h, t, hd)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (b, hkv, t, hd)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        y = F.scaled_dot_product_attention(
            q,
            self.k_cache,
            self.v_cache,
            attn_mask=mask,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )  # (b, h, t, hd)
        y = y.transpose(1, 2).contiguous().view(b, t, d)  # (b, t, d)
        return self.wo(y)


class StaticCacheSDPAStack(nn.Module):
    """StaticCacheSDPA layers back to back, as gpt-fast's Transformer runs them: the mask is
    a row of one lower-triangular table, indexed once per step for every layer (what
    `torch.compile` takes whole).

    Args:
        layers: the layers, each with its own weights and buffers, of one capacity.
    """

    def __init__(self, layers: list[StaticCacheSDPA]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        capacity, device = layers[0].k_cache.shape[2], layers[0].k_cache.device
        table = torch.ones(capacity, capacity, dtype=torch.bool, device=device)
        self.register_buffer("causal_mask", table.tril(), persistent=False)  # True = may see

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """x (b, t, d) at positions input_pos (t,) through every layer -> (b, t, d)."""
        mask = self.causal_mask[None, None, input_pos]  # (1, 1, t, capacity)
        for layer in self.layers:
            x = layer(x, input_pos, mask)
        return x
