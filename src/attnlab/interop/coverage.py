"""Which installed transformers architectures attnlab runs right: each architecture is built
from a small config with random weights (nothing is downloaded), once with "eager" and once
with "attnlab" (same weights, each model from its own copy of the config), and compared on
what its head returns, by kind (KINDS, from transformers' auto mappings; an architecture with
several is compared as the first whose small model builds):

- text LMs ("causal", "seq2seq", "masked"): logits, a left-padded batch (real positions),
  greedy generation with the cache from that batch (not for masked LMs), output_attentions.
- "speech" (speech-to-text encoder-decoders, Whisper): input_features (b, mel bins,
  frames) with decoder ids: logits, a left-padded decoder batch, output_attentions
  (encoder, decoder, cross), greedy generation.
- "image" (image classification): pixel_values (b, channels, height, width): logits,
  every layer's hidden states, output_attentions.
- "image-text" (zero-shot image classification, CLIP and SigLIP: a composite config whose
  text and vision sub-configs are both shrunk): logits_per_image with the text and image
  embeddings, a left-padded text batch, each tower's output_attentions.

A row's status: "equal" (every comparison within TOLERANCE); "not called" (outputs equal,
but attnlab was never called: the model has no attention on transformers' interface, a
convolutional network say); "refused" (attnlab raised its own ValueError, at build or first
forward: the reason is the message); "differs" (a comparison out of tolerance, or the model
built with attnlab runs another attention implementation); "error" (attnlab raised anything
else, or the reference model does not run "eager"); "cannot build" (the small config, its
inputs or the eager model itself fail: not attnlab's to judge).

It is a tool, not a test helper: `scripts/hf_coverage.py` writes the table for the installed
transformers to docs/hf-coverage.md, and the test suite runs a slice of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections.abc import Iterator
from copy import deepcopy

import torch

from attnlab import functional
from attnlab.interop import hf

TOLERANCE = 1e-4
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 64, 4, 2, 16, 128
BATCH, TOKENS, NEW_TOKENS, DECODER_TOKENS = 3, 24, 5, 8
IMAGE, PATCH = 64, 8  # pixels a side; the largest patch side, so an image is 8 x 8 patches
SOURCE_POSITIONS, MEL_BINS = 32, 16  # a speech encoder's positions, its features' channels
EOS = 2  # image-text: each text ends with it (the towers pool there), clear of padding's 0

# config attribute -> small value, set where the architecture's config (or, for a composite
# config, each sub-config) has the attribute and it is not a list
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
    "image_size": IMAGE,
    "max_source_positions": SOURCE_POSITIONS,
    "max_target_positions": VOCAB,
    "num_mel_bins": MEL_BINS,
    "num_self_attends_per_block": LAYERS,  # Perceiver's latent blocks
    "d_latents": HIDDEN,
    "num_latents": 32,
}
CAPPED = {"patch_size": PATCH}  # config attribute -> the most it keeps, where it is an int

# kind -> (transformers' auto mapping of model types to that head, the auto class that builds
# it). An architecture in several mappings is tried in this order, up to the first kind whose
# small model builds: the most complete model first (Whisper's encoder-decoder, not its decoder
# alone; CLIP's two towers, not its image classifier; BERT's masked LM, its encoder's own
# task, not the LM head made a decoder).
KINDS = {
    "speech": ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
    "image-text": (
        "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForZeroShotImageClassification",
    ),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "masked": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "causal": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "image": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
}
COMPOSITE = ("image-text",)  # the kinds whose inputs fit a composite config's sub-models


@dataclasses.dataclass
class Row:
    """One architecture's result: status, a reason or detail, the largest difference, and
    the kind of head it was compared with (a key of KINDS)."""

    architecture: str
    status: str
    detail: str = ""
    max_diff: float | None = None
    kind: str = ""


def architectures() -> list[str]:
    """The installed transformers' model types that have a head of one of KINDS, sorted."""
    from transformers.models.auto import configuration_auto

    kinds = set().union(*(_mapping(kind) for kind in KINDS))
    return sorted(t for t in configuration_auto.CONFIG_MAPPING_NAMES if t in kinds)


