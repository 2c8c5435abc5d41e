"""Which installed transformers architectures attnlab runs right: each text architecture is
built from a small config with random weights (nothing is downloaded), once with "eager"
and once with "attnlab" (same weights), and compared on logits, a left-padded batch, greedy
generation with the cache from a left-padded batch, and output_attentions.

A row's status: "equal" (every comparison within TOLERANCE), "refused" (attnlab raised its
own ValueError, at build or first forward: the reason is the message), "differs" (a
comparison out of tolerance, or attnlab never called: the model bypassed the interface
unnoticed), "error" (attnlab raised anything else), or "cannot build" (the small config or
the eager model itself fails: not attnlab's to judge).

It is a tool, not a test helper: `scripts/hf_coverage.py` writes the table for the installed
transformers to docs/hf-coverage.md, and the test suite runs a slice of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections.abc import Iterator

import torch

from attnlab import functional
from attnlab.interop import hf

TOLERANCE = 1e-4
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 64, 4, 2, 16, 128
BATCH, TOKENS, NEW_TOKENS = 3, 24, 5

# config attribute -> small value, set where the architecture's config has the attribute
SMALL = {
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers"), LAYERS
    ),
    **dict.fromkeys(("encoder_layers", "decoder_layers"), LAYERS),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), HEADS),
    **dict.fromkeys(("encoder_attention_heads", "decoder_attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "attention_head_size"), HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "n_inner", "hidden_dim"), 128),
    **dict.fromkeys(("encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size"), 128),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "top_k", "moe_topk"), 2),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), 32),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), HEAD_DIM),
    **dict.fromkeys(("vocab_size", "max_position_embeddings", "n_positions"), VOCAB),
    **dict.fromkeys(("bos_token_id", "decoder_start_token_id"), 1),
    **dict.fromkeys(("eos_token_id", "pad_token_id"), 0),
    "sliding_window": 16,  # within TOKENS, so the window masks something
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "rotary_dim": 8,
    "partial_rotary_factor": 0.5,
}


@dataclasses.dataclass
class Row:
    """One architecture's result: status, a reason or detail, the largest difference."""

    architecture: str
    status: str
    detail: str = ""
    max_diff: float | None = None


def architectures() -> list[str]:
    """The installed transformers' model types that have a causal, seq2seq or masked LM
    head (text models a small config can build), sorted."""
    from transformers.models.auto import configuration_auto, modeling_auto

    heads = (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )
    kinds = set().union(*heads)
    return sorted(t for t in configuration_auto.CONFIG_MAPPING_NAMES if t in kinds)


def small_config(model_type: str, window: bool = True):
    """The architecture's default config with SMALL's values where it has the attribute;
    layer_types, if any, cut to LAYERS keeping each kind once (sliding and full).

    Args:
        model_type: a transformers model type.
        window: shrink a sliding window to SMALL's (else keep the default one).

    Returns:
        The small config.

    Raises:
        Exception: whatever the architecture's config raises for these values.
    """
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    if default.sub_configs:
        raise _CannotBuildError(f"composite config ({', '.join(default.sub_configs)})")
    present = default.to_dict()
    changes = {k: v for k, v in SMALL.items() if k in present and not isinstance(present[k], list)}
    if present.get("sliding_window") is None or not window:
        changes.pop("sliding_window", None)
    if "kv_lora_rank" in present:  # multi-head latent attention: one key/value per head
        changes["num_key_value_heads"] = HEADS
    layer_types = present.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        kinds = list(dict.fromkeys(layer_types))[:LAYERS]
        changes["layer_types"] = (kinds * LAYERS)[:LAYERS]
    return AutoConfig.for_model(model_type, **changes)


def compare(model_type: str) -> Row:
    """Build `model_type` small with eager and with attnlab and compare them (see the module
    docstring for the statuses); never raises for a model's failure, it reports it.

    Args:
        model_type: a transformers model type ("gpt2", "llama", ...).

    Returns:
        The architecture's Row.
    """
    hf.register()
    try:
        config, eager, expected = _reference(model_type)
    except Exception as error:  # the architecture, not attnlab: reported, not raised
        return Row(model_type, "cannot build", _reason(error))
    head = _head(model_type)
    try:
        ours = head.from_config(config, attn_implementation="attnlab").eval()
        ours.load_state_dict(eager.state_dict())
        with _count_calls() as calls:
            got = _outputs(ours)
    except Exception as error:
        return _failure(model_type, error)
    try:
        diffs = {name: _difference(got[name], expected[name]) for name in expected}
    except _MismatchError as error:
        return Row(model_type, "differs", str(error))
    worst = max(diffs.values())
    if worst > TOLERANCE:
        detail = ", ".join(f"{k} {v:.2g}" for k, v in diffs.items() if v > TOLERANCE)
        return Row(model_type, "differs", detail, worst)
    if not calls:  # equal, but attnlab did nothing: the model has no softmax attention
        return Row(model_type, "equal", "attnlab never called: no softmax attention", worst)
    return Row(model_type, "equal", "", worst)


