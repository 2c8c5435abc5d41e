"""Attention maps of a Hugging Face transformers model (`output_attentions=True`).

Decoder-only and encoder-only models give one group (self-attention); encoder-decoder
models give three: the encoder's self-attention, the decoder's (causal) self-attention and
its cross-attention to the encoder. The model runs with the eager attention implementation
(SDPA returns no weights), in eval mode, under torch.no_grad; its implementation and
training flags are restored afterwards.

Masked cells: keys whose attention_mask is 0 (padding), and above the diagonal in causal
self-attention. A single-stack model is causal where its configuration says it decodes
(`is_decoder`, or a model type that has a causal-LM class and no masked-LM class), unless
`causal` says otherwise; a claimed causal map with weight above the diagonal is not drawn as
causal, and the page says so.

Shapes: attentions (batch, heads, queries, keys) per layer; the first sequence is shown.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from attnlab.explore.data import Group


def is_hf_model(model: object) -> bool:
    """Whether `model` is a transformers PreTrainedModel (without importing transformers)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for cls in type(model).__mro__
    )


class ModelNotFoundError(ValueError, OSError):
    """A model's name or path that names no model here: neither an existing path nor a
    model in the local Hugging Face cache (nothing is downloaded: offline, the hub's
    client would retry for half a minute before saying so). A ValueError, as attnlab's
    argument errors are, and an OSError, as transformers' "no such model" is.

    Attributes:
        name: the name or path given.
        reason: what is wrong with it, and what to do.
    """

    def __init__(self, argument: str, name: str, reason: str) -> None:
        self.name, self.reason = name, reason
        super().__init__(f"{argument} {name!r} {reason}")


def load(name: str, argument: str = "source") -> tuple[nn.Module, object | None]:
    """A model (AutoModel) and its tokenizer (None if it has none) from a local path or a
    model already in the local Hugging Face cache; the hub is never asked.

    Args:
        name: a folder written by save_pretrained, or a hub name such as "gpt2" that was
            downloaded before.
        argument: the argument's name in messages.

    Raises:
        ImportError: transformers is not installed.
        ModelNotFoundError: `name` is neither an existing path nor a cached model, or a
            path transformers loads no model from (a ValueError and an OSError).
    """
    try:
        from transformers import AutoModel, AutoTokenizer
    except ModuleNotFoundError as error:
        raise ImportError(
            f"a model by name ({name!r}) needs transformers: pip install 'attnlab[hf]'"
        ) from error

    path = os.path.expanduser(name)  # "~/model": transformers takes it as a hub name
    is_path = os.path.exists(path)
    source = path if is_path else name
    try:
        model = AutoModel.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        # TypeError and the like: a folder whose config.json is not a config (null, a list)
        raise ModelNotFoundError(argument, name, _not_loaded(name, is_path, error)) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, KeyError):
        tokenizer = None
    return model, tokenizer if _has_vocabulary(tokenizer) else None


def _not_loaded(name: str, is_path: bool, error: Exception) -> str:
    """Why `name` loaded no model, for ModelNotFoundError."""
    if is_path:
        first = " ".join(str(error).split())[:300]
        return f"is a path, but transformers loads no model from it: {first}"
    return (
        "is neither an existing path nor a model in the local Hugging Face cache (the hub "
        f"is not asked): check the path, or download the model first (`hf download {name}`,"
        " or AutoModel.from_pretrained with a network) and pass its name, its folder or "
        "the loaded model"
    )


def _has_vocabulary(tokenizer: object | None) -> bool:
    """Whether a loaded tokenizer holds words beyond its special tokens: transformers 5.24
    returns an empty one (GPT-2's: one token) for a folder without tokenizer files."""
    try:
        return len(tokenizer) > len(set(tokenizer.all_special_tokens))
    except (TypeError, AttributeError):
        return tokenizer is not None