def kinds_of(model_type: str) -> list[str]:
    """The kinds (keys of KINDS) whose auto mapping has `model_type`, in KINDS' order: the
    ones compare tries, the most complete model first.

    Args:
        model_type: a transformers model type.

    Returns:
        The kinds.

    Raises:
        ValueError: no mapping of KINDS has the model type.
    """
    kinds = [kind for kind in KINDS if model_type in _mapping(kind)]
    if not kinds:
        raise ValueError(
            f"model_type ({model_type!r}) has no head of the kinds compared ({', '.join(KINDS)})"
        )
    return kinds


def small_config(
    model_type: str, window: bool = True, composite: bool = False, patches: bool = True
):
    """The architecture's default config with SMALL's values where it has the attribute;
    layer_types, if any, cut to LAYERS keeping each kind once (sliding and full). A composite
    config (text_config, vision_config, ...) has each sub-config shrunk the same way.

    Args:
        model_type: a transformers model type.
        window: shrink a sliding window to SMALL's (else keep the default one).
        composite: shrink a composite config (else it cannot be built).
        patches: cap the patch size (CAPPED), else keep the default one.

    Returns:
        The small config.

    Raises:
        Exception: whatever the architecture's config raises for these values; a composite
            config when composite is False.
    """
    from transformers import AutoConfig, PreTrainedConfig

    default = AutoConfig.for_model(model_type)
    if default.sub_configs and not composite:
        raise _CannotBuildError(f"composite config ({', '.join(default.sub_configs)})")
    subs = {
        name: _small(sub.to_dict(), window, patches)
        for name in default.sub_configs
        if isinstance(sub := getattr(default, name, None), PreTrainedConfig)
    }
    changes = _small(default.to_dict(), window, patches)
    return AutoConfig.for_model(model_type, **changes, **subs)


def _small(present: dict, window: bool, patches: bool) -> dict:
    """The changes SMALL makes to a config's dict (`present`), for small_config."""
    changes = {k: v for k, v in SMALL.items() if k in present and not isinstance(present[k], list)}
    if patches:
        capped = CAPPED.items()
        changes |= {k: v for k, v in capped if isinstance(present.get(k), int) and present[k] > v}
    if present.get("sliding_window") is None or not window:
        changes.pop("sliding_window", None)
    if "kv_lora_rank" in present:  # multi-head latent attention: one key/value per head
        changes["num_key_value_heads"] = HEADS
    layer_types = present.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        kinds = list(dict.fromkeys(layer_types))[:LAYERS]
        changes["layer_types"] = (kinds * LAYERS)[:LAYERS]
    return changes


def compare(model_type: str, kind: str | None = None) -> Row:
    """Build `model_type` small with eager and with attnlab and compare them (see the module
    docstring for the kinds and statuses); never raises for a model's failure, it reports it.

    Args:
        model_type: a transformers model type ("gpt2", "llama", "vit", "clip", ...).
        kind: the kind of head to compare (a key of KINDS); None tries kinds_of(model_type)
            in turn, up to the first whose small model builds (Whisper's speech model, else
            its decoder as a causal LM).

    Returns:
        The architecture's Row: the first kind's "cannot build" when none builds.

    Raises:
        ValueError: model_type has no head of KINDS, or none of `kind`.
    """
    kinds = kinds_of(model_type)
    if kind is not None and kind not in kinds:
        raise ValueError(f"kind ({kind!r}) must be one of model_type {model_type!r}'s: {kinds}")
    rows = []
    for tried in [kind] if kind is not None else kinds:
        rows.append(_compare(model_type, tried))
        if rows[-1].status != "cannot build":
            return rows[-1]
    return rows[0]


