"""How the auditor calls someone's attention module: (batch, tokens, d_in) in, the output
tensor out, on a private copy of the module so that the audit never changes the user's.

Two other layouts are called through the same (batch, tokens, d_in) door: a module whose
`batch_first` attribute is False (nn.MultiheadAttention's default, its subclasses) gets
(tokens, batch, d_in) and its output is transposed back; an unbatched module (the
chapter's SelfAttention_v1/_v2, found by check_runs) gets one row at a time.

d_in and context_length are read from the module when not given: the book's attribute
names, its projections (W_query, qkv_proj, in_proj_weight, nn.Linear) and its mask buffer.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from attnlab.check import arguments
from attnlab.check.arguments import Builder
from attnlab.check.runner import user_code


@dataclass
class Probe:
    """A module and what it takes: inputs of width d_in, at most context_length tokens."""

    module: nn.Module
    d_in: int
    context_length: int | None
    dtype: torch.dtype
    takes_qkv: bool  # forward(query, key, value), as nn.MultiheadAttention
    num_heads: int | None = None  # from --init or the module, when found
    seq_first: bool = False  # batch_first=False: the module takes (tokens, batch, d_in)
    unbatched: bool = False  # the module takes (tokens, d_in) only: called row by row
    # forward's other required arguments (positions, rotary tables, masks) by name: built
    # per call from x as the model around the module would (check.arguments)
    extra: dict[str, Builder] = dataclasses.field(default_factory=dict)
    # required forward arguments the check cannot build (by name), and why: not called
    needs: list[str] = dataclasses.field(default_factory=list)
    needs_why: str = ""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The module's (batch, tokens, d_out) output for x (batch, tokens, d_in), in the
        layout the module takes; whatever the module raises is marked as the module's
        (runner.user_code)."""
        if self.unbatched:
            return torch.stack([self.call(row) for row in x])  # (batch, tokens, d_out)
        if self.seq_first:
            out = self.call(x.transpose(0, 1))  # (tokens, batch, d_out)
            return out.transpose(0, 1) if out.dim() == 3 else out
        return self.call(x)

    def call(self, x: torch.Tensor, start: int = 0, **given: object) -> torch.Tensor:
        """The module's output for x as given (the first element when it returns a tuple);
        `start`: the position of x's first token, for the arguments the check supplies
        (a module with its own cache continues from there); `given`: more keyword
        arguments (a cache object)."""
        extra = {name: build(x, start) for name, build in self.extra.items()} | given
        with user_code():
            out = self.module(x, x, x) if self.takes_qkv else self.module(x, **extra)
        if isinstance(out, tuple | list) and out:
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the module returned {type(out).__name__}, not a tensor")
        return out

    def copy(self) -> Probe:
        """The same probe on a deep copy of the module (for checks that change it)."""
        return dataclasses.replace(self, module=copy.deepcopy(self.module))

    def inputs(self, batch: int, tokens: int, seed: int) -> torch.Tensor:
        """Standard-normal (batch, tokens, d_in) input from a private generator."""
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, tokens, self.d_in, generator=generator, dtype=torch.float64)
        return x.to(device=self.device, dtype=self.dtype)

    @property
    def device(self) -> torch.device:
        tensor = next(iter(self.module.parameters()), None)
        return tensor.device if tensor is not None else torch.device("cpu")