def encode(
    inputs: object, tokenizer: object | None, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (1, t), attention_mask (1, t)) from a text, ids or a tokenizer's output.

    Raises:
        TypeError: an input of another kind.
        ValueError: a text without a tokenizer, a batch of several sequences, no token.
    """
    mask = None
    if isinstance(inputs, str):
        if tokenizer is None:
            raise ValueError(f"{name} is a text: give tokenizer= to turn it into token ids")
        inputs = tokenizer(inputs, return_tensors="pt")
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            raise ValueError(f"{name} must hold 'input_ids', got keys {sorted(inputs)}")
        mask = inputs.get("attention_mask")
        inputs = inputs["input_ids"]
    if isinstance(inputs, Sequence) and all(isinstance(i, int) for i in inputs):
        inputs = torch.tensor(inputs)
    if not isinstance(inputs, torch.Tensor) or inputs.is_floating_point():
        raise TypeError(
            f"{name} must be a text, token ids (a list or an integer tensor) or a tokenizer's "
            f"output, got {type(inputs).__name__}"
        )
    ids = inputs.reshape(1, -1) if inputs.dim() == 1 else inputs
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(
            f"{name} must be one sequence of token ids, got shape {tuple(inputs.shape)}"
        )
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask).reshape(ids.shape)
    return ids.long(), mask.long()


def labels(ids: torch.Tensor, tokenizer: object | None) -> tuple[str, ...]:
    """Each token's text as the tokenizer decodes it alone (" journey", not "Ġjourney"), its
    vocabulary entry where that is blank, or its id without a tokenizer."""
    row = ids[0].tolist()
    if tokenizer is None:
        return tuple(str(i) for i in row)
    pieces = tokenizer.convert_ids_to_tokens(row)
    texts = [tokenizer.decode([i]) for i in row]
    return tuple(t if t.strip() else str(p) for t, p in zip(texts, pieces, strict=True))


def decoder_ids(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's input by default: the start token, then the input's tokens but the last
    (the teacher-forced decoder input that reproduces the input text)."""
    start = model.config.decoder_start_token_id
    start = model.config.pad_token_id if start is None else start
    if start is None:
        raise ValueError("the model's config has no decoder_start_token_id: give decoder_inputs=")
    return torch.cat([torch.tensor([[start]]), ids[:, :-1]], dim=1)  # (1, t)


def is_causal(model: nn.Module) -> bool:
    """Whether a single-stack model's self-attention is causal, from its configuration."""
    config = model.config
    if getattr(config, "is_decoder", False):
        return True
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", None)
    return (
        model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )


def capture(
    model: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    tokens: tuple[str, ...],
    decoder: tuple[torch.Tensor, tuple[str, ...]] | None,
    causal: bool | None,
) -> tuple[tuple[Group, ...], list[str]]:
    """Run the model and turn its attentions into groups.

    Args:
        model: a transformers PreTrainedModel.
        ids: (1, t) input ids.
        mask: (1, t) attention_mask, 0 at padding.
        tokens: the input tokens' labels.
        decoder: (decoder ids (1, td), their labels) for an encoder-decoder model.
        causal: whether a single-stack model is causal (None: from its configuration).

    Returns:
        The groups, and notes for the page.
    """
    device = next(model.parameters()).device
    kwargs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    if decoder is not None:
        kwargs["decoder_input_ids"] = decoder[0].to(device)
    with _eager(model), torch.no_grad():
        out = model(**kwargs, output_attentions=True, return_dict=True)
    keys_allowed = mask[0].bool()  # (t,) False at padding
    notes: list[str] = []
    if decoder is None:
        causal = is_causal(model) if causal is None else causal
        group = _group(
            "self-attention", out.attentions, tokens, tokens, keys_allowed, causal, notes
        )
        return (group,), notes
    dec_tokens = decoder[1]
    every = torch.ones(len(dec_tokens), dtype=torch.bool)
    return (
        _group(
            "encoder self-attention",
            out.encoder_attentions,
            tokens,
            tokens,
            keys_allowed,
            False,
            notes,
        ),
        _group(
            "decoder self-attention",
            out.decoder_attentions,
            dec_tokens,
            dec_tokens,
            every,
            True,
            notes,
        ),
        _group(
            "decoder cross-attention",
            out.cross_attentions,
            dec_tokens,
            tokens,
            keys_allowed,
            False,
            notes,
        ),
    ), notes


def _group(name, attentions, queries, keys, keys_allowed, causal, notes) -> Group:
    if not attentions:
        raise ValueError(
            f"the model returned no {name} weights with output_attentions=True (does it "
            "support the eager attention implementation?)"
        )
    weights = torch.stack([a[0].detach().float().cpu() for a in attentions])  # (l, h, q, k)
    q, k = weights.shape[-2:]
    allowed = keys_allowed[None, :].expand(q, k)  # (q, k)
    if causal:
        future = ~torch.ones(q, k, dtype=torch.bool).tril()
        if (weights[..., future] > 0).any():
            notes.append(f"{name}: weight above the diagonal, so not drawn as causal")
        else:
            allowed = allowed & ~future
    layers = tuple(f"layer {i}" for i in range(weights.shape[0]))
    return Group(name, weights, allowed, tuple(queries), tuple(keys), layers)


@contextlib.contextmanager
def _eager(model: nn.Module) -> Iterator[None]:
    """The eager attention implementation and eval mode, restored afterwards."""
    before = getattr(model.config, "_attn_implementation", None)
    flags = {m: m.training for m in model.modules()}
    model.eval()
    switch = before not in (None, "eager") and hasattr(model, "set_attn_implementation")
    if switch:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(before)
        for m, flag in flags.items():
            m.training = flag
