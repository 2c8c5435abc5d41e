"""MultiHeadLatentAttention: DeepSeek-V2/V3's multi-head latent attention (MLA). Keys and
values are expanded, per head, from one low-rank latent of each token; the cache
(attnlab.latent_cache) holds only that latent and one rotary key shared by the heads, so a
token costs kv_lora_rank + qk_rope_head_dim values per layer instead of 2 x heads x
head_dim.

The computation, with DeepSeek's (and transformers' DeepseekV3Attention's) names:

- queries: q_proj(x), or through a low-rank path q_b_proj(RMSNorm(q_a_proj(x))) when
  q_lora_rank is given; each head's query is [q_nope (qk_nope_head_dim), q_rope
  (qk_rope_head_dim)].
- keys and values: kv_a_proj_with_mqa(x) = [latent (kv_lora_rank), k_rope
  (qk_rope_head_dim)]; the latent is normalised (kv_a_layernorm, RMSNorm) and expanded by
  kv_b_proj into each head's [k_nope (qk_nope_head_dim), v (v_head_dim)]; k_rope is one key
  for all heads.
- decoupled rotary positions: only q_rope and k_rope are rotated (the "rotate half" layout;
  attnlab.interop.deepseek converts DeepSeek's interleaved pairs), and a head's key is
  [k_nope, k_rope].
- softmax((q . k) * scale) v per head, scale = 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)
  (times mscale(factor, mscale_all_dim)^2 under a scaled rotary that gives mscale_all_dim,
  as DeepSeek-V3's YaRN), then o_proj over the heads' outputs.

Absorbed decode: with W_UK and W_UV the key and value halves of kv_b_proj, q_nope . (W_UK c)
= (q_nope W_UK) . c, so the queries can be folded into the latent space and attention run
there, on the cached rows as they are (one key head of kv_lora_rank + qk_rope_head_dim
features, its first kv_lora_rank the values), W_UV applied to the heads' outputs after.
That costs per head and key 2 kv_lora_rank + qk_rope_head_dim multiply-adds per query
instead of kv_lora_rank (qk_nope_head_dim + v_head_dim) per key to expand the keys and
values: it wins for few queries against a long cache (decoding) and loses for many
(prefill). forward's `absorb` takes it or not; by default the measured rule of `absorbs`.

Shapes: x is (b, tq, d_model); inside, queries are (b, h, tq, qk_nope_head_dim +
qk_rope_head_dim), keys (b, h, tk, same) and values (b, h, tk, v_head_dim) (absorbed: queries
(b, h, tq, kv_lora_rank + qk_rope_head_dim) against one key head (b, 1, tk, same)); the output
is (b, tq, d_model). h = num_heads, r = kv_lora_rank, dn = qk_nope_head_dim, dr =
qk_rope_head_dim, dv = v_head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import _own_code, debug, decode_cpu, functional, plan
from attnlab import rope_scaling as rope_scaling_
from attnlab._validate import (
    check_bool,
    check_device,
    check_dropout,
    check_finite,
    check_finite_result,
    check_float,
    check_float_dtype,
    check_like_parameter,
    check_size,
    check_tensor,
)
from attnlab.latent_cache import LatentCache
from attnlab.norms import RMSNorm
from attnlab.rope import RotaryEmbedding, check_base


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank
    path, keys and values expanded from a cached low-rank latent, decoupled rotary dims.
    Equal to transformers' DeepseekV3Attention given its weights
    (attnlab.interop.deepseek converts both ways).

    Parameters, with DeepSeek's names: `q_proj` (d_model -> h (dn + dr)) when q_lora_rank is
    None, else `q_a_proj` (d_model -> q_lora_rank), `q_a_layernorm`, `q_b_proj`
    (q_lora_rank -> h (dn + dr)); `kv_a_proj_with_mqa` (d_model -> r + dr),
    `kv_a_layernorm`, `kv_b_proj` (r -> h (dn + dv), each head's key rows then its value
    rows); `o_proj` (h dv -> d_model). The norms are attnlab.norms.RMSNorm (float32 inside).

    Args:
        d_model: input and output width (an int >= 1).
        num_heads: query heads (each with its own key and value, expanded from the latent).
        q_lora_rank: the queries' low-rank width, or None for a plain q_proj.
        kv_lora_rank: the key/value latent's width: what the cache keeps per token.
        qk_nope_head_dim: each head's query/key features without position (>= 0).
        qk_rope_head_dim: each head's rotary query features and the shared rotary key's
            (even, >= 0; 0: no positions, as the book's MLA); qk_nope_head_dim +
            qk_rope_head_dim >= 1.
        v_head_dim: each head's value features.
        context_length: the longest sequence (positions) the module takes.
        dropout: dropout on the attention weights in training, in [0, 1).
        down_bias: biases on q_a_proj and kv_a_proj_with_mqa (DeepSeek's attention_bias;
            q_proj, q_b_proj and kv_b_proj never have one).
        out_bias: a bias on o_proj (DeepSeek's attention_bias; the book's out_proj has one).
        latent_norm: RMSNorm on the latents (q_a_layernorm, kv_a_layernorm), as DeepSeek;
            False: none, as the book's MLA.
        norm_eps: the norms' epsilon (DeepSeek-V3's attention norms: 1e-6).
        rope_base: the rotary base (finite, > 1), checked and kept even without rotary dims.
        rope_scaling: a rotary scaling for long contexts: transformers' rope_scaling /
            rope_parameters dict (DeepSeek-V3's YaRN, Llama 3's, linear) or None
            (attnlab.rope_scaling); its mscale_all_dim also scales the softmax (`scale`).
        causal: mask each query's future.
        device: where the parameters go, as for torch's own modules.
        dtype: the parameters' floating-point dtype.

    Raises:
        TypeError: an argument of the wrong type (a bool for a size, a non-floating dtype).
        ValueError: a value out of range (the message names it).

    Example:
        >>> m = MultiHeadLatentAttention(64, 4, None, 16, 8, 4, 8, context_length=32)
        >>> m(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
        >>> m.make_cache(2).bytes_per_token  # (16 + 4) features x 4 bytes x 2 sequences
        160
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        context_length: int,
        *,
        dropout: float = 0.0,
        down_bias: bool = False,
        out_bias: bool = False,
        latent_norm: bool = True,
        norm_eps: float = 1e-6,
        rope_base: float = 10000.0,
        rope_scaling: dict | None = None,
        causal: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dtype = None if dtype is None else check_float_dtype("dtype", dtype)
        factory = {"device": check_device("device", device), "dtype": dtype}
        self.d_model = check_size("d_model", d_model)
        self.num_heads = check_size("num_heads", num_heads)
        self.q_lora_rank = None if q_lora_rank is None else check_size("q_lora_rank", q_lora_rank)
        self.kv_lora_rank = check_size("kv_lora_rank", kv_lora_rank)
        self.qk_nope_head_dim = check_size("qk_nope_head_dim", qk_nope_head_dim, minimum=0)
        self.qk_rope_head_dim = check_size("qk_rope_head_dim", qk_rope_head_dim, minimum=0)
        self.v_head_dim = check_size("v_head_dim", v_head_dim)
        self.context_length = check_size("context_length", context_length)
        if self.qk_head_dim == 0:
            raise ValueError(
                "qk_nope_head_dim + qk_rope_head_dim must be >= 1 (queries and keys need a "
                "feature), got 0 + 0"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}"
            )
        for name, size in (
            ("num_heads x (qk_nope_head_dim + qk_rope_head_dim)", self.q_width),
            ("num_heads x (qk_nope_head_dim + v_head_dim)", self.kv_width),
            ("num_heads x v_head_dim", self.num_heads * self.v_head_dim),
        ):
            check_size(f"{name} ({size})", size)
        self.dropout = check_dropout("dropout", dropout)
        self.down_bias = check_bool("down_bias", down_bias)
        self.out_bias = check_bool("out_bias", out_bias)
        self.latent_norm = check_bool("latent_norm", latent_norm)
        self.norm_eps = check_float("norm_eps", norm_eps, greater_than=0.0)
        self.causal = check_bool("causal", causal)
        self.rope_base = check_base(rope_base)
        self.rope_scaling = rope_scaling_.check_scaling(rope_scaling)
        self.rope = None
        if self.qk_rope_head_dim:
            self.rope = RotaryEmbedding(
                self.qk_rope_head_dim,
                self.context_length,
                self.rope_base,
                scaling=self.rope_scaling,
                device=factory["device"],
            )
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(self.d_model, self.q_width, bias=False, **factory)
        else:
            rank = self.q_lora_rank
            self.q_a_proj = nn.Linear(self.d_model, rank, bias=down_bias, **factory)
            self.q_a_layernorm = self._norm(rank, factory)
            self.q_b_proj = nn.Linear(rank, self.q_width, bias=False, **factory)
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        self.kv_a_proj_with_mqa = nn.Linear(self.d_model, latent, bias=down_bias, **factory)
        self.kv_a_layernorm = self._norm(self.kv_lora_rank, factory)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.kv_width, bias=False, **factory)
        self.o_proj = nn.Linear(
            self.num_heads * self.v_head_dim, self.d_model, bias=out_bias, **factory
        )

    def _norm(self, width: int, factory: dict) -> RMSNorm | None:
        return RMSNorm(width, self.norm_eps, **factory) if self.latent_norm else None

    @property
    def qk_head_dim(self) -> int:
        """Features of each head's query and key: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_width(self) -> int:
        """Width of all query heads together: num_heads x qk_head_dim."""
        return self.num_heads * self.qk_head_dim

    @property
    def kv_width(self) -> int:
        """kv_b_proj's output: num_heads x (qk_nope_head_dim + v_head_dim)."""
        return self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def scale(self) -> float:
        """The scores' scale: 1 / sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2
        when rope_scaling gives a type other than "default" and a non-zero mscale_all_dim
        (DeepSeek-V3's YaRN; mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1)."""
        return self.qk_head_dim**-0.5 * mscale_factor(self.rope_scaling)

    @property
    def cache_values_per_token(self) -> int:
        """Values a LatentCache holds per token and sequence: kv_lora_rank +
        qk_rope_head_dim (a per-head KVCache of the same heads: 2 x num_heads x
        head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def config(self) -> dict:
        """The constructor's arguments (JSON-friendly; device and dtype excluded):
        MultiHeadLatentAttention(**module.config) builds a twin."""
        return {
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "context_length": self.context_length,
            "dropout": self.dropout,
            "down_bias": self.down_bias,
            "out_bias": self.out_bias,
            "latent_norm": self.latent_norm,
            "norm_eps": self.norm_eps,
            "rope_base": self.rope_base,
            "rope_scaling": self.rope_scaling,
            "causal": self.causal,
        }

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, "
            f"q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope_head_dim={self.qk_nope_head_dim}, "
            f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
            f"context_length={self.context_length}, causal={self.causal}"
        )

    def make_cache(
        self,
        batch_size: int,
        max_tokens: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> LatentCache:
        """A LatentCache for this module: per token and sequence, the normalised latent
        (kv_lora_rank) and the shared rotary key (qk_rope_head_dim), nothing per head.

        Args:
            batch_size: sequences decoded together.
            max_tokens: positions the cache can hold (default context_length; at most it).
            dtype: how the rows are stored (default the parameters' dtype; bfloat16 or
                float16 halve a float32 cache, read back in the module's dtype).
            device: where the buffer lives (default the parameters' device).

        Returns:
            An empty LatentCache; its bytes_per_token is (kv_lora_rank + qk_rope_head_dim)
            x itemsize x batch_size.

        Raises:
            ValueError: batch_size or max_tokens not a positive int, or max_tokens past
                context_length.
            TypeError: dtype not floating point.
        """
        weight = self._parameter()
        dtype = weight.dtype if dtype is None else dtype  # LatentCache checks it
        device = weight.device if device is None else check_device("device", device)
        max_tokens = self.context_length if max_tokens is None else max_tokens
        if check_size("max_tokens", max_tokens) > self.context_length:
            raise ValueError(
                f"max_tokens ({max_tokens}) is past context_length ({self.context_length}): "
                f"the module takes no position beyond it"
            )
        if dtype == torch.float32 and torch.device(device).type == "cpu":
            decode_cpu.available()  # decoding starts here: build the native step (once)
        return LatentCache(
            batch_size,
            max_tokens,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            dtype=dtype,
            device=device,
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        need_weights: bool = False,
        cache: LatentCache | None = None,
        absorb: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend: (b, tq, d_model) -> (b, tq, d_model).

        Args:
            x: (b, tq, d_model), in the parameters' dtype and device, finite.
            mask: bool, True where a query may attend (attnlab.masks), or additive float
                (finite, -inf where it may not), broadcastable to (b, h, tq, tk); with a
                cache its keys axis covers every position so far (cache.position + tq).
            need_weights: also return each head's attention weights.
            cache: a LatentCache from make_cache: x holds the next tokens of the sequences,
                whose latents and rotary keys are appended; they attend causally to every
                token held. A call that raises leaves the cache as it was.
            absorb: True: attend in the latent space (q_nope folded through kv_b_proj's key
                rows, its value rows applied after); False: expand every key and value;
                None: the measured rule (`absorbs`). True needs kv_b_proj a plain
                nn.Linear without hooks (its weight is read directly).

        Returns:
            The output (b, tq, d_model), or (output, weights (b, h, tq, tk)) with
            need_weights (tk every position so far with a cache). A query with no key left
            gets zeros.

        Raises:
            TypeError: a non-tensor, a non-bool flag, a dtype other than the parameters',
                a cache that is not a LatentCache or cannot store x's dtype.
            ValueError: shapes, devices, positions past context_length, a full cache, a
                non-finite input, a mask that does not fit, absorb=True with a kv_b_proj
                it cannot read.
        """
        if (
            cache is not None
            and mask is None
            and need_weights is False
            and absorb is None
            and not torch.compiler.is_compiling()  # a trace takes the Python path
        ):
            out = plan.latent_lane(self, x, cache)  # the plan and the whole step in C++
            if out is not None:
                return out
        x = check_tensor(
            "x", x, ndims=(3,), layout="(batch, tokens, d_model)", last_dim=self.d_model,
            last_dim_name="d_model",
        )  # fmt: skip
        check_like_parameter("x", x, self._parameter())
        for name, layer in self.named_children():  # pristine projections in x's dtype
            plan.check_projection_dtype(name, layer, x)
        check_bool("need_weights", need_weights)
        if absorb is not None:
            check_bool("absorb", absorb)
        start = self._start_position(x, cache)
        tq = x.shape[1]
        keys = "positions so far" if cache is not None else "keys"
        scores = (x.shape[0], self.num_heads, tq, start + tq)
        mask = functional.check_mask(mask, scores, x.device, f"(batch, heads, queries, {keys})")
        absorbed = self._absorbed(absorb, tq, start + tq)
        check_finite("x", x)  # where attnlab.debug lets a check read values
        if cache is None:
            result = self._attend(x, mask, need_weights, absorbed, 0, None)
            return check_finite_result(result)
        with cache.transaction():  # a call that raises leaves the cache as it was
            result = self._attend(x, mask, need_weights, absorbed, start, cache)
            return check_finite_result(result)

    def absorbs(self, num_queries: int, num_keys: int) -> bool:
        """Whether the absorbed path is the default for `num_queries` queries against
        `num_keys` keys (the cache's tokens so far, the call's included): where it does
        fewer multiply-adds than expanding the keys and values.

        Per head, with r = kv_lora_rank: expanding costs num_keys x r x (dn + dv) (kv_b_proj
        on every held latent) plus num_queries x num_keys x (dn + dr + dv) (attention);
        absorbing costs num_queries x r x (dn + dv) (q_nope through W_UK, the output
        through W_UV) plus num_queries x num_keys x (2 r + dr) (attention in the latent
        space). So absorbed when num_queries x num_keys x (2 r - dn - dv) < (num_keys -
        num_queries) x r x (dn + dv): for DeepSeek-V3's heads (r 512, dn 128, dr 64, dv
        128) up to ~170 queries against a long cache, ~85 against 256 keys, never for a
        forward without a cache (as many queries as keys).

        Measured (scripts/mla_absorb.py: d_model 2048, 16 heads, q_lora_rank 1536, batch
        1, float32 CPU, least CPU time of one thread over 7 interleaved rounds), speedup of
        absorbed over expanded:

        | keys | 1 query | 4 | 16 | 32 | 64 | 128 | 256 |
        |---|---|---|---|---|---|---|---|
        | 256 | 2.7x | 2.0x | 1.6x | 1.3x | 1.1x | 0.92x | |
        | 1024 | 7.0x | 4.1x | 3.7x | 2.7x | 1.6x | 1.3x | 0.91x |
        | 4096 | 27x | 15x | 7.0x | 4.2x | 2.5x | 1.2x | 0.94x |

        The rule picks the faster path in every cell: the crossover is where the counts
        cross.

        Args:
            num_queries: the call's tokens.
            num_keys: the keys they attend to.

        Returns:
            True where the absorbed path is the default.
        """
        r, dn, dv = self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim
        latent_attention = num_queries * num_keys * (2 * r - dn - dv)
        return latent_attention < (num_keys - num_queries) * r * (dn + dv)

    def _absorbed(self, absorb: bool | None, num_queries: int, num_keys: int) -> bool:
        """The path this call takes: `absorb` as given (True checked against kv_b_proj), or
        the rule where kv_b_proj is plain."""
        unreadable = self._kv_b_proj_unreadable()
        if absorb is None:
            return unreadable is None and self.absorbs(num_queries, num_keys)
        if absorb and unreadable is not None:
            raise ValueError(
                f"absorb=True reads kv_b_proj's weight directly, which needs a plain "
                f"nn.Linear ({self.kv_lora_rank} -> {self.kv_width}, no bias, no hooks, no "
                f"function or dispatch mode active): {unreadable}; pass absorb=None or False"
            )
        return absorb

    def _kv_b_proj_unreadable(self) -> str | None:
        """Why the absorbed path may not read kv_b_proj's weight in its place, or None."""
        if torch.compiler.is_compiling():  # its pristine checks read what Dynamo cannot trace
            return "torch.compile does not trace the check that it is one"
        if debug.in_func_transform():
            return "inside a torch.func transform its weight is not a registered parameter"
        readable = plan.plain_linear(self.kv_b_proj, (self.kv_width, self.kv_lora_rank))
        readable = readable and self.kv_b_proj.bias is None and plan.no_global_hooks()
        # a function or dispatch mode would not see kv_b_proj called
        if readable and plan.no_active_modes():
            return None
        layer = self.kv_b_proj
        if type(layer) is nn.Linear and type(layer.weight) is not nn.Parameter:
            return "its weight is not a registered nn.Parameter (as in torch.func.functional_call)"
        return f"got {type(layer).__name__} as it is now"

    def _attend(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        need_weights: bool,
        absorbed: bool,
        start: int,
        cache: LatentCache | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """forward() after its checks: project, rotate, cache, attend, combine the heads."""
        tq = x.shape[1]
        query = self._project_queries(x)  # (b, tq, h (dn + dr))
        compressed = self._compress(x)  # (b, tq, r + dr)
        options = dict(
            mask=mask,
            causal=self.causal,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            backend="auto",
        )
        if absorbed and tq == 1:  # the native step, where it stands for the module
            tables = self._native_tables(options, cache, start, (query, compressed))
            out = None if tables is None else self._step_native(query, compressed, tables, cache)
            if out is not None:  # None: float32 overflowed, the path below computes it
                return self._combine(out)
        q_nope, q_rope = self._queries(query)  # (b, h, tq, dn), (b, h, tq, dr)
        latent, k_rope = self._latents(compressed)  # (b, tq, r), (b, 1, tq, dr)
        if self.rope is not None:  # through its __call__: its hooks and a subclass's run
            q_rope, k_rope = self.rope(q_rope, start), self.rope(k_rope, start)
        k_rope = k_rope.squeeze(1)  # (b, tq, dr)
        rows = None
        if cache is not None:
            rows = cache.append(latent, k_rope)  # (b, tk, r + dr): every token held
            latent, k_rope = rows.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        result = None  # None until a path computes it: an overflow passes it on
        if absorbed:
            if rows is None:
                rows = torch.cat([latent, k_rope], dim=-1)  # (b, tk, r + dr)
            result = self._attend_absorbed(q_nope, q_rope, rows, options)
        if result is None:  # not absorbed, or q_nope W_UK overflowed q's dtype
            result = self._attend_expanded(q_nope, q_rope, latent, k_rope, options)
        out, weights = result if need_weights else (result, None)  # (b, h, tq, dv)
        out = self._combine(out)  # (b, tq, d_model)
        return (out, weights) if need_weights else out

    def _combine(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs (b, h, tq, dv) through o_proj: (b, tq, d_model)."""
        b, _, tq, _ = out.shape
        width = self.num_heads * self.v_head_dim
        out = out.transpose(1, 2).reshape(b, tq, width)  # (b, tq, h dv)
        return plan.project(out, self.o_proj, (self.d_model, width))  # (b, tq, d_model)

    def _native_tables(
        self, options: dict, cache: LatentCache | None, start: int, projected: tuple
    ) -> decode_cpu.LatentTables | None:
        """The latent norm and rotary tables decode_cpu.latent_step reads in their place
        when it computes this absorbed one-token call, else None. It does for: a float32
        CPU cache and projections, no mask, weights, dropout, autocast or gradient wanted
        (forward-mode tangents included), no function or dispatch mode and no global module
        hook, the module's own methods (no subclass or instance override), kv_a_layernorm
        and rope each None or attnlab's own, pristine (plan.latent_tables), the extension
        built (make_cache builds it). The absorbed path's own condition (kv_b_proj plain)
        holds already."""
        if cache is None or options["mask"] is not None or options["need_weights"]:
            return None
        if not _AS_DEFINED(type(self)) or not self.__dict__.keys().isdisjoint(_METHODS):
            return None  # a subclass's or the instance's own step: the Python path runs it
        rows = cache.rows
        if type(rows) is not torch.Tensor or not rows.is_cpu or options["dropout_p"]:
            return None
        read = (*projected, self.kv_b_proj.weight, rows)  # what the step reads
        if not decode_cpu.computes(*read):  # float32, no gradient, autocast or tangent
            return None
        if not (plan.no_active_modes() and plan.no_global_hooks()):
            return None
        r, dr = self.kv_lora_rank, self.qk_rope_head_dim
        return plan.latent_tables(self.kv_a_layernorm, self.rope, r, dr, start)

    def _step_native(self, query, compressed, tables, cache):
        """decode_cpu.latent_step: the token's row written to the cache (its position then
        moves on) and the heads' outputs (b, h, 1, dv); None where float32 overflowed (the
        position stays, and the Python path writes the row again)."""
        b, h, start = query.shape[0], self.num_heads, cache.position
        query = query.reshape(b, h, self.qk_head_dim).contiguous()  # (b, h, dn + dr)
        compressed = compressed.reshape(b, -1).contiguous()  # (b, r + dr)
        weight = self.kv_b_proj.weight  # (h (dn + dv), r)
        out = decode_cpu.latent_step(
            query, compressed, tables, start, cache.rows, weight, self.scale
        )
        if out is None:
            return None
        cache.position = start + 1
        return out.view(b, h, 1, self.v_head_dim)  # (b, h, 1, dv)

    def _attend_expanded(self, q_nope, q_rope, latent, k_rope, options):
        """Every held latent (b, tk, r) through kv_b_proj: per-head keys and values, each
        key with the shared rotary key (b, tk, dr); then attention."""
        b, tk, dr = k_rope.shape
        h, dn, dv = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        kv = self.kv_b_proj(latent)  # (b, tk, h (dn + dv))
        kv = kv.view(b, tk, h, dn + dv).transpose(1, 2)  # (b, h, tk, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)  # (b, h, tk, dn), (b, h, tk, dv)
        k_rope = k_rope.unsqueeze(1).expand(b, h, tk, dr)  # (b, h, tk, dr)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (b, h, tq, dn + dr)
        k = torch.cat([k_nope, k_rope], dim=-1)  # (b, h, tk, dn + dr)
        return functional.attend(q, k, v, **options)

    def _attend_absorbed(self, q_nope, q_rope, rows, options):
        """Attention in the latent space: q_nope W_UK against the held rows as one key head
        (b, 1, tk, r + dr), their latents the values; W_UV on the heads' outputs. None
        where values are read and q_nope W_UK is not finite (the caller then expands)."""
        h, dn, dv, r = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(h, dn + dv, r)  # (h, dn + dv, r): head by head
        w_uk, w_uv = w.split([dn, dv], dim=1)  # (h, dn, r), (h, dv, r)
        q_latent = q_nope @ w_uk  # (b, h, tq, dn) @ (h, dn, r) -> (b, h, tq, r)
        if debug.reads_values(q_latent) and not bool(torch.isfinite(q_latent).all()):
            return None  # past q's dtype (65504 in float16): the expanded path computes it
        q = torch.cat([q_latent, q_rope], dim=-1)  # (b, h, tq, r + dr)
        k = rows.unsqueeze(1)  # (b, 1, tk, r + dr): one key head for every query head
        v = k.narrow(-1, 0, r)  # (b, 1, tk, r): the latents, a view of the same rows
        # attnlab's math backend: its grouped product reads the one key head once for all
        # h x tq query rows (CPU SDPA with enable_gqa took ~100x longer: 1 query, 4096 keys)
        result = functional.attend(q, k, v, **{**options, "backend": "math"})
        out, weights = result if options["need_weights"] else (result, None)  # (b, h, tq, r)
        out = out @ w_uv.transpose(1, 2)  # (b, h, tq, r) @ (h, r, dv) -> (b, h, tq, dv)
        return (out, weights) if options["need_weights"] else out

    def _project_queries(self, x: torch.Tensor) -> torch.Tensor:
        """The queries as projected, (b, tq, h (dn + dr))."""
        # plan.project: a pristine layer computed by attnlab.matvec for a few rows, else called
        if self.q_lora_rank is None:
            q = plan.project(x, self.q_proj, (self.q_width, self.d_model))  # (b, tq, h (dn + dr))
        else:
            rank = self.q_lora_rank
            q = plan.project(x, self.q_a_proj, (rank, self.d_model))  # (b, tq, q_lora_rank)
            if self.q_a_layernorm is not None:
                q = self.q_a_layernorm(q)
            q = plan.project(q, self.q_b_proj, (self.q_width, rank))  # (b, tq, h (dn + dr))
        return q

    def _queries(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's query split (b, h, tq, dn), (b, h, tq, dr), from the projected
        (b, tq, h (dn + dr))."""
        b, tq, _ = q.shape
        q = q.view(b, tq, self.num_heads, self.qk_head_dim).transpose(1, 2)  # (b, h, tq, dn + dr)
        return q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    def _compress(self, x: torch.Tensor) -> torch.Tensor:
        """kv_a_proj_with_mqa(x): the latent, then the rotary key, (b, tq, r + dr)."""
        width = self.kv_lora_rank + self.qk_rope_head_dim
        return plan.project(x, self.kv_a_proj_with_mqa, (width, self.d_model))

    def _latents(self, compressed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised latent (b, tq, r) and the rotary key, unrotated, (b, 1, tq, dr),
        from kv_a_proj_with_mqa's output (b, tq, r + dr)."""
        b, tq, _ = compressed.shape
        latent, k_rope = compressed.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        if self.kv_a_layernorm is not None:
            latent = self.kv_a_layernorm(latent)
        k_rope = k_rope.view(b, 1, tq, self.qk_rope_head_dim)  # (b, 1, tq, dr): one head
        return latent, k_rope

    def _start_position(self, x: torch.Tensor, cache: LatentCache | None) -> int:
        """Absolute position of x's first token, after checking that the cache fits."""
        start = 0
        if cache is not None:
            self._check_cache(cache, x)
            start = cache.position
        if start + x.shape[1] > self.context_length:
            where = f" at positions {start}..{start + x.shape[1] - 1}" if cache is not None else ""
            raise ValueError(
                f"x has {x.shape[1]} tokens{where}, more than context_length "
                f"({self.context_length})"
            )
        return start

    def _check_cache(self, cache: object, x: torch.Tensor) -> None:
        """The cache fits the call: its kind, widths, dtype, device, batch and room, causal
        self-attention, writable."""
        if not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache (make_cache), got {type(cache).__name__}")
        if not self.causal:
            raise ValueError("a cache is for causal attention: this module has causal=False")
        made_for = (cache.kv_lora_rank, cache.qk_rope_head_dim)
        if made_for != (self.kv_lora_rank, self.qk_rope_head_dim):
            raise ValueError(
                f"the cache was made for kv_lora_rank={made_for[0]}, qk_rope_head_dim="
                f"{made_for[1]}; this module has kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}"
            )
        if not cache.accepts(x.dtype) or not cache.is_on_device_of(x):
            raise TypeError(
                f"the cache is {cache.dtype} on {cache.device} but x is {x.dtype} on {x.device}"
                f" (a cache stores x's dtype, or a narrower one: bfloat16, float16)"
            )
        if cache.batch_size != x.shape[0]:
            raise ValueError(
                f"x has batch size {x.shape[0]} but the cache holds {cache.batch_size} sequences"
            )
        if cache.locked_by_inference_mode:
            raise ValueError(
                "the cache was made under torch.inference_mode(), whose tensors cannot be "
                "written outside it: decode under inference_mode too, or make the cache "
                "outside it"
            )
        if x.shape[1]:  # an empty x appends nothing
            cache.check_room(x.shape[1])

    def _parameter(self) -> torch.Tensor:
        """The parameter inputs must match in dtype and device: kv_a_proj_with_mqa's weight."""
        return self.kv_a_proj_with_mqa.weight


# the native step stands for every method MultiHeadLatentAttention defines: a subclass's
# override, a class-level patch or one set on the instance takes the Python path
_AS_DEFINED = _own_code.as_defined(MultiHeadLatentAttention)
_METHODS = frozenset(
    name for name, value in vars(MultiHeadLatentAttention).items() if callable(value)
)


def mscale_factor(rope_scaling: dict | None) -> float:
    """DeepSeek-V3's factor on the softmax scale under a scaled rotary: mscale(factor,
    mscale_all_dim)^2 when rope_scaling's type is not "default" and it gives a non-zero
    mscale_all_dim, else 1 (transformers' yarn_apply_mscale); mscale is YaRN's
    attnlab.rope_scaling.yarn_mscale, 0.1 m ln(s) + 1 for s > 1, else 1.

    Args:
        rope_scaling: a rotary scaling dict (as attnlab.rope_scaling.check_scaling gives
            it), or None.

    Returns:
        The factor.
    """
    if not rope_scaling or rope_scaling.get("rope_type", "default") == "default":
        return 1.0
    mscale_all_dim = rope_scaling.get("mscale_all_dim")
    if not mscale_all_dim:
        return 1.0
    return rope_scaling_.yarn_mscale(rope_scaling["factor"], mscale_all_dim) ** 2
