"""The properties an attention module must have, each a function of a Probe returning a
PropertyResult. Every check runs on its own copy of the module, in eval mode unless it is
about training, with inputs from fixed seeds, and compares with tolerances fit for float32.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from attnlab.check.probe import Probe
from attnlab.check.report import PropertyResult, failed, passed, skipped

ATOL, RTOL = 1e-5, 1e-4


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for comparing two outputs of a module computing in `dtype`."""
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 2e-2
    return ATOL, RTOL


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal within the dtype's tolerance, NaN matching NaN (a NaN is reported once, by
    finite_gradients, not again by every comparison)."""
    atol, rtol = tolerances(dtype)
    return a.shape == b.shape and torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True)


TITLES = {
    "runs": "runs on (batch, tokens, d_in) with a consistent output shape",
    "causal": "changing later tokens leaves earlier outputs unchanged",
    "batch_independent": "one row's output does not depend on the other rows",
    "finite_gradients": "finite outputs and gradients; every parameter gets a gradient",
    "dropout_modes": "eval mode is deterministic; train mode applies dropout",
    "follows_to": ".to(float64) works; the forward uses no plain tensor attributes",
    "state_dict_round_trip": "a fresh instance loaded with the state_dict gives the same output",
    "long_input": "input longer than context_length: a clear error or a correct output",
}

CAUSAL_CAUSES = [
    "the causal mask is never applied: masked_fill without the trailing underscore returns "
    "a new tensor that is thrown away (use masked_fill_, or assign the result)",
    "the mask is inverted: a boolean mask for F.scaled_dot_product_attention must be True "
    "where a query may attend (the past), not where it is blocked",
    "F.scaled_dot_product_attention called without is_causal=True (or a causal attn_mask)",
    "the mask applied after the softmax, or softmax over the wrong dimension (the queries)",
    "heads split or merged with view but no transpose mix tokens across positions",
]


def token_counts(probe: Probe) -> list[int]:
    """Lengths to try: 1, 2, about half of context_length and context_length itself."""
    top = probe.context_length or 8
    return sorted({1, min(2, top), max(1, math.ceil(top / 2)), top})


def check_runs(probe: Probe, seed: int) -> tuple[PropertyResult, int | None]:
    """Property 1; also returns the longest token count that worked, for the others."""
    name, widths, problems, longest = "runs", set(), [], None
    for tokens in token_counts(probe):
        for batch in (1, 2, 3):
            try:
                with torch.no_grad():
                    out = probe(probe.inputs(batch, tokens, seed))
            except Exception as error:  # any failure is the finding
                problems.append(f"batch {batch}, {tokens} tokens: {_describe(error)}")
                continue
            if out.dim() != 3 or tuple(out.shape[:2]) != (batch, tokens):
                problems.append(f"batch {batch}, {tokens} tokens: output {tuple(out.shape)}")
                continue
            widths.add(out.shape[-1])
            longest = tokens
    if len(widths) > 1:
        problems.append(f"the output width changes with the input: {sorted(widths)}")
    if not problems:
        return passed(name, TITLES[name], f"output (batch, tokens, {widths.pop()})"), longest
    causes = ["the forward fails or reshapes wrongly for some batch sizes or token counts"]
    if longest == probe.context_length and longest is not None:
        causes.insert(
            0,
            "the mask buffer is not sliced to the input's length: use "
            "self.mask.bool()[:num_tokens, :num_tokens]",
        )
    return failed(name, TITLES[name], "; ".join(problems[:4]), causes), longest


def check_causal(probe: Probe, tokens: int, seed: int) -> PropertyResult:
    """Property 2: changing tokens after position p leaves outputs up to p unchanged."""
    name = "causal"
    if tokens < 2:
        return skipped(name, TITLES[name], "needs an input of at least 2 tokens that runs")
    x = probe.inputs(2, tokens, seed)
    with torch.no_grad():
        out = probe(x)
        for start in sorted({1, tokens // 2, tokens - 1}):
            changed = x.clone()
            changed[:, start:] = probe.inputs(2, tokens - start, seed + start)
            after = probe(changed)[:, :start]
            if not torch.isfinite(out).all() or not close(after, out[:, :start], probe.dtype):
                return _leak(probe, out, (after - out[:, :start]).abs(), start)
    return passed(name, TITLES[name], f"checked at {tokens} tokens")


def _leak(probe: Probe, out: torch.Tensor, diff: torch.Tensor, start: int) -> PropertyResult:
    name = "causal"
    if not torch.isfinite(out).all():
        rows = (~torch.isfinite(out)).any(dim=(0, 2)).nonzero().flatten().tolist()
        observed = f"the output holds NaN or inf at positions {rows}: rows with every key masked"
        if rows == [0]:
            causes = [
                "the mask hides the diagonal (a token must see itself): "
                "torch.triu(..., diagonal=1), not diagonal=0"
            ]
        else:
            causes = [
                "the mask is inverted: torch.tril where torch.triu(..., diagonal=1) "
                "belongs, or a boolean SDPA mask True where it should be False",
                CAUSAL_CAUSES[0],
            ]
        return failed(name, TITLES[name], observed, causes)
    position = int(diff.amax(dim=(0, 2)).argmax())
    observed = (
        f"changing tokens {start} onward changed the output at position {position} "
        f"(max |difference| {diff.max().item():.3g})"
    )
    return failed(name, TITLES[name], observed, CAUSAL_CAUSES)


def check_batch_independent(probe: Probe, tokens: int, seed: int) -> PropertyResult:
    """Property 3: each row's output equals the output for that row alone."""
    name = "batch_independent"
    x = probe.inputs(3, tokens, seed)
    with torch.no_grad():
        together = probe(x)
        for row in range(3):
            alone = probe(x[row : row + 1])
            diff = (together[row] - alone[0]).abs().nan_to_num(0.0).max()
            if not close(together[row], alone[0], probe.dtype):
                observed = (
                    f"row {row}'s output changes with the rest of the batch "
                    f"(max |difference| {diff.item():.3g})"
                )
                causes = [
                    "softmax or another reduction over the batch dimension (dim=0)",
                    "a reshape or view that mixes the batch with tokens or heads",
                    "statistics over the batch (a BatchNorm) used in eval mode",
                ]
                return failed(name, TITLES[name], observed, causes)
    return passed(name, TITLES[name], "3 rows, each equal to its output alone")


