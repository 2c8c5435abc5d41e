"""`explore(source, inputs)`: the public entry point. Its arguments are checked at the door,
then the source is captured (chapter.py, modules.py, hf.py) and cut to the page's limits:
inputs past `max_tokens` are cut before the model runs; groups past `max_cells` keep their
first layers (then heads, then queries and keys), before anything is encoded or summarised.
Every cut is written at the top of the page.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from attnlab import book
from attnlab._validate import check_size
from attnlab.explore import hf
from attnlab.explore import inputs as inputs_
from attnlab.explore.chapter import chapter_capture
from attnlab.explore.data import Capture, Group
from attnlab.explore.encoding import choose_bits
from attnlab.explore.modules import groups_of, record_module
from attnlab.explore.result import Exploration

MAX_TOKENS = 256
MAX_CELLS = 12 * 12 * 256 * 256  # a 12-layer, 12-head model at 256 tokens: 9.4 M cells
CHAPTER_TEXT = "Your journey starts with one step"
_SIZE_NAMES = ("d_in", "embed_dim", "d_model", "n_embd", "hidden_size")


def explore(
    source: object = None,
    inputs: object = None,
    *,
    tokens: object = None,
    tokenizer: object = None,
    decoder_inputs: object = None,
    causal: bool | None = None,
    title: str | None = None,
    max_tokens: int = MAX_TOKENS,
    max_cells: int = MAX_CELLS,
    precision: int | str = "auto",
) -> Exploration:
    """An interactive page of a source's attention maps.

    Args:
        source: None for the chapter's six-token example stage by stage (scores, scaled,
            causal mask, softmax, dropout, each head of the multi-head layer); an
            nn.Module (an attnlab layer or a model holding them, the book's classes, any
            attention module: see attnlab.explore.modules); a transformers model; or a
            transformers model's local path, or the name of one in the local Hugging Face
            cache (AutoModel and AutoTokenizer load it; nothing is downloaded).
        inputs: for a module: a text (split on whitespace; default the chapter's
            sentence), a list of token strings, embeddings (tokens, d) / (1, tokens, d) or
            token ids (tokens,) / (1, tokens). For a transformers model: a text (with
            `tokenizer`), token ids, or a tokenizer's output (with its attention_mask).
        tokens: labels for a tensor input's tokens (default their positions).
        tokenizer: a transformers tokenizer for a text input and the tokens' labels.
        decoder_inputs: an encoder-decoder model's decoder input (text or ids; default the
            start token then the input's tokens but the last).
        causal: whether a single-stack transformers model is causal (default: from its
            configuration).
        title: the page's title (default: the source and its input).
        max_tokens: inputs are cut to their first `max_tokens` tokens before running.
        max_cells: the most map cells the page holds; past it each group keeps its first
            layers, then heads, then queries and keys (9.4 M: 12 layers x 12 heads x 256 x
            256).
        precision: "auto", 8 or 16 bits per stored value ("auto": 16 up to 4 M cells).

    Returns:
        The Exploration: `.save(path)` writes the HTML file; notebooks display it.

    Raises:
        TypeError: a source or input of an unsupported kind, or an option of the wrong type.
        ValueError: an option out of range, inputs that do not fit the source, or a module
            in which no attention weights were seen.
        attnlab.explore.hf.ModelNotFoundError: a source name that is neither an existing
            path nor a model in the local Hugging Face cache (a ValueError and an OSError),
            said at once.
    """
    max_tokens = check_size("max_tokens", max_tokens)
    max_cells = check_size("max_cells", max_cells)
    choose_bits(precision, 0)
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be None, True or False, got {causal!r}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    if source is None:
        _no_inputs(inputs=inputs, tokens=tokens, tokenizer=tokenizer, decoder_inputs=decoder_inputs)
        capture = chapter_capture()
    elif isinstance(source, str) or hf.is_hf_model(source):
        capture = _hf_capture(source, inputs, tokens, tokenizer, decoder_inputs, causal, max_tokens)
    elif isinstance(source, nn.Module):
        _no_inputs(tokenizer=tokenizer, decoder_inputs=decoder_inputs)
        capture = _module_capture(source, inputs, tokens, max_tokens)
    else:
        raise TypeError(
            "source must be None (the chapter's example), an nn.Module, a transformers model "
            f"or a model's name, got {type(source).__name__}"
        )
    capture = _fit(capture, max_cells)
    return Exploration(capture if title is None else replace(capture, title=title), precision)


def _no_inputs(**given: object) -> None:
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{name} does not apply to this source, got {value!r}")


def _module_capture(module: nn.Module, inputs: object, tokens: object, max_tokens: int) -> Capture:
    inputs = CHAPTER_TEXT if inputs is None else inputs
    x, labels, notes = _module_input(module, inputs, tokens)
    cuts = []
    if len(labels) > max_tokens:
        cuts.append(_token_cut("inputs", len(labels), max_tokens))
        x, labels = x[:, :max_tokens], labels[:max_tokens]  # (1, max_tokens[, d])
    records = record_module(module, x, len(labels))
    if not records:
        raise ValueError(
            f"no attention weights were seen while running {type(module).__name__}: no "
            "attnlab MultiHeadAttention, no softmax over rows of the input's tokens and no "
            "F.scaled_dot_product_attention (a fused kernel of its own returns no weights)"
        )
    title = f"{type(module).__name__} on \u201c{_short(' '.join(labels))}\u201d"
    notes.append("Run in eval mode (no dropout); the first sequence is shown.")
    return Capture(title, groups_of(records, labels, labels), tuple(notes), tuple(cuts))


def _module_input(
    module: nn.Module, inputs: object, tokens: object
) -> tuple[torch.Tensor, tuple[str, ...], list[str]]:
    """The module's input (ids (1, t) or embeddings (1, t, d)), its labels and a note."""
    like = next(iter([*module.parameters(), *module.buffers()]), torch.zeros(()))
    if isinstance(inputs, torch.Tensor):
        x = inputs_.as_batch(inputs)
        return x, inputs_.tensor_labels(x, tokens), []
    if tokens is not None:
        raise ValueError("tokens labels a tensor input; a text or token list labels itself")
    labels = inputs_.token_labels(inputs)
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    d_in = _d_in(module)
    if embedding is not None and d_in is None:
        ids = inputs_.hashed_ids(labels, embedding.num_embeddings)
        return (
            ids.to(embedding.weight.device),
            labels,
            [f"Token ids: each token's CRC-32 modulo the vocabulary ({embedding.num_embeddings})."],
        )
    if d_in is None:
        raise ValueError(
            f"cannot tell the input width of {type(module).__name__} (no d_in, embed_dim, "
            "d_model, n_embd or hidden_size, no nn.Linear): give inputs as a tensor"
        )
    x = inputs_.embed(labels, d_in, like if like.is_floating_point() else torch.zeros(()))
    if labels == book.TOKENS and d_in == 3:
        return x, labels, ["Inputs: the chapter's 3-d embeddings of its six words."]
    return x, labels, ["Inputs: a random embedding per token, seeded by its text (not learned)."]


