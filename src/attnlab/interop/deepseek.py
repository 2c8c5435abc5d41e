"""DeepSeek-V3's attention in transformers (DeepseekV3Attention) and attnlab's
MultiHeadLatentAttention, converted both ways with the same outputs. transformers is not
imported: a layer is recognised by its parts.

The projections keep their names and shapes. One layout differs: with the config's
rope_interleave (DeepSeek-V3's default), the layer reads each rotary query and key as
interleaved pairs (x0, x1), (x2, x3), ... and rotates them into the "rotate half" layout;
attnlab rotates halves (feature i with i + dr/2) of the projections' output. The two agree
once the rotary rows of q_proj (or q_b_proj), per head, and of kv_a_proj_with_mqa are
de-interleaved: rows 0, 2, 4, ... then 1, 3, 5, ... That permutation is applied on the way
in and undone on the way out, so scores, cache and outputs are the same.

Shapes: the layer's weights are (out, in) as nn.Linear stores them: q rows head by head,
each [nope (qk_nope_head_dim), rope (qk_rope_head_dim)]; kv_a_proj_with_mqa rows [latent
(kv_lora_rank), rope (qk_rope_head_dim)]; kv_b_proj rows head by head, each [key nope
(qk_nope_head_dim), value (v_head_dim)].
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import rope_scaling
from attnlab.interop.hf import _rope_theta
from attnlab.mla import MultiHeadLatentAttention

_PARTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", "config")
_LORA_PARTS = ("q_a_proj", "q_a_layernorm", "q_b_proj")


def from_deepseek_v3_attention(
    layer: nn.Module, *, context_length: int | None = None
) -> MultiHeadLatentAttention:
    """attnlab's MultiHeadLatentAttention with the weights of a DeepseekV3Attention, giving
    the same outputs for the rotary tables the model's DeepseekV3RotaryEmbedding makes.

    Args:
        layer: a transformers DeepseekV3Attention (q_proj, or q_a_proj, q_a_layernorm and
            q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; a config).
        context_length: the longest input; default the config's max_position_embeddings.

    Returns:
        A causal MultiHeadLatentAttention on the layer's device and dtype.

    Raises:
        TypeError: layer is not such a layer.
        ValueError: a configuration attnlab does not compute (fewer key/value heads than
            query heads, norms of two epsilons, a rotary scaling attnlab.rope_scaling lacks).
    """
    settings = _layer_settings(layer)
    weight = layer.kv_a_proj_with_mqa.weight
    module = MultiHeadLatentAttention(
        **settings,
        context_length=context_length or layer.config.max_position_embeddings,
        device=weight.device,
        dtype=weight.dtype,
    )
    _copy(layer, module, module, to_layer=False)
    return module


def to_deepseek_v3_attention(module: MultiHeadLatentAttention, layer: nn.Module) -> nn.Module:
    """Copy `module`'s weights into a DeepseekV3Attention `layer`.

    Args:
        module: a MultiHeadLatentAttention of the layer's configuration: its sizes, biases
            (down_bias and out_bias both the config's attention_bias), latent norms of the
            layer's epsilon, rope base and scaling, dropout.
        layer: as for from_deepseek_v3_attention, changed in place.

    Returns:
        `layer`.

    Raises:
        TypeError: module or layer is not of the kind named.
        ValueError: module does not fit the layer (the message names each difference).
    """
    if not isinstance(module, MultiHeadLatentAttention):
        raise TypeError(
            f"module must be an attnlab.MultiHeadLatentAttention, got {type(module).__name__}"
        )
    settings = _layer_settings(layer)
    differences = [
        f"{key} {module.config[key]!r} (layer: {value!r})"
        for key, value in settings.items()
        if module.config[key] != value
    ]
    if differences:
        raise ValueError(
            f"the module does not fit this {type(layer).__name__}: " + ", ".join(differences)
        )
    _copy(module, layer, module, to_layer=True)
    return layer


def is_deepseek_v3_attention(layer: object) -> bool:
    """Whether `layer` has a DeepseekV3Attention's parts (what swap_attention converts)."""
    if not isinstance(layer, nn.Module):
        return False
    lora = getattr(layer, "q_lora_rank", None) is not None
    parts = _PARTS + (_LORA_PARTS if lora else ("q_proj",))
    return all(getattr(layer, name, None) is not None for name in parts)


def _copy(
    source: nn.Module, target: nn.Module, module: MultiHeadLatentAttention, *, to_layer: bool
) -> None:
    """Every projection's weight and bias and the norms' weights from `source` into `target`
    (one of them `module`, the other the layer), the rotary rows (de-)interleaved as the
    layer's config reads them."""
    layer = target if to_layer else source
    interleaved = bool(getattr(layer.config, "rope_interleave", False))
    targets = _projections(target)
    with torch.no_grad():
        for name, projection in _projections(source).items():
            for kind in ("weight", "bias"):
                rows = getattr(projection, kind)
                if rows is not None:
                    rows = _rotary_rows(module, name, rows, interleaved, to_layer)
                    getattr(targets[name], kind).copy_(rows)
        for name in _norms(module):
            getattr(target, name).weight.copy_(getattr(source, name).weight)


def _layer_settings(layer: object) -> dict:
    """The MultiHeadLatentAttention arguments (context_length aside) a DeepseekV3Attention's
    computation corresponds to, checked."""
    lora = getattr(layer, "q_lora_rank", None) is not None
    parts = _PARTS + (_LORA_PARTS if lora else ("q_proj",))
    missing = [name for name in parts if getattr(layer, name, None) is None]
    if missing or not isinstance(layer, nn.Module):
        raise TypeError(
            f"layer must be a transformers DeepseekV3Attention (q_proj or q_a_proj, "
            f"q_a_layernorm and q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, "
            f"o_proj; a config), got {type(layer).__name__}"
            + (f" without {', '.join(missing)}" if missing else "")
        )
    config = layer.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads != heads:
        raise ValueError(
            f"num_key_value_heads ({kv_heads}) != num_attention_heads ({heads}): MLA expands "
            f"one key and value per query head from the latent"
        )
    norms = [layer.kv_a_layernorm] + ([layer.q_a_layernorm] if lora else [])
    epsilons = {float(getattr(n, "variance_epsilon", getattr(n, "eps", 1e-6))) for n in norms}
    if len(epsilons) != 1:
        raise ValueError(f"the layer's norms have two epsilons {sorted(epsilons)}: not supported")
    bias = bool(getattr(config, "attention_bias", False))
    return {
        "d_model": config.hidden_size,
        "num_heads": heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "dropout": float(getattr(config, "attention_dropout", 0.0) or 0.0),
        "down_bias": bias,
        "out_bias": bias,
        "latent_norm": True,
        "norm_eps": epsilons.pop(),
        "rope_base": float(_rope_theta(config)),
        "rope_scaling": _rope_scaling(config),
    }


def _rope_scaling(config) -> dict | None:
    """The config's rotary scaling (rope_parameters, or rope_scaling in older configs) as
    attnlab.rope_scaling.check_scaling gives it: None for the default rotary."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return rope_scaling.check_scaling(parameters, "the config's rope_parameters")


def _projections(owner: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers by name, the query path the owner has."""
    names = ("q_proj",) if getattr(owner, "q_lora_rank", None) is None else ("q_a_proj", "q_b_proj")
    names += ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    return {name: getattr(owner, name) for name in names}


def _norms(module: MultiHeadLatentAttention) -> tuple[str, ...]:
    return (
        ("kv_a_layernorm",) if module.q_lora_rank is None else ("kv_a_layernorm", "q_a_layernorm")
    )


def _rotary_rows(
    module: MultiHeadLatentAttention,
    name: str,
    rows: torch.Tensor,
    interleaved: bool,
    to_layer: bool,
) -> torch.Tensor:
    """`rows` (a weight (out, in) or a bias (out,)) of projection `name` with its rotary rows
    de-interleaved (to_layer False: the layer's pairs to attnlab's halves) or interleaved
    back (to_layer True); other projections and rows as they are."""
    dr = module.qk_rope_head_dim
    if not interleaved or dr == 0 or name not in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa"):
        return rows
    order = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)]).to(rows.device)
    if to_layer:
        order = torch.argsort(order)  # the inverse permutation
    if name == "kv_a_proj_with_mqa":  # [latent (r), rope (dr)]
        latent = rows.narrow(0, 0, module.kv_lora_rank)
        rope = rows.narrow(0, module.kv_lora_rank, dr).index_select(0, order)
        return torch.cat([latent, rope])
    per_head = rows.view(module.num_heads, module.qk_head_dim, *rows.shape[1:])  # (h, dn + dr, ..)
    nope = per_head.narrow(1, 0, module.qk_nope_head_dim)
    rope = per_head.narrow(1, module.qk_nope_head_dim, dr).index_select(1, order)
    return torch.cat([nope, rope], dim=1).reshape(rows.shape)  # (h (dn + dr), ..)
