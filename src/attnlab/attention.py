"""MultiHeadAttention: the production layer. The book's constructor and outputs, one fused
query/key/value projection, attention through attnlab.functional (SDPA's fused kernels by
default), masks in attnlab's polarity, grouped-query heads, cross-attention, a KV cache for
token-by-token decoding, rotary positions and sliding windows.

Shapes: x is (b, tq, d_in); context is (b, tk, context_dim); inside, queries are
(b, h, tq, hd) and keys/values (b, hkv, tk, hd) with h = num_heads, hkv = num_kv_heads and
hd = d_out / num_heads; the output is (b, tq, d_out).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnlab import _own_code, debug, decode_cpu, functional, masks, plan, qkv
from attnlab import rope_scaling as rope_scaling_
from attnlab._validate import (
    check_bool,
    check_device,
    check_divides,
    check_dropout,
    check_finite,
    check_finite_result,
    check_float,
    check_float_dtype,
    check_int,
    check_like_parameter,
    check_product,
    check_size,
    check_tensor,
)
from attnlab.kv_cache import BLOCK_TOKENS, KVCache
from attnlab.norms import RMSNorm, check_offset
from attnlab.rope import RotaryEmbedding, check_base
from attnlab.static_cache import StaticKVCache

_CACHED_MASK = "(batch, heads, queries, positions so far)"
_STATIC_MASK = "(batch, heads, queries, the static cache's capacity)"


class MultiHeadAttention(nn.Module):
    """Multi-head attention a GPT-like model can use as is; equal to the book's
    MultiHeadAttention given the same weights, and able to load its state_dict unchanged.

    Parameters: when the keys and values are computed from inputs of width d_in, one fused
    `qkv_proj` (d_in -> d_out + 2 * kv_dim, rows in query, key, value order); otherwise
    `q_proj` (d_in -> d_out) and `kv_proj` (context_dim -> 2 * kv_dim). Then `out_proj`.
    Read and write the query/key/value weights with qkv_weights() / load_qkv_weights().

    Args:
        d_in: input width (an int >= 1).
        d_out: output width, split over the heads; num_heads must divide it.
        context_length: the longest sequence (positions) the module takes.
        dropout: dropout on the attention weights in training, in [0, 1).
        num_heads: query heads.
        qkv_bias: biases on the query/key/value projections (the output one always has).
        num_kv_heads: key/value heads (default num_heads), shared by groups of query heads
            (grouped-query; 1 is multi-query); must divide num_heads.
        causal: mask each query's future in self-attention.
        context_dim: width of the `context` cross-attention reads its keys and values from
            (default d_in); a module whose context_dim differs from d_in is cross-attention
            only.
        rope: rotate queries and keys by their absolute positions (self-attention only;
            needs an even head_dim).
        rope_base: the rotary base (finite, > 1), checked and kept even while rope is off.
        rope_scaling: a rotary scaling for long contexts: transformers' rope_scaling /
            rope_parameters dict (rope_type "llama3", "linear" or "yarn") or the book's
            Llama 3.2 freq_config (attnlab.rope_scaling); rope only.
        rotary_dim: rotate only the first rotary_dim features of each head (partial
            rotary; even, at most head_dim; default all); rope only.
        qk_norm: RMSNorm on the queries and keys before the rotation: "head" over each
            head's features (Qwen3, Gemma 3), "projection" over the whole projection
            (OLMo 2), or None. The norms are the submodules q_norm and k_norm.
        qk_norm_eps: the norms' epsilon.
        qk_norm_offset: added to the norms' weight when it scales (1.0 for Gemma's
            `1 + weight`, whose weight starts at zeros).
        scale: the attention scores' scale (default 1 / sqrt(head_dim); Gemma 3's is
            query_pre_attn_scalar ** -0.5).
        window: each query sees only the `window` most recent keys, itself included
            (causal only).
        backend: attnlab.functional's kernel: "auto", "math", "sdpa" or "flash".
        device: where the parameters go, as for torch's own modules.
        dtype: the parameters' floating-point dtype.

    Raises:
        TypeError: an argument of the wrong type (a bool for a size, a string flag, a
            non-floating dtype).
        ValueError: a value out of range, or arguments that do not fit together (the message
            names them, e.g. "num_heads (3) must divide d_out (8)").

    Example:
        >>> m = MultiHeadAttention(64, 64, 128, 0.0, num_heads=8, num_kv_heads=2)
        >>> m(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        num_kv_heads: int | None = None,
        causal: bool = True,
        context_dim: int | None = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        window: int | None = None,
        backend: str = "auto",
        rope_scaling: dict | None = None,
        rotary_dim: int | None = None,
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_offset: float = 0.0,
        scale: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dtype = None if dtype is None else check_float_dtype("dtype", dtype)
        factory = {"device": check_device("device", device), "dtype": dtype}
        self.d_in = check_size("d_in", d_in)
        self.d_out = check_size("d_out", d_out)
        check_product("d_in x d_out", self.d_in, self.d_out)
        self.context_length = check_size("context_length", context_length)
        self.dropout = check_dropout("dropout", dropout)
        self.num_heads = check_size("num_heads", num_heads)
        check_divides("num_heads", num_heads, "d_out", d_out)
        self.num_kv_heads = check_size(
            "num_kv_heads", self.num_heads if num_kv_heads is None else num_kv_heads
        )
        check_divides("num_kv_heads", self.num_kv_heads, "num_heads", num_heads)
        self.qkv_bias = check_bool("qkv_bias", qkv_bias)
        self.causal = check_bool("causal", causal)
        self.context_dim = (
            self.d_in if context_dim is None else check_size("context_dim", context_dim)
        )
        check_product("context_dim x d_out", self.context_dim, self.d_out)
        self.window = None if window is None else check_int("window", window)
        if window is not None and not causal:
            raise ValueError(f"window ({window}) needs causal=True: it keeps the most recent keys")
        self.backend = functional.check_backend(backend)
        self.rope_base = check_base(rope_base)  # kept in config even while rope is off
        self.rope = None
        rope = check_bool("rope", rope)
        self.rope_scaling = rope_scaling_.check_scaling(rope_scaling)
        self.rotary_dim = None if rotary_dim is None else check_size("rotary_dim", rotary_dim)
        if not rope and (self.rope_scaling is not None or self.rotary_dim is not None):
            raise ValueError("rope_scaling and rotary_dim need rope=True")
        if rope:
            if self.head_dim % 2 != 0:
                raise ValueError(
                    f"rope=True needs an even head_dim (d_out / num_heads = {d_out} / "
                    f"{num_heads} = {self.head_dim})"
                )
            self.rope = RotaryEmbedding(
                self.head_dim,
                self.context_length,
                self.rope_base,
                scaling=self.rope_scaling,
                rotary_dim=self.rotary_dim,
                device=factory["device"],
            )
        self.scale = scale  # checked by its setter
        self._make_qk_norms(qk_norm, qk_norm_eps, qk_norm_offset, factory)
        if self.fused:
            self.qkv_proj = nn.Linear(d_in, d_out + 2 * self.kv_dim, bias=qkv_bias, **factory)
        else:
            self.q_proj = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
            self.kv_proj = nn.Linear(self.context_dim, 2 * self.kv_dim, bias=qkv_bias, **factory)
        self.out_proj = nn.Linear(
            d_out, d_out, **factory
        )  # combines the heads' outputs, as in the book
        self.shards = 1  # ranks the heads are split over (attnlab.parallel.tensor_parallel)
        self.register_load_state_dict_pre_hook(_book_state_dict_hook)

    def _make_qk_norms(self, qk_norm, eps, offset, factory) -> None:
        if qk_norm not in (None, "head", "projection"):
            raise ValueError(f"qk_norm must be None, 'head' or 'projection', got {qk_norm!r}")
        self.qk_norm = qk_norm
        self.qk_norm_eps = check_float("qk_norm_eps", eps, greater_than=0.0)
        self.qk_norm_offset = check_float("qk_norm_offset", offset)
        if qk_norm is None:
            return
        q_dim, k_dim = (self.head_dim,) * 2 if qk_norm == "head" else (self.d_out, self.kv_dim)
        options = {"offset": self.qk_norm_offset, **factory}
        check_offset("qk_norm_offset", self.qk_norm_offset, factory["dtype"])
        self.q_norm = RMSNorm(q_dim, self.qk_norm_eps, **options)
        self.k_norm = RMSNorm(k_dim, self.qk_norm_eps, **options)

    @property
    def scale(self) -> float | None:
        """The scores' scale as given (None: 1 / sqrt(head_dim), attention_scale's default);
        set it to another positive float, finite in float32, or None."""
        return self._scale

    @scale.setter
    def scale(self, scale: float | None) -> None:
        if scale is not None:
            scale = check_float("scale", scale, greater_than=0.0)
            functional.check_scale_in(scale, torch.float32)  # where the scores are computed
        self._scale = scale

    @property
    def attention_scale(self) -> float:
        """The scores' scale: `scale`, or 1 / sqrt(head_dim)."""
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale

    @property
    def head_dim(self) -> int:
        """Features per head: d_out / num_heads."""
        return self.d_out // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of all key (or all value) heads together: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def fused(self) -> bool:
        """True when queries, keys and values come from one fused projection of width d_in."""
        return self.context_dim == self.d_in

    @property
    def config(self) -> dict:
        """The constructor's arguments (JSON-friendly; device and dtype excluded, they
        belong to the parameters): MultiHeadAttention(**module.config) builds a twin.

        A module sharded by tensor_parallel holds num_heads / shards heads (its num_heads,
        num_kv_heads and d_out attributes are this rank's share); config still describes
        the whole module, and `shards` says how many ranks share it. qk_norm_eps and
        qk_norm_offset are what the query/key norms hold now (an edit of theirs is kept).

        Raises:
            ValueError: the query and key norms hold different eps or offsets, which one
                config cannot describe.
        """
        return {
            "d_in": self.d_in,
            "d_out": self.d_out * self.shards,
            "context_length": self.context_length,
            "dropout": self.dropout,
            "num_heads": self.num_heads * self.shards,
            "qkv_bias": self.qkv_bias,
            "num_kv_heads": self.num_kv_heads * self.shards,
            "causal": self.causal,
            "context_dim": self.context_dim,
            "rope": self.rope is not None,
            "rope_base": self.rope_base,
            "window": self.window,
            "backend": self.backend,
            "rope_scaling": self.rope_scaling,
            "rotary_dim": self.rotary_dim,
            "qk_norm": self.qk_norm,
            **self._norm_constants(),
            "scale": self.scale,
        }

    def _norm_constants(self) -> dict:
        """qk_norm_eps and qk_norm_offset as the norms hold them now (an edit of a norm's
        eps is part of the module), or as constructed where the norms are not attnlab's."""
        norms = [self._modules.get(name) for name in ("q_norm", "k_norm")]
        if not all(isinstance(norm, RMSNorm) for norm in norms):
            return {"qk_norm_eps": self.qk_norm_eps, "qk_norm_offset": self.qk_norm_offset}
        (q_eps, q_offset), (k_eps, k_offset) = ((n.eps, n.offset) for n in norms)
        if (q_eps, q_offset) != (k_eps, k_offset):
            raise ValueError(
                f"q_norm (eps {q_eps}, offset {q_offset}) and k_norm (eps {k_eps}, offset "
                f"{k_offset}) differ: the config holds one eps and one offset for both"
            )
        return {"qk_norm_eps": q_eps, "qk_norm_offset": q_offset}

    def extra_repr(self) -> str:
        return (
            f"d_in={self.d_in}, d_out={self.d_out}, context_length={self.context_length}, "
            f"dropout={self.dropout}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, causal={self.causal}, "
            f"context_dim={self.context_dim}, window={self.window}, backend={self.backend!r}"
            + (f", shard of {self.shards}" if self.shards > 1 else "")
        )

    def make_cache(
        self,
        batch_size: int,
        max_tokens: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        static: bool = False,
    ) -> KVCache | StaticKVCache:
        """A KVCache for this module's key/value heads; rolling, of `window` tokens, when
        windowed; laid out in blocks of kv_cache.BLOCK_TOKENS tokens where attnlab's native
        CPU decode step will read it (decode_cpu.reads), else as one block. With
        static=True, a StaticKVCache: fixed shapes and a position on the device, for a
        decode loop compiled into one CUDA graph (attnlab.static_cache).

        Args:
            batch_size: sequences decoded together.
            max_tokens: positions the cache can hold (default context_length).
            dtype: how keys and values are stored (default the parameters' dtype):
                torch.bfloat16 or torch.float16 halve a float32 cache, torch.int8 quarters it
                (symmetric per-token, per-head scales stored beside it); they are read back
                in the parameters' dtype.
            device: where the buffers live (default the parameters' device).
            static: a StaticKVCache (max_tokens at most context_length) instead.

        Returns:
            An empty KVCache, or StaticKVCache.

        Raises:
            ValueError: batch_size or max_tokens is not a positive int, or a static cache
                longer than context_length.
            TypeError: dtype is neither floating-point nor torch.int8.
        """
        weight = self._parameter()
        dtype = weight.dtype if dtype is None else dtype  # KVCache checks it
        device = weight.device if device is None else check_device("device", device)
        device = torch.device(device)
        max_tokens = self.context_length if max_tokens is None else max_tokens
        if check_bool("static", static):
            cache = StaticKVCache(
                batch_size, max_tokens, self.num_kv_heads, self.head_dim, dtype=dtype, device=device
            )
            self._check_static_capacity(cache)
            return cache
        native = plan.native_module(self) is not None and decode_cpu.reads(dtype, device)
        return KVCache(
            batch_size,
            max_tokens,
            self.num_kv_heads,
            self.head_dim,
            dtype=dtype,
            device=device,
            window=self.window,
            block_tokens=BLOCK_TOKENS if native else None,  # the native step's layout
            tokens_last=device.type == "cpu",  # elsewhere rows: what SDPA reads uncopied
        )

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend: (b, tq, d_in) -> (b, tq, d_out).

        Args:
            x: (b, tq, d_in), in the parameters' dtype and device, finite.
            context: (b, tk, context_dim) for cross-attention: keys and values from it,
                never causal (its tokens have no order relative to x's).
            mask: bool, True where a query may attend (attnlab.masks), or additive float
                (finite, -inf where it may not), broadcastable to (b, h, tq, tk); with a
                cache its keys axis covers every position so far (cache.position + tq).
            need_weights: also return each head's attention weights (computed only then).
            cache: a KVCache from make_cache: x holds the next tokens of the sequences,
                whose keys and values are appended; they attend causally to every token
                held. The call is all or nothing: one that raises leaves the cache as it was.
                A StaticKVCache (make_cache(static=True)) works the same way with no grad
                recorded; its mask's keys axis (and the weights') is its capacity.

        Returns:
            The output (b, tq, d_out), or (output, weights (b, h, tq, tk)) with
            need_weights: with a cache, tk is every position so far, in position order. A
            query with no key left gets zeros.

        Raises:
            TypeError: a non-tensor, a non-bool need_weights, a dtype other than the
                parameters', a cache that is not a KVCache.
            ValueError: shapes, devices, positions past context_length, a full cache, a
                non-finite input, a mask that does not fit, or a backend that cannot run
                the call (the message says which).
        """
        if (
            need_weights is False
            and cache is not None
            and context is None
            and mask is None
            and not torch.compiler.is_compiling()  # a trace takes the Python path
        ):
            out = plan.decode_lane(self, x, cache)  # the plan in C++: ~2 us, not ~25
            if out is not None:
                return out
        x = self._check_input("x", x, self.d_in, batch=None, finite=False)
        check_bool("need_weights", need_weights)
        start = self._start_position(x, context, cache)
        if context is not None:
            context = self._check_input("context", context, self.context_dim, batch=x.shape[0])
        mask = self._check_mask(mask, x, context, start, cache)
        if self.scale is not None and x.dtype.itemsize < 4:  # float16's largest is 65504
            functional.check_scale_in(self.scale, x.dtype)
        functional.check_backend_call(
            self.backend,
            need_weights=need_weights,
            dropout_p=self.dropout if self.training else 0.0,
            dtype=x.dtype,
            device=x.device,
            head_dims=(self.head_dim,),
            mask=mask,
        )
        if cache is not None and context is None and mask is None and not need_weights:
            out = self._native_step(x, cache)  # the plan's allow-list: layers of exact shapes
            if out is not None:
                return out
        self._check_layers(start, x, context)  # what the Python path will call
        self._check_finite("x", x)
        return self._execute(x, context, mask, need_weights, start, cache)

    def _execute(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None,
        mask: torch.Tensor | None,
        need_weights: bool,
        start: int,
        cache: KVCache | StaticKVCache | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The Python path for a checked call, by the cache it writes (if any); an output
        that overflowed raises before the call counts (the cache as it was)."""
        if cache is None:
            result = self._attend(x, context, mask, need_weights, start, None)
            return check_finite_result(result)
        if isinstance(cache, StaticKVCache):  # its position moves only once the step is done
            return self._attend_static(x, mask, need_weights, cache)
        with cache.transaction(x.shape[1]):  # a call that raises leaves the cache as it was
            result = self._attend(x, context, mask, need_weights, start, cache)
            return check_finite_result(result)

    def _native_step(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """The native decode step's output where the call plan takes it (attnlab.plan), else
        None; None too, with nothing written, when x is not finite (then _check_finite
        raises forward's error)."""
        weights = plan.native_decode(self, x, cache)
        if weights is None:
            return None
        scale = self.attention_scale
        return decode_cpu.step(x, weights, self.num_heads, scale, cache, self.window)

    def _attend(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None,
        mask: torch.Tensor | None,
        need_weights: bool,
        start: int,
        cache: KVCache | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """forward() after its checks: project, rotate, cache, attend, combine the heads."""
        q, k, v = self._project(x, context)
        if self.rope is not None and context is None:
            # through its __call__: its hooks and a subclass's forward run
            q, k = self.rope(q, start), self.rope(k, start)  # (b, h|hkv, tq, hd)
        key_positions = None
        if cache is not None:
            k, v, key_positions = cache.append(k, v)  # (b, hkv, tk, hd): every token held
        mask, causal = self._attention_mask(mask, q, k, start, key_positions, context is None)
        dropout_p = self.dropout if self.training else 0.0
        scale = self.attention_scale
        result = functional.attend(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            need_weights=need_weights,
            backend=self.backend,
        )
        out, weights = result if need_weights else (result, None)
        out = self._combine_heads(out)
        if not need_weights:
            return out
        if key_positions is not None:  # a rolling cache's slots: back in position order
            num = start + x.shape[1]
            weights = _at_positions(weights, key_positions, num)  # (b, h, tq, start + tq)
        return out, weights

    def _attend_static(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        need_weights: bool,
        cache: StaticKVCache,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """forward() with a StaticKVCache after its checks: the same shapes and no value read
        at every position (attnlab.static_cache)."""
        q, k, v = self._project(x, None)
        positions = cache._positions(x.shape[1])  # (tq,) on the device
        if self.rope is not None:
            q, k = self.rope(q, positions), self.rope(k, positions)  # through its __call__
        with cache._kept_if_raised(positions):  # a step that raises writes nothing
            k, v = cache._write(k, v, positions)  # (b, hkv, capacity, hd)
            visible = cache._visible(positions, self.window)  # (tq, capacity)
            visible = visible.view(1, 1, *visible.shape)  # (1, 1, tq, capacity)
            mask = visible if mask is None else masks.combine_masks(mask, visible)
            result = functional.attend(
                q,
                k,
                v,
                mask=mask,
                causal=False,
                scale=self.attention_scale,
                dropout_p=self.dropout if self.training else 0.0,
                need_weights=need_weights,
                backend=self.backend,
                nonempty_rows=mask is visible,  # each query sees its own slot
            )
            out, weights = result if need_weights else (result, None)
            out = self._combine_heads(out)
            check_finite_result(out)
        cache._advance(x.shape[1])  # last: a step that raised has moved nothing
        return (out, weights) if need_weights else out

    def _combine_heads(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs (b, h, tq, hd) through out_proj: (b, tq, out_proj's width)."""
        b, _, tq, _ = out.shape
        out = out.transpose(1, 2).reshape(b, tq, self.d_out)  # (b, h, tq, hd) -> (b, tq, d_out)
        return self._call("out_proj", out)

    def _check_mask(
        self,
        mask: object,
        x: torch.Tensor,
        context: torch.Tensor | None,
        start: int,
        cache: KVCache | StaticKVCache | None,
    ) -> torch.Tensor | None:
        """The user's mask, checked against the scores it applies to: with a cache its keys
        axis covers every position so far (a static cache's: its capacity), with a context
        the context's tokens."""
        keys = start + x.shape[1] if context is None else context.shape[1]
        what = _CACHED_MASK if start else "(batch, heads, queries, keys)"
        if isinstance(cache, StaticKVCache):
            keys, what = cache.capacity, _STATIC_MASK
        shape = (x.shape[0], self.num_heads, x.shape[1], keys)
        return functional.check_mask(mask, shape, x.device, what)

    def _start_position(
        self, x: torch.Tensor, context: torch.Tensor | None, cache: KVCache | None
    ) -> int:
        """Absolute position of x's first token, after checking that the cache fits."""
        start = 0
        if cache is not None and debug.in_func_transform():
            raise ValueError(
                "a cache is written in place, which a torch.func transform (vmap, grad, jvp) "
                "refuses: call the module with a cache outside the transform, or without one "
                "inside it (forward-mode AD through torch.autograd.forward_ad decodes)"
            )
        if isinstance(cache, StaticKVCache):
            self._check_static_cache(cache, x, context)
            # the host's count, never read under torch.compile (a guard per position)
            start = 0 if torch.compiler.is_compiling() else cache.tokens  # synced by the check
        elif cache is not None:
            self._check_cache(cache, x, context)
            start = cache.position
        if start + x.shape[1] > self.context_length:
            where = f" at positions {start}..{start + x.shape[1] - 1}" if cache else ""
            raise ValueError(
                f"x has {x.shape[1]} tokens{where}, more than context_length "
                f"({self.context_length})"
            )
        return start

    def _check_static_cache(
        self, cache: StaticKVCache, x: torch.Tensor, context: torch.Tensor | None
    ) -> None:
        """A StaticKVCache fits the call: its heads, dtype, device, batch and capacity, no
        grad recorded, and (outside torch.compile) room by the host's count."""
        self._check_cache_shape(cache, x, context)
        self._check_static_capacity(cache)
        cache.sync_tokens()  # after compiled steps: the device's position, read once
        if cache.locked_by_inference_mode:
            raise ValueError(
                "the static cache was made under torch.inference_mode(), whose tensors "
                "cannot be written outside it: decode under inference_mode too, or make the "
                "cache outside it"
            )
        if torch.is_grad_enabled() and self._records_grad(x):
            raise ValueError(
                "a StaticKVCache is for inference: no gradient flows through its buffers; "
                "decode under torch.no_grad(), or use make_cache() without static"
            )
        if x.shape[1] and not torch.compiler.is_compiling():
            cache.check_room(x.shape[1])

    def _check_static_capacity(self, cache: StaticKVCache) -> None:
        if cache.max_tokens > self.context_length:
            raise ValueError(
                f"a static cache of max_tokens ({cache.max_tokens}) attends over positions "
                f"past context_length ({self.context_length}): make it at most that long"
            )

    def _check_cache_shape(self, cache: object, x: torch.Tensor, context: torch.Tensor | None):
        """Any cache's heads, dtype, device and batch fit x; causal self-attention."""
        if context is not None or not self.causal:
            raise ValueError("a cache is for causal self-attention: no context, causal=True")
        made_for = (cache.num_kv_heads, cache.head_dim)
        if made_for != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"the cache was made for num_kv_heads={made_for[0]}, head_dim={made_for[1]}; "
                f"this module has num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
            )
        if not cache.accepts(x.dtype) or not cache.is_on_device_of(x):
            raise TypeError(
                f"the cache is {cache.dtype} on {cache.device} but x is {x.dtype} on {x.device}"
                f" (a cache stores x's dtype, or a narrower one: bfloat16, float16, int8)"
            )
        if cache.batch_size != x.shape[0]:
            raise ValueError(
                f"x has batch size {x.shape[0]} but the cache holds {cache.batch_size} sequences"
            )

    def _check_cache(self, cache: object, x: torch.Tensor, context: torch.Tensor | None) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(
                f"cache must be a KVCache or StaticKVCache (make_cache), got {type(cache).__name__}"
            )
        self._check_cache_shape(cache, x, context)
        if cache.dtype == torch.int8 and torch.is_grad_enabled() and self._records_grad(x):
            raise ValueError(
                "an int8 cache stores rounded keys and values, through which no gradient flows: "
                "decode under torch.no_grad(), or use a floating-point cache"
            )
        if cache.locked_by_inference_mode:
            raise ValueError(
                "the cache was made under torch.inference_mode(), whose tensors cannot be "
                "written outside it: decode under inference_mode too, or make the cache "
                "outside it"
            )
        if cache.window is not None and (self.window is None or cache.window < self.window):
            raise ValueError(
                f"the cache keeps a window of {cache.window} tokens but this module attends "
                f"to {'every token' if self.window is None else self.window}"
            )
        if x.shape[1]:  # an empty x appends nothing
            cache.check_room(x.shape[1])

    def _records_grad(self, x: torch.Tensor) -> bool:
        """Whether autograd would record this call (x or a parameter requires grad)."""
        return x.requires_grad or any(p.requires_grad for p in self.parameters())

    def _attention_mask(
        self,
        mask: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        start: int,
        key_positions: torch.Tensor | None,
        self_attention: bool,
    ) -> tuple[torch.Tensor | None, bool]:
        """The user's mask with the positional one (causal, window) merged in, and whether
        functional.attention should still apply its own causal mask (bottom-right aligned:
        right when the keys are positions 0 .. tk - 1 in order)."""
        if not self_attention:
            return mask, False
        tq, tk = q.shape[2], k.shape[2]
        if key_positions is not None:  # a rolling cache: keys out of order
            mask = _keys_at(mask, key_positions)
            query_positions = torch.arange(start, start + tq, device=q.device)
            allowed = masks.position_mask(query_positions, key_positions, window=self.window)
            return masks.combine_masks(mask, allowed), False
        if self.window is not None:
            window = masks.sliding_window_mask(tq, tk, window=self.window, device=q.device)
            return masks.combine_masks(mask, window), False
        return mask, self.causal

    def _project(
        self, x: torch.Tensor, context: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (b, h, tq, hd), keys and values (b, hkv, tk, hd), the queries and keys
        through q_norm and k_norm where the module has them."""
        q, k, v = self._project_heads(x, context)
        if self.qk_norm is None:
            return q, k, v
        return (*self._normed(q, k), v)

    def _normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k through q_norm and k_norm: each head's features, or each token's whole
        projection (its heads' features together)."""
        if self.qk_norm == "head":
            return self.q_norm(q), self.k_norm(k)
        return self._norm_tokens(self.q_norm, q), self._norm_tokens(self.k_norm, k)

    @staticmethod
    def _norm_tokens(norm: nn.Module, y: torch.Tensor) -> torch.Tensor:
        b, heads, t, hd = y.shape
        rows = y.transpose(1, 2).reshape(b, t, heads * hd)  # (b, heads, t, hd) -> (b, t, heads*hd)
        return norm(rows).view(b, t, heads, hd).transpose(1, 2)  # (b, heads, t, hd)

    def _project_heads(
        self, x: torch.Tensor, context: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (b, h, tq, hd), keys and values (b, hkv, tk, hd), as projected."""
        if context is None and not self.fused:
            raise ValueError(
                f"this module reads keys and values from a context of width context_dim "
                f"({self.context_dim}) != d_in ({self.d_in}): pass context"
            )
        if context is None:
            qkv = self._split_heads(self._call("qkv_proj", x), -1)  # (b, h + 2 hkv, t, hd)
            return qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.fused:  # cross-attention through the fused rows: queries of x, keys of context
            q = self._call("qkv_proj", x).narrow(-1, 0, self.d_out)  # (b, tq, d_out)
            kv_rows = self._call("qkv_proj", context).narrow(-1, self.d_out, 2 * self.kv_dim)
            k, v = kv_rows.chunk(2, dim=-1)  # (b, tk, kv_dim) each
        else:
            q = self._call("q_proj", x)  # (b, tq, d_out)
            k, v = self._call("kv_proj", context).chunk(2, dim=-1)  # (b, tk, kv_dim) each
        return tuple(self._split_heads(t, -1) for t in (q, k, v))

    def _projections(self) -> dict[str, tuple[int | None, int]]:
        """Each projection's name and the (out, in) features it must map (out None: any
        width, for out_proj, whose output is the module's)."""
        if self.fused:
            qkv_shapes = {"qkv_proj": (self.d_out + 2 * self.kv_dim, self.d_in)}
        else:
            qkv_shapes = {
                "q_proj": (self.d_out, self.d_in),
                "kv_proj": (2 * self.kv_dim, self.context_dim),
            }
        return {**qkv_shapes, "out_proj": (None, self.d_out)}

    def _call(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The projection `name` of x (..., in), as calling it gives (attnlab.plan.project),
        its output width checked against what the module needs."""
        width, _ = self._projections()[name]
        layer = self._modules[name]
        y = plan.project(x, layer, (width, x.shape[-1]))
        if (
            not isinstance(y, torch.Tensor)
            or y.shape[:-1] != x.shape[:-1]
            or (width is not None and y.shape[-1] != width)
        ):
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            want = (*x.shape[:-1], "any" if width is None else width)
            raise ValueError(
                f"{name} ({type(layer).__name__}) returned {got} for input {tuple(x.shape)}; "
                f"this module needs {want}"
            )
        return y

    def _check_layers(self, start: int, x: torch.Tensor, context: torch.Tensor | None) -> None:
        """The projections and rotary tables the call will use fit the module: an nn.Linear
        (or subclass) put in a projection's place maps the features the module needs, with a
        bias of its output width, in x's dtype (autocast aside) and on its device; the rope
        tables cover the call's positions."""
        tokens = x.shape[1]
        for name, (width, features) in self._projections().items():
            layer = self._modules.get(name)
            _check_projection(name, layer, width, features)
            plan.check_projection_dtype(name, layer, x)
        if self.rope is None or context is not None:
            return
        rope = self.rope
        if not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope must be an attnlab RotaryEmbedding, got {type(rope).__name__}")
        rows, features = rope.cos.shape
        if rope.head_dim != self.head_dim or features > self.head_dim or start + tokens > rows:
            raise ValueError(
                f"rope's tables hold {rows} positions of {features} features; this call needs "
                f"positions {start}..{start + tokens - 1} of head_dim ({self.head_dim})"
            )

    def qkv_weights(self) -> qkv.QKVWeights:
        """The query, key and value projections as views of whichever layout stores them.

        Returns:
            QKVWeights: q_weight (d_out, d_in), k_weight and v_weight (kv_dim, context_dim),
            and the biases (d_out,), (kv_dim,), (kv_dim,), or None without qkv_bias.
            They share storage with the parameters (detach or clone to keep a copy).
        """
        if self.fused:
            proj, kv_rows = self.qkv_proj, self.kv_dim
            weights = qkv.split_rows(proj.weight, self.d_out, kv_rows)
            return qkv.QKVWeights(*weights, *qkv.split_rows(proj.bias, self.d_out, kv_rows))
        k_weight, v_weight = self.kv_proj.weight.chunk(2)  # (kv_dim, context_dim) each
        k_bias, v_bias = (None, None) if self.kv_proj.bias is None else self.kv_proj.bias.chunk(2)
        return qkv.QKVWeights(
            self.q_proj.weight, k_weight, v_weight, self.q_proj.bias, k_bias, v_bias
        )

    def load_qkv_weights(self, weights: qkv.QKVWeights) -> None:
        """Copy query, key and value weights (and biases) into this module, whichever
        layout stores them; the inverse of qkv_weights().

        Args:
            weights: shapes as qkv_weights() returns them; biases None for a module
                without qkv_bias (and given for one with it).

        Raises:
            ValueError: a shape that does not fit, or biases given or missing.
        """
        mine = self.qkv_weights()
        for name, new, old in zip(qkv.QKVWeights._fields, weights, mine, strict=True):
            if (new is None) != (old is None) or (new is not None and new.shape != old.shape):
                shape = None if new is None else tuple(new.shape)
                want = None if old is None else tuple(old.shape)
                raise ValueError(f"weights.{name} has shape {shape}; this module needs {want}")
        with torch.no_grad():
            for new, old in zip(weights, mine, strict=True):
                if new is not None:
                    old.copy_(new)

    def _split_heads(self, projected: torch.Tensor, heads: int) -> torch.Tensor:
        """Heads of head_dim features each (heads=-1: as many as the width holds)."""
        b, t, width = projected.shape
        heads = width // self.head_dim if heads == -1 else heads
        # (b, t, heads * hd) -> (b, t, heads, hd) -> (b, heads, t, hd)
        return projected.view(b, t, heads, self.head_dim).transpose(1, 2)

    def _check_input(
        self, name: str, x: object, width: int, *, batch: int | None, finite: bool = True
    ) -> torch.Tensor:
        width_name, layout = _LAYOUTS[name]
        x = check_tensor(
            name, x, ndims=(3,), layout=layout, last_dim=width, last_dim_name=width_name
        )
        check_like_parameter(name, x, self._parameter())
        if finite:
            self._check_finite(name, x)
        if batch is not None and x.shape[0] != batch:
            raise ValueError(f"{name} has batch size {x.shape[0]} but x has {batch}")
        return x

    def _check_finite(self, name: str, x: torch.Tensor) -> None:
        """x's values finite, where attnlab.debug lets a check read them (CPU by default)."""
        if debug.reads_values(x) and not _sums_finite(x):  # one read; check_finite's word
            check_finite(name, x)

    def _parameter(self) -> torch.Tensor:
        """A parameter whose dtype and device inputs must match: the first projection's
        (its weight's own entry read directly where it has one: paid per call)."""
        first = "qkv_proj" if self.fused else "q_proj"
        layer = self._modules[first]
        weight = layer._parameters.get("weight")
        if weight is not None:
            return weight
        weight = getattr(layer, "weight", None)  # a buffer, or a plain attribute
        if isinstance(weight, torch.Tensor):
            return weight
        for tensor in layer.parameters():
            return tensor
        raise ValueError(f"{first} holds no parameters: its dtype and device are unknown")

    @classmethod
    def _steps_as_written(cls) -> bool:
        """True when every method and property MultiHeadAttention defines is, on `cls`, the
        one this file defines: False for a subclass that overrides any of them, and for a
        patch of the class itself (MultiHeadAttention._combine_heads = ...)."""
        return _AS_DEFINED(cls)


# an input's name -> the name of its width and its layout, for check_tensor's messages
_LAYOUTS = {
    "x": ("d_in", "(batch, tokens, d_in)"),
    "context": ("context_dim", "(batch, tokens, context_dim)"),
}

# the fast paths stand for every method MultiHeadAttention defines: any other (a subclass's,
# a class-level patch) takes the Python path
_AS_DEFINED = _own_code.as_defined(MultiHeadAttention)


def _check_projection(name: str, layer: object, width: int | None, features: int) -> None:
    """An nn.Linear (or subclass) in a projection's place maps `features` to `width` (None:
    any), with no bias or one of its output width; other modules, and weights of a tensor
    subclass, are judged by their output (MultiHeadAttention._call)."""
    if not isinstance(layer, nn.Linear):
        return
    weight, bias = layer.weight, layer.bias
    if type(weight) not in (nn.Parameter, torch.Tensor):  # a DTensor shard's global shape,
        return  # a quantised tensor: judged by the output, as other modules are
    fits = weight.dim() == 2 and weight.shape[1] == features
    fits = fits and (width is None or weight.shape[0] == width)
    fits = fits and (bias is None or tuple(bias.shape) == (weight.shape[0],))
    if not fits:
        out = "any" if width is None else width
        raise ValueError(
            f"{name} must be a Linear of weight ({out}, {features}) with no bias or a bias of "
            f"its output width; got weight {tuple(weight.shape)} and bias "
            f"{None if bias is None else tuple(bias.shape)}"
        )


def _sums_finite(x: torch.Tensor) -> bool:
    """True when x's values sum to a finite number (then every value is finite): the fast
    path of check_finite, as one sum and one read of it (a decoded token pays this per
    layer on the CPU; check_finite's tensor ops cost ~3x more)."""
    return math.isfinite(x.sum().item())


def _keys_at(mask: torch.Tensor | None, key_positions: torch.Tensor) -> torch.Tensor | None:
    """The columns of a (checked) mask over every position so far for the keys held."""
    if mask is None:
        return None
    return mask if mask.shape[-1] == 1 else mask.index_select(-1, key_positions)


def _at_positions(weights: torch.Tensor, key_positions: torch.Tensor, num: int) -> torch.Tensor:
    """Weights over the keys held (b, h, tq, tk), in slot order, as weights over every
    position so far (b, h, tq, num): the full forward's weights, 0 for keys left behind."""
    full = weights.new_zeros((*weights.shape[:-1], num))  # (b, h, tq, num)
    return full.index_copy(-1, key_positions, weights)


def _book_state_dict_hook(module, state_dict, prefix, *_args) -> None:
    """Convert a state_dict saved from attnlab.book.MultiHeadAttention (W_query, W_key,
    W_value, out_proj, mask) to this module's layout, in place, before loading."""
    if not qkv.is_book_state(state_dict, prefix):
        return
    if module.num_kv_heads != module.num_heads:
        raise ValueError(
            f"a book MultiHeadAttention state_dict has one key/value head per query head; "
            f"this module has num_kv_heads ({module.num_kv_heads}) != num_heads "
            f"({module.num_heads})"
        )
    qkv.book_to_module_state(state_dict, prefix, module.fused)