def _compare(model_type: str, kind: str) -> Row:
    hf.register()
    try:
        config, eager, expected = _reference(model_type, kind)
    except _ImplementationError as error:
        return Row(model_type, "error", f"the reference {error}", kind=kind)
    except Exception as error:  # the architecture, not attnlab: reported, not raised
        return Row(model_type, "cannot build", _reason(error), kind=kind)
    try:
        ours = _build(kind, config, "attnlab")
        ours.load_state_dict(eager.state_dict())
        _check_implementation(ours, "attnlab")
        with _count_calls() as calls:
            got = _outputs(ours, kind)
    except _ImplementationError as error:
        return Row(model_type, "differs", f"the model {error}", kind=kind)
    except Exception as error:
        return _failure(model_type, kind, error)
    try:
        _check_implementation(eager, "eager")  # building ours left the reference as it was
    except _ImplementationError as error:
        return Row(model_type, "error", f"the reference {error}", kind=kind)
    try:
        diffs = {name: _difference(got[name], expected[name]) for name in expected}
    except _MismatchError as error:
        return Row(model_type, "differs", str(error), kind=kind)
    worst = max(diffs.values())
    if worst > TOLERANCE:
        detail = ", ".join(f"{k} {v:.2g}" for k, v in diffs.items() if v > TOLERANCE)
        return Row(model_type, "differs", detail, worst, kind)
    if not calls:  # equal, but attnlab did nothing: the model has no softmax attention
        return Row(model_type, "not called", "no attention on transformers' interface", worst, kind)
    return Row(model_type, "equal", "", worst, kind)


def table(rows: list[Row]) -> str:
    """A markdown table of `rows`: architecture, kind, status (with its reason), max
    difference."""
    lines = ["| architecture | kind | status | max difference |", "|---|---|---|---|"]
    for row in rows:
        status = row.status + (f" ({_cell(row.detail)})" if row.detail else "")
        diff = "" if row.max_diff is None else f"{row.max_diff:.1e}"
        lines.append(f"| {row.architecture} | {row.kind} | {status} | {diff} |")
    return "\n".join(lines) + "\n"


def _mapping(kind: str) -> dict:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, KINDS[kind][0])


# small_config's variants, tried in turn until the eager model builds and runs: fully small;
# with the default sliding window (where a small one breaks the eager path); with the default
# patch size (where the stem's strides are fixed: LeViT)
VARIANTS = ({}, {"window": False}, {"patches": False})


def _reference(model_type: str, kind: str):
    """The small config, the eager model and its outputs, from the first of VARIANTS that
    builds (a variant that changes nothing is skipped); the last one's exception when none
    does."""
    tried, failure = [], None
    for variant in VARIANTS:
        try:
            config = small_config(model_type, composite=kind in COMPOSITE, **variant)
            if config.to_dict() in tried:
                continue
            tried.append(config.to_dict())
            return config, *_eager(model_type, kind, config)
        except _ImplementationError:
            raise
        except Exception as error:
            failure = error
    raise failure


def _eager(model_type: str, kind: str, config):
    """The eager model of the kind from `config` (made ready for the kind's inputs), and its
    outputs."""
    text = getattr(config, "text_config", None)
    if kind == "image-text" and text is not None:
        text.eos_token_id = EOS  # not padding's id: the text tower pools a real token
    classes = _mapping(kind)[model_type]
    if isinstance(classes, (tuple, list)) and not config.architectures:
        config.architectures = [classes[0]]  # from_config picks among several by it
    torch.manual_seed(0)
    eager = _build(kind, config, "eager")
    _check_implementation(eager, "eager")
    return eager, _outputs(eager, kind)


def _build(kind: str, config, implementation: str):
    """The kind's model from a copy of `config` (from_config writes the implementation into
    the config it is given), in eval mode."""
    import transformers

    auto = getattr(transformers, KINDS[kind][1])
    return auto.from_config(deepcopy(config), attn_implementation=implementation).eval()


