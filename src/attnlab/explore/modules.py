"""Attention maps of a PyTorch module, as it computes them.

- PyTorch's `nn.MultiheadAttention` (the module itself) is called as self-attention with
  need_weights=True, average_attn_weights=False: the weights it returns, per head.
- attnlab's `MultiHeadAttention` layers (the module itself or any submodule) are called with
  `need_weights=True` (a forward pre-hook), and their weights are taken off the output
  before the model sees it: the layer's own weights, from its own kernel. Masked cells come
  from the layer's rule (causal, sliding window) and the mask it was given.
- Any other module (the book's classes, a reader's own, anyone's) is run under a
  TorchFunctionMode that records every softmax over the last dimension of a (tokens,
  tokens) map of the input's tokens (not a softmax over a vocabulary), and every
  F.scaled_dot_product_attention whose queries are the input's tokens (its weights
  recomputed by the math formula, which returns none). A score of -inf (or below half the
  dtype's lowest value, as masks built from torch.finfo(dtype).min give) is a masked cell.

Each recorded call is a layer, named after the innermost submodule running it. Calls of
the same (heads, queries, keys) in a row form a group. The module runs in eval mode (no
dropout) under torch.no_grad; its training flags are restored afterwards.

Shapes: recorded maps (heads, queries, keys) of the first sequence.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from attnlab import masks
from attnlab.attention import MultiHeadAttention
from attnlab.explore.data import Group

_SOFTMAX = (torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax)


@dataclass
class Record:
    """One attention call: where it ran and its maps.

    Attributes:
        name: the innermost submodule running it.
        weights: (heads, queries, keys) of the first sequence.
        allowed: (heads, queries, keys) bool, False where masked.
    """

    name: str
    weights: torch.Tensor  # (h, q, k)
    allowed: torch.Tensor  # (h, q, k)


def record_module(module: nn.Module, x: torch.Tensor, queries: int) -> list[Record]:
    """Run `module(x)` and record its attention calls.

    Args:
        module: the module to run.
        x: its input, ids (1, t) or embeddings (1, t, d).
        queries: the number of query tokens (to tell attention from other softmaxes).

    Returns:
        The calls, in the order they ran.
    """
    records: list[Record] = []
    layers = [m for m in module.modules() if isinstance(m, MultiHeadAttention)]
    with _eval(module), torch.no_grad(), _names(module) as stack:
        if isinstance(module, nn.MultiheadAttention):
            records.append(_torch_mha(module, x))
        elif layers:
            with _weights_hooks(layers, module, records):
                module(x)
        else:
            with _Recorder(records, stack, queries):
                module(x)
    return records


def groups_of(
    records: list[Record], query_tokens: tuple[str, ...], key_tokens: tuple[str, ...]
) -> tuple[Group, ...]:
    """Consecutive records of one (heads, queries, keys) shape stacked into groups.

    Args:
        records: the recorded calls.
        query_tokens: the input's tokens, for the queries' labels.
        key_tokens: labels for keys as many as the input's tokens.

    Returns:
        The groups, named "maps 1", "maps 2", ... where there are several.
    """
    runs: list[list[Record]] = []
    for record in records:
        if runs and runs[-1][0].weights.shape == record.weights.shape:
            runs[-1].append(record)
        else:
            runs.append([record])
    groups = []
    for index, run in enumerate(runs):
        _, q, k = run[0].weights.shape
        name = "attention" if len(runs) == 1 else f"maps {index + 1}"
        keys = key_tokens if k == len(key_tokens) else tuple(f"key {j}" for j in range(k))
        groups.append(
            Group(
                f"{name} ({q}\u00d7{k})" if len(runs) > 1 else name,
                torch.stack([r.weights for r in run]),  # (layers, h, q, k)
                torch.stack([r.allowed for r in run]),
                query_tokens[:q],
                keys,
                tuple(r.name for r in run),
            )
        )
    return tuple(groups)


def _torch_mha(module: nn.MultiheadAttention, x: torch.Tensor) -> Record:
    """PyTorch's nn.MultiheadAttention as self-attention, with the weights it returns per
    head (no mask: every cell allowed)."""
    x = x if module.batch_first else x.transpose(0, 1)  # (1, t, d) or (t, 1, d)
    _, weights = module(x, x, x, need_weights=True, average_attn_weights=False)  # (1, h, t, t)
    w = weights[0].float().cpu()  # (h, t, t)
    return Record(type(module).__name__, w, torch.ones_like(w, dtype=torch.bool))


@contextlib.contextmanager
def _eval(module: nn.Module) -> Iterator[None]:
    flags = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


@contextlib.contextmanager
def _names(module: nn.Module) -> Iterator[list[str]]:
    """A stack of the submodules running (their qualified names), kept by hooks."""
    stack: list[str] = []
    handles = []
    for name, sub in module.named_modules():
        label = name or type(module).__name__

        def push(_m, _args, label=label):
            stack.append(label)

        def pop(_m, _args, _out):
            if stack:
                stack.pop()

        handles.append(sub.register_forward_pre_hook(push))
        handles.append(sub.register_forward_hook(pop, always_call=True))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _weights_hooks(
    layers: list[MultiHeadAttention], root: nn.Module, records: list[Record]
) -> Iterator[None]:
    """attnlab layers called with need_weights=True, their weights recorded and taken off
    the output (left on where the caller asked for them itself)."""
    names = {m: n or type(root).__name__ for n, m in root.named_modules()}
    asked: dict[int, bool] = {}

    def pre(layer, args, kwargs):
        asked[id(layer)] = bool(kwargs.get("need_weights", False))
        return args, {**kwargs, "need_weights": True}

    def post(layer, args, kwargs, output):
        out, weights = output
        allowed = _layer_allowed(layer, args, kwargs, weights)
        records.append(Record(names[layer], weights[0].float().cpu(), allowed[0].cpu()))
        return output if asked.pop(id(layer), False) else out

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _layer_allowed(layer: MultiHeadAttention, args, kwargs, weights: torch.Tensor) -> torch.Tensor:
    """(b, h, q, k) bool: the layer's positional rule and the mask it was given."""
    b, h, q, k = weights.shape
    context = args[1] if len(args) > 1 else kwargs.get("context")
    allowed = torch.ones(q, k, dtype=torch.bool)
    if context is None and layer.window is not None:
        allowed = masks.sliding_window_mask(q, k, window=layer.window)
    elif context is None and layer.causal:
        allowed = masks.causal_mask(q, k)
    mask = kwargs.get("mask")
    if mask is not None:
        given = mask.cpu() if mask.dtype == torch.bool else torch.isfinite(mask.cpu())
        allowed = allowed & given
    return allowed.expand(b, h, q, k)