def table(rows: list[Row]) -> str:
    """A markdown table of `rows`: architecture, status (with its reason), max difference."""
    lines = ["| architecture | status | max difference |", "|---|---|---|"]
    for row in rows:
        status = row.status + (f" ({_cell(row.detail)})" if row.detail else "")
        diff = "" if row.max_diff is None else f"{row.max_diff:.1e}"
        lines.append(f"| {row.architecture} | {status} | {diff} |")
    return "\n".join(lines) + "\n"


def _reference(model_type: str):
    """The small config, the eager model and its outputs; with the default sliding window
    when the architecture's eager path fails with a small one."""
    try:
        return _eager(model_type, window=True)
    except Exception:
        return _eager(model_type, window=False)


def _eager(model_type: str, window: bool):
    config = small_config(model_type, window)
    torch.manual_seed(0)
    eager = _head(model_type).from_config(config, attn_implementation="eager").eval()
    return config, eager, _outputs(eager)


class _CannotBuildError(Exception):
    pass


def _head(model_type: str):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM
    from transformers.models.auto import modeling_auto

    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if model_type in modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForSeq2SeqLM
    return AutoModelForMaskedLM


def _outputs(model) -> dict:
    """What is compared, per comparison: logits (no mask), logits on the real positions of
    a left-padded batch, attention weights (real query rows), greedy generation."""
    ids, mask = _left_padded(model.config)
    kind = _kind(model)
    extra = {"decoder_input_ids": ids[:, :8]} if kind == "seq2seq" else {}
    real = mask.bool() if kind != "seq2seq" else torch.ones(BATCH, 8, dtype=torch.bool)
    outputs = {}
    with torch.no_grad():
        outputs["logits"] = model(ids, **extra).logits
        outputs["left padding"] = model(ids, attention_mask=mask, **extra).logits[real]
        recorded = model(ids, attention_mask=mask, output_attentions=True, **extra)
    names = ("encoder_attentions", "decoder_attentions", "cross_attentions")
    for name in names if kind == "seq2seq" else ("attentions",):
        layers = getattr(recorded, name, None)
        rows = (
            mask.bool()[:, None, :, None] if name in ("attentions", "encoder_attentions") else None
        )
        outputs[name] = None if layers is None else [_rows(t, rows) for t in layers]
    if kind != "masked":
        outputs["generate"] = _generate(model, ids, mask)
    return outputs


def _rows(weights: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """Attention weights with padding query rows zeroed (what they hold is unspecified)."""
    if weights is None or rows is None or weights.dim() != 4:
        return weights
    return weights.masked_fill(~rows, 0)  # (b, h, tq, tk)


def _generate(model, ids, mask) -> list[torch.Tensor]:
    """Greedy generation from the left-padded batch with the model's cache: the sequences,
    then each step's scores."""
    options = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)
    options |= dict(output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    if model.config.is_encoder_decoder:
        options["decoder_start_token_id"] = 1  # some configs (T5's) leave it to the checkpoint
    result = model.generate(ids, **options)
    return [result.sequences, *result.scores]


def _difference(got, expected) -> float:
    """The largest absolute difference of two outputs (tensors, lists of them, None);
    different generated tokens are an infinite difference."""
    if got is None and expected is None:
        return 0.0
    if isinstance(expected, list) and isinstance(got, list):
        if len(got) != len(expected):
            raise _MismatchError(f"{len(got)} outputs, eager {len(expected)}")
        return max((_difference(a, b) for a, b in zip(got, expected, strict=True)), default=0.0)
    if not isinstance(got, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise _MismatchError(f"{type(got).__name__}, eager {type(expected).__name__}")
    if got.shape != expected.shape:
        raise _MismatchError(f"shape {tuple(got.shape)}, eager {tuple(expected.shape)}")
    if not got.is_floating_point():  # generated token ids
        return 0.0 if torch.equal(got, expected) else float("inf")
    return (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0


def _kind(model) -> str:
    if model.config.is_encoder_decoder:
        return "seq2seq"
    return "causal" if hasattr(model, "generate") and model.can_generate() else "masked"


def _left_padded(config) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (BATCH, TOKENS) from 3 up (clear of the special ids) and a left-padding
    mask: row 1 loses 5 tokens, row 2 loses 15."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (BATCH, TOKENS), generator=generator)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[1, :5], mask[2, :15] = 0, 0
    return ids.masked_fill(mask == 0, 0), mask


class _MismatchError(Exception):
    pass


def _failure(model_type: str, error: Exception) -> Row:
    """attnlab's own ValueError (raised in interop/hf.py) is a refusal; anything else an
    error."""
    frames = traceback.extract_tb(error.__traceback__)
    if isinstance(error, ValueError) and frames and frames[-1].filename.endswith("hf.py"):
        return Row(model_type, "refused", _reason(error))
    return Row(model_type, "error", _reason(error))


@contextlib.contextmanager
def _count_calls() -> Iterator[list]:
    """Record each call interop.hf makes to attnlab.functional.attention."""
    calls, original = [], functional.attention

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    functional.attention = counting
    try:
        yield calls
    finally:
        functional.attention = original


def _reason(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:300]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