def _d_in(module: nn.Module) -> int | None:
    for name in _SIZE_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if any(isinstance(m, nn.Embedding) for m in module.modules()):
        return None
    linear = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    return None if linear is None else linear.in_features


def _hf_capture(source, inputs, tokens, tokenizer, decoder_inputs, causal, max_tokens) -> Capture:
    by_name = isinstance(source, str)
    if by_name:
        source, loaded = hf.load(source)
        tokenizer = loaded if tokenizer is None else tokenizer
    if inputs is None:
        raise ValueError("inputs is required for a transformers model: a text or token ids")
    # a folder without tokenizer files (the CLI can pass no ids): each word an id, as for
    # any module taking ids; a model object given a text with no tokenizer= is an error
    hashed = by_name and tokenizer is None and isinstance(inputs, str)
    if hashed:
        words = tuple(inputs.split())
        inputs = inputs_.hashed_ids(words, source.config.vocab_size)[0].tolist()
        tokens = words if tokens is None else tokens
    ids, mask = hf.encode(inputs, tokenizer, "inputs")
    cuts = []
    if ids.shape[1] > max_tokens:
        cuts.append(_token_cut("inputs", ids.shape[1], max_tokens))
        ids, mask = ids[:, :max_tokens], mask[:, :max_tokens]  # (1, max_tokens)
    labels = hf.labels(ids, tokenizer) if tokens is None else inputs_.tensor_labels(ids, tokens)
    decoder = _decoder(source, ids, decoder_inputs, tokenizer, max_tokens, cuts)
    groups, notes = hf.capture(source, ids, mask, labels, decoder, causal)
    name = getattr(source.config, "name_or_path", "") or type(source).__name__
    title = f"{name} on \u201c{_short(' '.join(labels))}\u201d"
    notes = [*notes, "Run in eval mode with the eager attention implementation."]
    if hashed:
        notes.append("No tokenizer: each word is given the id crc32(word) % vocab_size.")
    elif tokenizer is None:
        notes.append("No tokenizer: tokens are labelled by their ids.")
    return Capture(title, groups, tuple(notes), tuple(cuts))