def _check_implementation(model, asked: str) -> None:
    """Raise _ImplementationError naming each config of `model` (its own, its sub-configs',
    its modules') whose attention implementation is not `asked`."""
    wrong = sorted(
        f"{type(config).__name__}: {config._attn_implementation!r}"
        for config in _configs(model)
        if config._attn_implementation != asked
    )
    if wrong:
        raise _ImplementationError(
            f"built with attn_implementation={asked!r} runs {', '.join(wrong)}"
        )


def _configs(model) -> list:
    """Every config object `model`'s modules hold, and their sub-configs."""
    from transformers import PreTrainedConfig

    found, stack = {}, [getattr(module, "config", None) for module in model.modules()]
    while stack:
        config = stack.pop()
        if isinstance(config, PreTrainedConfig) and id(config) not in found:
            found[id(config)] = config
            stack += [getattr(config, name, None) for name in config.sub_configs]
    return list(found.values())


class _CannotBuildError(Exception):
    pass


class _ImplementationError(Exception):
    pass


def _outputs(model, kind: str) -> dict:
    """What is compared for the kind, by comparison name (see the module docstring)."""
    with torch.no_grad():
        if kind == "speech":
            return _speech_outputs(model)
        if kind == "image":
            return _image_outputs(model)
        if kind == "image-text":
            return _image_text_outputs(model)
        return _text_outputs(model, kind)


def _text_outputs(model, kind: str) -> dict:
    """Logits (no mask), logits on the real positions of a left-padded batch, attention
    weights (real query rows), greedy generation (not for a masked LM)."""
    ids, mask = _left_padded(model.config)
    seq2seq = kind == "seq2seq"
    extra = {"decoder_input_ids": ids[:, :DECODER_TOKENS]} if seq2seq else {}
    real = torch.ones(BATCH, DECODER_TOKENS, dtype=torch.bool) if seq2seq else mask.bool()
    outputs = {
        "logits": model(ids, **extra).logits,
        "left padding": model(ids, attention_mask=mask, **extra).logits[real],
    }
    recorded = model(ids, attention_mask=mask, output_attentions=True, **extra)
    rows = mask.bool()[:, None, :, None]  # (b, 1, tq, 1): the real query rows
    if seq2seq:
        names = {"encoder_attentions": rows, "decoder_attentions": None, "cross_attentions": None}
    else:
        names = {"attentions": rows}
    outputs |= {name: _weights(recorded, name, real) for name, real in names.items()}
    if kind != "masked":
        outputs["generate"] = _generate(model, input_ids=ids, attention_mask=mask)
    return outputs


def _speech_outputs(model) -> dict:
    """Logits for input_features and decoder ids; logits on the real positions of a
    left-padded decoder batch; encoder, decoder (real query rows) and cross-attention
    weights; greedy generation from the features."""
    features = {model.main_input_name: _features(model.config)}
    ids, mask = _left_padded(model.config, DECODER_TOKENS)
    padded = dict(features, decoder_input_ids=ids, decoder_attention_mask=mask)
    outputs = {
        "logits": model(**features, decoder_input_ids=ids).logits,
        "decoder padding": model(**padded).logits[mask.bool()],
    }
    recorded = model(**padded, output_attentions=True)
    rows = mask.bool()[:, None, :, None]  # (b, 1, tq, 1): the real decoder query rows
    names = {"encoder_attentions": None, "decoder_attentions": rows, "cross_attentions": rows}
    outputs |= {name: _weights(recorded, name, real) for name, real in names.items()}
    outputs["generate"] = _generate(model, **features)
    return outputs


def _image_outputs(model) -> dict:
    """Logits for pixel_values, every layer's hidden states and attention weights."""
    pixels = _pixels(model.config)
    outputs = {"logits": model(pixel_values=pixels).logits}
    recorded = model(pixel_values=pixels, output_hidden_states=True, output_attentions=True)
    outputs["hidden states"] = _listed(getattr(recorded, "hidden_states", None))
    outputs["attentions"] = _weights(recorded, "attentions", None)
    return outputs