def check_finite_gradients(probe: Probe, tokens: int, seed: int) -> PropertyResult:
    """Property 4: finite output and gradients, and a gradient for every parameter."""
    name = "finite_gradients"
    probe = probe.copy()
    x = probe.inputs(2, tokens, seed).requires_grad_()
    out = probe(x)
    if not torch.isfinite(out).all():
        observed = f"{int((~torch.isfinite(out)).sum())} non-finite output values"
        causes = [
            "a query whose every key is masked: softmax over only -inf gives NaN",
            CAUSAL_CAUSES[1],
        ]
        return failed(name, TITLES[name], observed, causes)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * weights.to(out)).sum().backward()
    params = [(n, p) for n, p in probe.module.named_parameters() if p.requires_grad]
    missing = [n for n, p in params if p.grad is None]  # a zero gradient can be right
    bad = [n for n, p in params if p.grad is not None and not torch.isfinite(p.grad).all()]
    if x.grad is None or not torch.isfinite(x.grad).all():
        bad.append("the input")
    if bad:
        observed = f"non-finite gradients for {', '.join(bad)}"
        return failed(name, TITLES[name], observed, ["NaN in the backward of a masked softmax"])
    if missing:
        observed = f"no gradient reaches {', '.join(missing)}"
        causes = [
            "the parameter is never used in the forward, e.g. the values computed with "
            "W_key instead of W_value",
            "the parameter is used only after .detach() or under torch.no_grad()",
        ]
        return failed(name, TITLES[name], observed, causes)
    return passed(name, TITLES[name], f"{len(params)} parameters, all with finite gradients")