def make_probe(
    module: nn.Module,
    d_in: int | None,
    context_length: int | None,
    num_heads: int | None = None,
    causal: bool = True,
) -> Probe:
    """A Probe on a copy of `module`, with d_in and context_length found when not given.

    Args:
        module: the attention module.
        d_in: its input width, or None to read it from the module.
        context_length: its longest input, or None to read it from the module (may stay None).
        num_heads: its head count, or None to read it from the module (may stay None).
        causal: whether the audit is causal (the mask it supplies to a forward taking one).

    Returns:
        The Probe.

    Raises:
        TypeError: module is not an nn.Module.
        ValueError: d_in is None and cannot be read from the module.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    d_in = d_in if d_in is not None else infer_d_in(module)
    if d_in is None:
        raise ValueError(
            f"could not find the input width of {type(module).__name__} (no d_in or "
            f"embed_dim attribute, nn.Linear, Conv1D or in_proj_weight): pass --d-in N "
            f"(attnlab check) or d_in=N (audit)"
        )
    if context_length is None:
        context_length = infer_context_length(module)
    floating = [p for p in module.parameters() if p.is_floating_point()]
    dtype = floating[0].dtype if floating else torch.float32
    if num_heads is None:
        num_heads = infer_num_heads(module)
    with user_code():  # deepcopy runs the module's __deepcopy__/__reduce__, if it has one
        private = copy.deepcopy(module)
    seq_first = getattr(module, "batch_first", None) is False  # nn.MultiheadAttention's flag
    probe = Probe(
        private, d_in, context_length, dtype, _takes_qkv(module), num_heads, seq_first=seq_first
    )
    if not probe.takes_qkv:
        supply = arguments.builders(private, _head_dim(private, d_in, num_heads), causal)
        probe.needs, probe.needs_why = supply.needs, supply.why
        if not supply.needs:
            probe.extra = _first_form_that_runs(probe, supply.forms)
    return probe


def _head_dim(module: nn.Module, d_in: int, num_heads: int | None) -> int | None:
    """The head width: a head_dim attribute (on the module or its config), else d_in /
    num_heads."""
    for owner in (module, getattr(module, "config", None)):
        value = getattr(owner, "head_dim", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return d_in // num_heads if num_heads and d_in % num_heads == 0 else None


def _first_form_that_runs(probe: Probe, forms: list[dict]) -> dict:
    """The first of forward's argument forms that a call of 3 tokens (2 within a shorter
    context; an odd count, so that tables indexed by head instead of position do not
    broadcast by chance) runs with, returning (1, tokens, ...): gpt-fast takes its rotary
    tables real, Meta's Llama complex; the book's cos/sin are (tokens, head_dim), llama2.c's
    (tokens, head_dim/2); a masked_fill takes a bool mask. The first when none runs (the
    module's error is then the audit's finding)."""
    if len(forms) == 1:
        return forms[0]
    tokens = 3 if (probe.context_length or 3) >= 3 else 2
    x = probe.inputs(1, tokens, seed=0)
    for form in forms:
        try:
            with torch.no_grad():
                out = probe.module(x, **{name: build(x) for name, build in form.items()})
        except Exception:  # the module's own error with this form: try the next
            continue
        out = out[0] if isinstance(out, tuple | list) and out else out
        if isinstance(out, torch.Tensor) and tuple(out.shape[:2]) == (1, tokens):
            return form
    return forms[0]


_HEADS = ("num_heads", "n_head", "n_heads", "num_attention_heads")


def infer_num_heads(module: nn.Module) -> int | None:
    """The head count from the usual attribute names, on the module or its config."""
    for owner in (module, getattr(module, "config", None)):
        for name in _HEADS:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


_WIDTHS = ("d_in", "embed_dim", "d_model", "n_embd", "hidden_size", "dim")
_PROJECTIONS = ("W_query", "qkv_proj", "q_proj", "qkv", "c_attn", "to_q", "wq", "query")


def infer_d_in(module: nn.Module) -> int | None:
    """The input width: the module's own width attribute or named projection first, then the
    first submodule (in registration order) with one of them, or an nn.Linear / Conv1D
    (GPT-2's, whose weight is (in, out)) or nn.MultiheadAttention's in_proj_weight."""
    for part in module.modules():
        width = _width_of(part)
        if width is not None:
            return width
    return None


def _width_of(part: nn.Module) -> int | None:
    """One module's input width from its attributes or its own layer, else None."""
    for name in _WIDTHS:
        value = getattr(part, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    for name in _PROJECTIONS:
        width = _in_width(getattr(part, name, None))
        if width is not None:
            return width
    weight = getattr(part, "in_proj_weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[1]
    linear = isinstance(part, nn.Linear) or _is_conv1d(part) or is_linear_like(part)
    return _in_width(part) if linear else None


def _is_conv1d(part: object) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer with an (in, out) weight."""
    weight = getattr(part, "weight", None)
    return type(part).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)


def is_linear_like(part: object) -> bool:
    """A module that is not an nn.Linear but computes one: an (out, in) 2-d weight beside
    integer in_features/out_features (fairscale's and Megatron-style ColumnParallelLinear
    and RowParallelLinear on one process)."""
    weight = getattr(part, "weight", None)
    in_features = getattr(part, "in_features", None)
    return (
        isinstance(part, nn.Module)
        and not isinstance(part, nn.Linear)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and isinstance(in_features, int)
        and isinstance(getattr(part, "out_features", None), int)
        and weight.shape[1] == in_features
    )


_LENGTHS = (
    "context_length",
    "block_size",
    "n_positions",
    "max_position_embeddings",
    "max_seq_len",
    "max_len",
    "max_length",
    "n_ctx",
)


def infer_context_length(module: nn.Module) -> int | None:
    """context_length from an attribute (the book's, nanoGPT's, GPT-2's, Llama's names, on
    a module or its HF-style `config`), or the size of a causal mask buffer: a square 0/1
    triangle in its last two dimensions, whatever its name (nanoGPT's `bias` is
    (1, 1, T, T))."""
    for candidate in module.modules():
        config = getattr(candidate, "config", None)
        for name in _LENGTHS:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        for name in _LENGTHS:
            value = getattr(candidate, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        for buffer in candidate.buffers(recurse=False):
            if is_causal_mask(buffer):
                return buffer.shape[-1]
    return None


def is_causal_mask(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s last two dimensions are a square 0/1 (or bool) triangle: the
    allowed part (tril) or the blocked part (triu, diagonal 1)."""
    if tensor.dim() < 2 or tensor.shape[-1] != tensor.shape[-2] or tensor.shape[-1] < 2:
        return False
    n = tensor.shape[-1]
    square = tensor.reshape(-1, n, n)[0].float()
    lower = torch.ones(n, n, device=square.device).tril()
    return bool(torch.equal(square, lower) or torch.equal(square, 1 - lower))


def _in_width(layer: object) -> int | None:
    if isinstance(layer, nn.Linear) or is_linear_like(layer):
        return layer.in_features
    if _is_conv1d(layer) and layer.weight.dim() == 2:
        return layer.weight.shape[0]  # Conv1D's weight is (in, out)
    if isinstance(layer, nn.Parameter) and layer.dim() == 2:
        return layer.shape[0]  # the book's SelfAttention_v1: x @ W, W is (d_in, d_out)
    return None


def _takes_qkv(module: nn.Module) -> bool:
    """True for forward(query, key, value, ...) with key and value required, named so (not
    for forward(x, start_pos, freqs_cis, mask), whose other arguments the check supplies,
    nor for forward(x, freqs_cos, freqs_sin))."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(required) < 3 or arguments.supplies(required[1:]):
        return False
    return _names_role(required[1], _KEY_WORDS) and _names_role(required[2], _VALUE_WORDS)


_KEY_WORDS = frozenset(("k", "key", "keys", "xk", "kv", "context", "memory"))
_VALUE_WORDS = frozenset(("v", "value", "values", "xv", "kv", "context", "memory"))


def _names_role(name: str, words: frozenset[str]) -> bool:
    """Whether a parameter's name reads as that role (key_input, k, values, ...)."""
    return any(part in words for part in name.lower().split("_"))