def _decoder(model, ids, decoder_inputs, tokenizer, max_tokens, cuts):
    """(decoder ids (1, td), labels) for an encoder-decoder model, else None; a cut is
    appended to `cuts`."""
    if not getattr(model.config, "is_encoder_decoder", False):
        if decoder_inputs is not None:
            raise ValueError("decoder_inputs applies to encoder-decoder models only")
        return None
    if decoder_inputs is None:
        dec = hf.decoder_ids(model, ids)
    else:
        dec, _ = hf.encode(decoder_inputs, tokenizer, "decoder_inputs")
    if dec.shape[1] > max_tokens:
        cuts.append(_token_cut("decoder_inputs", dec.shape[1], max_tokens))
        dec = dec[:, :max_tokens]  # (1, max_tokens)
    return dec, hf.labels(dec, tokenizer)


def _fit(capture: Capture, max_cells: int) -> Capture:
    """The capture cut so that the page holds at most max_cells cells (at least one per
    group), before anything is encoded or summarised: each group keeps its share of the
    cells, taking its first layers; where one layer is past its share, its first heads;
    where one head is, its first queries and keys."""
    total = sum(g.weights.numel() for g in capture.groups)
    if total <= max_cells:
        return capture
    share = max_cells / total
    groups: list[Group] = []
    cuts = list(capture.cuts)
    for group in capture.groups:
        group, said = _cut_group(group, max(1, int(group.weights.numel() * share)), max_cells)
        groups.append(group)
        cuts += said
    return replace(capture, groups=tuple(groups), cuts=tuple(cuts))


def _cut_group(group: Group, budget: int, max_cells: int) -> tuple[Group, list[str]]:
    """`group` cut to at most `budget` cells (its first layers, then heads, then tokens),
    with what was cut in words. Slices are views: nothing of the cut part is copied."""
    layers, heads, queries, keys = group.shape
    why = f"the page holds at most {max_cells:,} cells; raise max_cells or cut the input"
    said = []
    weights, allowed = group.weights, group.full_mask()  # (l, h, q, k) each
    layer_names, query_tokens, key_tokens = group.layer_names, group.query_tokens, group.key_tokens
    keep = min(layers, max(1, budget // (heads * queries * keys)))
    if keep < layers:
        said.append(
            f"{group.name}: layers {layer_names[keep]} to {layer_names[-1]} cut ({keep} of "
            f"{layers} layers kept: {why})"
        )
        weights, allowed, layer_names = weights[:keep], allowed[:keep], layer_names[:keep]
    if keep * heads * queries * keys > budget:  # one layer is past the share
        kept_heads = min(heads, max(1, budget // (queries * keys)))
        if kept_heads < heads:
            said.append(
                f"{group.name}: heads {kept_heads} to {heads - 1} cut ({kept_heads} of {heads} "
                f"heads kept: {why})"
            )
            weights, allowed = weights[:, :kept_heads], allowed[:, :kept_heads]
        if queries * keys > budget:  # one map is past it: its first queries and keys
            scale = math.sqrt(budget / (queries * keys))
            kept_q = max(1, min(queries, int(queries * scale)))
            kept_k = max(1, min(keys, int(keys * scale)))
            said.append(
                f"{group.name}: each map cut to its first {kept_q} queries and {kept_k} keys "
                f"(of {queries} x {keys}; a row shows only the kept keys' weights: {why})"
            )
            weights, allowed = weights[..., :kept_q, :kept_k], allowed[..., :kept_q, :kept_k]
            query_tokens, key_tokens = query_tokens[:kept_q], key_tokens[:kept_k]
    if not said:
        return group, said
    cut = replace(
        group,
        weights=weights,
        allowed=allowed,
        layer_names=layer_names,
        query_tokens=query_tokens,
        key_tokens=key_tokens,
    )
    return cut, said


def _token_cut(name: str, count: int, kept: int) -> str:
    return (
        f"{name}: {count} tokens, cut to the first {kept} before running (tokens {kept + 1} "
        f"to {count} left out; raise max_tokens to see them)"
    )


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "\u2026"