def check_dropout_modes(probe: Probe, tokens: int, seed: int) -> PropertyResult:
    """Property 5: eval mode deterministic; train mode differs when dropout > 0."""
    name = "dropout_modes"
    x = probe.inputs(2, tokens, seed)
    with torch.no_grad():
        first, second = probe(x), probe(x)
        if not torch.equal(first.nan_to_num(), second.nan_to_num()):
            observed = "two calls in eval mode on the same input differ"
            causes = [
                "dropout applied in eval mode: F.dropout(..., training=True) or a dropout that "
                "ignores self.training (use nn.Dropout, or pass training=self.training)",
                "another source of randomness in the forward",
            ]
            return failed(name, TITLES[name], observed, causes)
        rate = dropout_rate(probe.module)
        if rate == 0.0:
            return passed(name, TITLES[name], "deterministic in eval; no dropout > 0 to check")
        probe.module.train()
        # many weights, so that a small rate still drops some; fewer rows for long inputs
        x = probe.inputs(max(2, 1024 // tokens), tokens, seed)
        try:
            differs = any(not torch.equal(probe(x), probe(x)) for _ in range(8))
        finally:
            probe.module.eval()
    if differs:
        return passed(name, TITLES[name], f"deterministic in eval; dropout {rate} in train")
    observed = f"dropout is {rate} but two calls in train mode give the same output"
    causes = ["the dropout module is created but never applied in the forward"]
    return failed(name, TITLES[name], observed, causes)


def dropout_rate(module: nn.Module) -> float:
    """The largest dropout probability found: nn.Dropout modules or a float attribute."""
    rates = [m.p for m in module.modules() if isinstance(m, nn.Dropout)]
    for m in module.modules():
        for attribute in ("dropout", "dropout_p", "attn_dropout", "attn_pdrop"):
            value = vars(m).get(attribute)
            if isinstance(value, float):
                rates.append(value)
    return max(rates, default=0.0)


def check_follows_to(probe: Probe, tokens: int, seed: int) -> PropertyResult:
    """Property 6: .to(float64) works, and tensors the forward uses are buffers."""
    name = "follows_to"
    plain = plain_tensor_attributes(probe.module)
    used = _used_by_forward(probe, plain, probe.inputs(1, tokens, seed))
    causes = [
        "a tensor kept as a plain attribute (self.mask = torch.triu(...)) does not follow "
        ".to(device) or .to(dtype) and is missing from the state_dict: use "
        "self.register_buffer('mask', ...)"
    ]
    if used:
        observed = f"the forward uses plain tensor attributes: {', '.join(used)}"
        return failed(name, TITLES[name], observed, causes)
    moved = probe.copy()
    moved.module.to(torch.float64)
    moved.dtype = torch.float64
    try:
        with torch.no_grad():
            out = moved(moved.inputs(1, tokens, seed))
    except Exception as error:  # the finding
        observed = f"after .to(torch.float64): {_describe(error)}"
        return failed(name, TITLES[name], observed, [*causes, "a dtype fixed in the forward"])
    if out.dtype != torch.float64:
        observed = f"after .to(torch.float64) the output is {out.dtype}"
        return failed(name, TITLES[name], observed, ["a dtype fixed in the forward"])
    return passed(name, TITLES[name], "float64 in, float64 out; no plain tensor attributes used")


_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def plain_tensor_attributes(module: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors stored on the module tree as plain attributes (not parameters or buffers)."""
    found = {}
    for prefix, m in module.named_modules():
        for key, value in vars(m).items():
            if key in _MODULE_INTERNALS:  # parameters, buffers, submodules, hooks
                continue
            for leaf in tree_flatten(value)[0]:  # containers too (a dict of masks)
                # a 0-dim constant (a scale) follows any device: not worth a warning
                if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                    found[f"{prefix}.{key}" if prefix else key] = leaf
    return found


class _Watch(TorchFunctionMode):
    """Records which of the watched tensors a torch call receives."""

    def __init__(self, watched: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.ids = {id(t): name for name, t in watched.items()}
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for leaf in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(leaf, torch.Tensor) and id(leaf) in self.ids:
                self.seen.add(self.ids[id(leaf)])
        return func(*args, **(kwargs or {}))


def _used_by_forward(probe: Probe, plain: dict, x: torch.Tensor) -> list[str]:
    if not plain:
        return []
    watch = _Watch(plain)
    with torch.no_grad(), watch, contextlib.suppress(Exception):  # failures: other properties
        probe(x)
    return sorted(watch.seen)


def check_state_dict(
    probe: Probe, tokens: int, seed: int, factory: Callable[[], nn.Module] | None
) -> PropertyResult:
    """Property 7: a fresh instance (from `factory`, else a scrambled copy) loaded with the
    state_dict computes the same output."""
    name = "state_dict_round_trip"
    fresh = factory() if factory is not None else _scrambled_copy(probe.module)
    fresh.to(probe.device).eval()
    try:
        fresh.load_state_dict(probe.module.state_dict())
    except Exception as error:  # the finding
        observed = f"load_state_dict into a fresh instance: {_describe(error)}"
        return failed(name, TITLES[name], observed, ["parameters created differently each time"])
    x = probe.inputs(2, tokens, seed)
    other = Probe(fresh, probe.d_in, probe.context_length, probe.dtype, probe.takes_qkv)
    with torch.no_grad():
        mine, theirs = probe(x), other(x)
    diff = (mine - theirs).abs().nan_to_num(0.0).max()
    if close(mine, theirs, probe.dtype):
        return passed(name, TITLES[name], "same output after the round trip")
    observed = f"the fresh instance's output differs by up to {diff.item():.3g}"
    causes = [
        "state kept outside the state_dict: a plain tensor attribute or a non-persistent "
        "buffer that __init__ does not rebuild the same way",
    ]
    return failed(name, TITLES[name], observed, causes)


def _scrambled_copy(module: nn.Module) -> nn.Module:
    """A copy whose state_dict tensors are overwritten with noise, standing in for a freshly
    constructed instance (plain attributes, rebuilt by __init__, are follows_to's concern)."""
    fresh = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(12345)
    tensors = list(fresh.state_dict(keep_vars=True).values())
    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_floating_point():
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
                tensor.copy_(noise.to(tensor.dtype))
    return fresh


def check_long_input(probe: Probe, seed: int, causal: bool) -> PropertyResult:
    """Property 8: context_length + 1 tokens give a ValueError/TypeError or a correct output
    (finite, and for a causal module equal on the first positions to the shorter input's)."""
    name = "long_input"
    limit = probe.context_length
    if limit is None:
        return skipped(name, TITLES[name], "no context_length found (pass context_length)")
    x = probe.inputs(2, limit + 1, seed)
    try:
        with torch.no_grad():
            out = probe(x)
    except (ValueError, TypeError) as error:
        return passed(name, TITLES[name], f"clear error: {_describe(error)}")
    except Exception as error:  # the finding: an internal error
        observed = f"{limit + 1} tokens: {_describe(error)}"
        causes = [
            f"no check of the input length: raise ValueError when num_tokens > context_length "
            f"({limit}); the mask buffer holds only context_length positions",
        ]
        return failed(name, TITLES[name], observed, causes)
    with torch.no_grad():
        prefix = probe(x[:, :limit])
    consistent = not causal or close(out[:, :limit], prefix, probe.dtype)
    if tuple(out.shape[:2]) == (2, limit + 1) and torch.isfinite(out).all() and consistent:
        return passed(name, TITLES[name], f"{limit + 1} tokens accepted, consistent output")
    observed = f"{limit + 1} tokens give an output inconsistent with the first {limit} alone"
    causes = ["the input is silently truncated, or the mask wraps around past context_length"]
    return failed(name, TITLES[name], observed, causes)


def _describe(error: BaseException) -> str:
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message[:200]}"