def _image_text_outputs(model) -> dict:
    """logits_per_image with the text and image embeddings; the same for a left-padded text
    batch (each text ends with EOS); each tower's attention weights (the text's on its real
    query rows)."""
    config = model.config
    ids, mask = _left_padded(config.text_config)
    ids[:, -1] = EOS
    inputs = {"input_ids": ids, "pixel_values": _pixels(config.vision_config)}
    plain = model(**inputs)
    padded = model(**inputs, attention_mask=mask)
    outputs = {
        "logits": [plain.logits_per_image, plain.text_embeds, plain.image_embeds],
        "left padding": [padded.logits_per_image, padded.text_embeds],
    }
    recorded = model(**inputs, attention_mask=mask, output_attentions=True)
    rows = mask.bool()[:, None, :, None]  # (b, 1, tq, 1): the real text query rows
    for tower, real in (("text", rows), ("vision", None)):
        output = getattr(recorded, f"{tower}_model_output", None)
        outputs[f"{tower} attentions"] = _weights(output, "attentions", real)
    return outputs


def _weights(output, name: str, rows: torch.Tensor | None) -> list | None:
    """The attention weights `output` records under `name`, each layer's with the query rows
    outside `rows` zeroed (what a padding query holds is unspecified); None when absent."""
    layers = getattr(output, name, None)
    return None if layers is None else [_rows(weights, rows) for weights in layers]


def _rows(weights: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """Attention weights with padding query rows zeroed (what they hold is unspecified)."""
    if weights is None or rows is None or weights.dim() != 4:
        return weights
    return weights.masked_fill(~rows, 0)  # (b, h, tq, tk)


def _listed(tensors) -> list | None:
    return None if tensors is None else list(tensors)


def _generate(model, **inputs) -> list[torch.Tensor]:
    """Greedy generation from `inputs` (ids and mask, or speech features) with the model's
    cache: the sequences, then each step's scores."""
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1, pad_token_id=0)
    options |= dict(output_scores=True, return_dict_in_generate=True)
    if model.config.is_encoder_decoder:
        options["decoder_start_token_id"] = 1  # some configs (T5's) leave it to the checkpoint
    result = model.generate(**inputs, **options)
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


def _left_padded(config, tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (BATCH, tokens) from 3 up (clear of the special ids) and a left-padding
    mask: row 1 loses 5/24 of its tokens, row 2 15/24 (5 and 15 of TOKENS)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (BATCH, tokens), generator=generator)
    mask = torch.ones(BATCH, tokens, dtype=torch.long)
    mask[1, : tokens * 5 // 24], mask[2, : tokens * 15 // 24] = 0, 0
    return ids.masked_fill(mask == 0, 0), mask


def _features(config) -> torch.Tensor:
    """Speech features (BATCH, num_mel_bins, frames): the frames the encoder's two-fold
    convolution brings to its max_source_positions (the length Whisper requires)."""
    generator = torch.Generator().manual_seed(2)
    shape = (BATCH, config.num_mel_bins, 2 * config.max_source_positions)
    return torch.randn(shape, generator=generator)


def _pixels(config) -> torch.Tensor:
    """pixel_values (BATCH, num_channels, height, width) at the config's image_size (IMAGE
    where it names none)."""
    size = getattr(config, "image_size", None) or IMAGE
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    generator = torch.Generator().manual_seed(3)
    channels = getattr(config, "num_channels", None) or 3
    return torch.randn(BATCH, channels, height, width, generator=generator)


class _MismatchError(Exception):
    pass


def _failure(model_type: str, kind: str, error: Exception) -> Row:
    """attnlab's own ValueError (raised in interop/hf.py) is a refusal; anything else an
    error."""
    frames = traceback.extract_tb(error.__traceback__)
    if isinstance(error, ValueError) and frames and frames[-1].filename.endswith("hf.py"):
        return Row(model_type, "refused", _reason(error), kind=kind)
    return Row(model_type, "error", _reason(error), kind=kind)


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