class _Recorder(TorchFunctionMode):
    """Records softmaxes over attention rows and F.scaled_dot_product_attention calls."""

    def __init__(self, records: list[Record], stack: list[str], queries: int) -> None:
        super().__init__()
        self.records, self.stack, self.queries = records, stack, queries

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _SOFTMAX:
            self._softmax(args, kwargs, out)
        elif func is F.scaled_dot_product_attention:
            self._sdpa(*args, **kwargs)
        return out

    def _name(self) -> str:
        return self.stack[-1] if self.stack else "module"

    def _softmax(self, args, kwargs, out) -> None:
        scores = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(out, torch.Tensor) or not 2 <= out.dim() <= 4 or dim is None:
            return
        if dim not in (-1, out.dim() - 1) or out.shape[-2:] != (self.queries, self.queries):
            return  # not self-attention over the input's tokens (a softmax over a vocabulary)
        lowest = torch.finfo(scores.dtype).min / 2 if scores.is_floating_point() else -math.inf
        allowed = ~(scores <= lowest)  # -inf, or a finfo.min fill
        self._add(out, allowed)

    def _sdpa(
        self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_kw
    ) -> None:
        if q.shape[-2] != self.queries:
            return
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if k.dim() == 4 and k.shape[1] != q.shape[1]:  # grouped-query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (b, h, tk, hd)
        scores = q.float() @ k.float().transpose(-2, -1) * scale  # (..., tq, tk)
        tq, tk = scores.shape[-2:]
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=scores.device)
        if is_causal:
            allowed = torch.ones_like(allowed).tril()  # top-left aligned, as SDPA does
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        elif attn_mask is not None:
            scores = scores + attn_mask.float()
            # -inf, or a torch.finfo(dtype).min fill (half the lowest and below): masked
            allowed = allowed & (attn_mask > torch.finfo(attn_mask.dtype).min / 2)
        allowed = allowed.expand(scores.shape)
        weights = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
        self._add(weights, allowed)

    def _add(self, weights: torch.Tensor, allowed: torch.Tensor) -> None:
        allowed = allowed.expand(weights.shape)
        if weights.dim() == 2:  # (q, k): one head of one sequence
            weights, allowed = weights[None, None], allowed[None, None]
        elif weights.dim() == 3:  # (b, q, k): one head
            weights, allowed = weights[:, None], allowed[:, None]
        w = weights[0].detach().float().cpu()  # (h, q, k)
        self.records.append(Record(self._name(), w, allowed[0].cpu()))
