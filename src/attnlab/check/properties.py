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

from attnlab.check import causes as source
from attnlab.check.probe import Probe
from attnlab.check.report import PropertyResult, failed, joined, listed, passed, skipped, warning

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


MAX_TOKENS = 512  # the longest input the properties try (a 131072-token context is not)
LONG_INPUT_CAP = 4096  # long_input is skipped above this context_length


def token_counts(probe: Probe) -> list[int]:
    """Lengths to try: 1, 2, about half of context_length and context_length itself, the
    last at most MAX_TOKENS."""
    top = min(probe.context_length or 8, MAX_TOKENS)
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
    if longest is None and _runs_unbatched(probe, seed):
        probe.unbatched = True  # every later property calls it one row at a time
        why = (
            "unbatched input only: (tokens, d_in) works, (batch, tokens, d_in) does not "
            f"({problems[0]}); the other properties call it one row at a time"
        )
        return warning(name, TITLES[name], why), max(token_counts(probe))
    if not problems:
        observed = f"output (batch, tokens, {widths.pop()})"
        if probe.seq_first:
            observed += "; called with (tokens, batch, d_in), as its batch_first=False says"
        return passed(name, TITLES[name], observed), longest
    causes = ["the forward fails or reshapes wrongly for some batch sizes or token counts"]
    if (
        probe.context_length is None
        and longest is not None
        and not problems_below(problems, longest)
    ):
        causes.insert(
            0,
            f"it runs up to {longest} tokens and fails above: if that is its context length, "
            f"pass --context-length {longest} (attnlab check) or context_length={longest} (audit)",
        )
    if longest == probe.context_length and longest is not None:
        causes.insert(
            0,
            "the mask buffer is not sliced to the input's length: use "
            "self.mask.bool()[:num_tokens, :num_tokens]",
        )
    return failed(name, TITLES[name], joined(problems, 4, "; "), causes), longest


def _runs_unbatched(probe: Probe, seed: int) -> bool:
    """Whether every token count runs as (tokens, d_in) -> (tokens, d_out)."""
    for tokens in token_counts(probe):
        try:
            with torch.no_grad():
                out = probe.call(probe.inputs(1, tokens, seed)[0])
        except Exception:  # not unbatched either: the batched problems are the finding
            return False
        if out.dim() != 2 or out.shape[0] != tokens:
            return False
    return True


def problems_below(problems: list[str], longest: int) -> bool:
    """Whether a problem was seen at `longest` tokens or fewer (not only above it)."""
    counts = [int(p.split(", ")[1].split(" ")[0]) for p in problems if p.startswith("batch ")]
    return any(count <= longest for count in counts)


def check_causal(probe: Probe, tokens: int, seed: int) -> PropertyResult:
    """Property 2: changing tokens after position p leaves outputs up to p unchanged."""
    name = "causal"
    if tokens < 2:
        return skipped(name, TITLES[name], "needs an input of at least 2 tokens that runs")
    x = probe.inputs(2, tokens, seed)
    atol, rtol = tolerances(probe.dtype)
    leaks = {}  # start -> (positions before it that changed, max |difference|)
    with torch.no_grad():
        out = probe(x)
        if not torch.isfinite(out).all():
            return _non_finite_leak(probe, out)
        for start in sorted({1, tokens // 2, tokens - 1}):
            changed = x.clone()
            changed[:, start:] = probe.inputs(2, tokens - start, seed + start)
            diff = (probe(changed)[:, :start] - out[:, :start]).abs().nan_to_num(torch.inf)
            moved = (diff > atol + rtol * out[:, :start].abs()).any(dim=(0, 2))  # (start,)
            if moved.any():
                leaks[start] = (moved.nonzero().flatten().tolist(), diff.max().item())
    if not leaks:
        return passed(name, TITLES[name], f"checked at {tokens} tokens")
    result = _leak(probe, leaks)
    if probe.takes_qkv:  # its mask is the caller's to give, and the audit gives none
        result.observed += (
            "; called as forward(x, x, x) without a mask: a module that takes its mask as an "
            "argument is causal only when the caller passes one (audit it with --no-causal, "
            "or a wrapper that passes the causal mask)"
        )
    return result


def _non_finite_leak(probe: Probe, out: torch.Tensor) -> PropertyResult:
    name = "causal"
    rows = (~torch.isfinite(out)).any(dim=(0, 2)).nonzero().flatten().tolist()
    observed = f"the output holds NaN or inf at positions {rows}: rows with every key masked"
    if rows == [0]:
        causes = [
            "the mask hides the diagonal (a token must see itself): "
            "torch.triu(..., diagonal=1), not diagonal=0"
        ]
    else:
        suspects = source.find_suspects(probe.module)
        causes = source.explain(suspects, ("sdpa_inverted_mask", "masked_fill_discarded"))
        causes = causes or [
            "the mask is inverted: torch.tril where torch.triu(..., diagonal=1) "
            "belongs, or a boolean SDPA mask True where it should be False",
        ]
    return failed(name, TITLES[name], observed, causes)


def _leak(probe: Probe, leaks: dict[int, tuple[list[int], float]]) -> PropertyResult:
    """A leak seen at some starts; one future token visible when only the position just
    before each start moved (seen at a start of 2 or more, to tell it from a wider leak)."""
    name = "causal"
    suspects = source.find_suspects(probe.module)
    start, (positions, gap) = max(leaks.items())
    observed = (
        f"changing tokens {start} onward changed the output at positions {listed(positions)} "
        f"(max |difference| {gap:.3g})"
    )
    one_ahead = start >= 2 and all(moved == [s - 1] for s, (moved, _) in leaks.items())
    if one_ahead:
        observed += ": each query sees the next token"
        causes = source.explain(suspects, ("mask_offset",)) or [
            "the mask is one diagonal too high: torch.triu(..., diagonal=2) where "
            "diagonal=1 belongs (or tril(..., diagonal=1) for the allowed part)"
        ]
        return failed(name, TITLES[name], observed, causes)
    return failed(name, TITLES[name], observed, leak_causes(suspects))


_LEAK_KINDS = (*source.MASK_KINDS, "dropout_before_softmax")


def leak_causes(suspects: list[source.Suspect]) -> list[str]:
    """The causes of a leak: the suspect lines when the source has some, else the generic
    causes that fit the calls the source makes (all of them when it cannot be read)."""
    pointed = source.explain(suspects, _LEAK_KINDS)
    if pointed:
        return pointed
    if not source.has(suspects, "source_read"):
        return list(CAUSAL_CAUSES)
    fits = source.explain(suspects, ("token_reduction",))
    if source.has(suspects, "uses_masked_fill"):
        fits.append(CAUSAL_CAUSES[0])
    if source.has(suspects, "uses_sdpa_mask"):
        fits.append(CAUSAL_CAUSES[1])
    if source.has(suspects, "uses_softmax"):
        fits.append(CAUSAL_CAUSES[3])
    fits.append(CAUSAL_CAUSES[4])
    if not source.has(suspects, "token_reduction"):
        fits.append(_ACROSS_POSITIONS)
    return fits


_ACROSS_POSITIONS = (
    "a statistic over the token axis (a mean, norm or cumulative sum across positions) "
    "computed before or outside the mask: each position sees the whole sequence"
)


# why one row's output would depend on the others: attention modules and whole models alike
BATCH_MIXING_CAUSES = [
    "softmax or another reduction over the batch dimension (dim=0)",
    "a reshape or view that mixes the batch with tokens or heads",
    "statistics over the batch (a BatchNorm) used in eval mode",
]


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
                return failed(name, TITLES[name], observed, BATCH_MIXING_CAUSES)
    return passed(name, TITLES[name], "3 rows, each equal to its output alone")


def check_finite_gradients(probe: Probe, tokens: int, seed: int) -> PropertyResult:
    """Property 4: finite output and gradients, and a gradient for every parameter."""
    name = "finite_gradients"
    probe = probe.copy()
    x = probe.inputs(2, tokens, seed).requires_grad_()
    try:
        out = probe(x)
    except Exception as error:  # a loud limitation: no autograd through this forward here
        why = f"no backward on this device: the forward with gradients raises {_describe(error)}"
        return warning(name, TITLES[name], why)
    if not torch.isfinite(out).all():
        observed = f"{int((~torch.isfinite(out)).sum())} non-finite output values"
        causes = [
            "a query whose every key is masked: softmax over only -inf gives NaN",
            CAUSAL_CAUSES[1],
        ]
        return failed(name, TITLES[name], observed, causes)
    if not out.requires_grad:
        observed = "the output does not require grad: no gradient reaches the input or weights"
        causes = ["the forward detaches its result, or computes it under torch.no_grad()"]
        return failed(name, TITLES[name], observed, causes)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    try:
        (out * weights.to(out)).sum().backward()
    except Exception as error:  # a loud limitation, e.g. a kernel without a CPU backward
        return warning(name, TITLES[name], f"no backward on this device: {_describe(error)}")
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
    """Property 5: eval mode is deterministic, and train mode (dropout raised on a copy when
    the module has none > 0) is right: finite outputs and gradients, dropout applied, the
    mean over many dropout draws equal to the eval output (each row's expected weights
    still sum to 1), and the eval output unchanged afterwards."""
    name = "dropout_modes"
    x = probe.inputs(2, min(tokens, _TRAIN_TOKENS), seed)
    with torch.no_grad():
        first, second = probe(x), probe(x)
    if not torch.equal(first.nan_to_num(), second.nan_to_num()):
        observed = RANDOM_EVAL
        causes = source.explain(source.find_suspects(probe.module), ("sdpa_dropout_always",))
        causes += [
            "dropout applied in eval mode: F.dropout(..., training=True) or a dropout that "
            "ignores self.training (use nn.Dropout, or pass training=self.training)",
            "another source of randomness in the forward",
        ]
        return failed(name, TITLES[name], observed, causes)
    trained = probe.copy()
    rate = dropout_rate(trained.module)
    raised = rate == 0.0 and set_dropout_rate(trained.module, _TRAIN_RATE)
    if rate == 0.0 and not raised:
        return passed(name, TITLES[name], "deterministic in eval; the module has no dropout")
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(seed)
        return _train_mode(trained, x, first, rate or _TRAIN_RATE, raised)


_TRAIN_RATE, _TRAIN_TOKENS, _BIAS_LIMIT = 0.3, 16, 16.0
RANDOM_EVAL = "two calls in eval mode on the same input differ"


def _train_mode(
    trained: Probe, x: torch.Tensor, expected: torch.Tensor, rate: float, raised: bool
) -> PropertyResult:
    """The train-mode half of property 5, on a copy, under a seeded random state."""
    name = "dropout_modes"
    how = f"dropout {rate}" + (" (raised from 0 on a copy)" if raised else "")
    trained.module.train()
    try:
        draws, problem = _dropout_draws(trained, x)
    except Exception as error:  # loud, not wrong
        why = f"eval mode checked; train mode ({how}) raises {_describe(error)}"
        return warning(name, TITLES[name], why)
    if problem:
        return failed(name, TITLES[name], f"train mode ({how}): {problem}", _nan_causes(trained))
    if bool((draws == draws[0]).all()):
        if raised:
            return passed(name, TITLES[name], "deterministic in eval; no dropout applied")
        observed = f"dropout is {rate} but every call in train mode gives the same output"
        return failed(name, TITLES[name], observed, ["the dropout is created but never applied"])
    mean, spread = draws.mean(0), draws.var(0).mean() / draws.shape[0]  # spread: SE²
    bias = ((mean - expected) ** 2).mean() / spread.clamp_min(1e-30)
    if bias > _BIAS_LIMIT:
        observed = (
            f"train mode ({how}): the mean of {draws.shape[0]} dropout draws differs from the "
            f"eval output by up to {(mean - expected).abs().max().item():.3g} "
            f"({bias.sqrt().item():.1f} standard errors): each row's expected weights do not "
            f"sum to 1"
        )
        return failed(name, TITLES[name], observed, _bias_causes(trained))
    trained.module.eval()
    with torch.no_grad():
        after = trained(x)
    if not torch.equal(after.nan_to_num(), expected.nan_to_num()):
        observed = "the eval output changed after calls in train mode"
        causes = ["state updated in train mode (running statistics, a cache) is used in eval"]
        return failed(name, TITLES[name], observed, causes)
    observed = (
        f"deterministic in eval; {how} in train: finite outputs and gradients, the mean of "
        f"{draws.shape[0]} draws equals eval ({bias.sqrt().item():.1f} standard errors)"
    )
    return passed(name, TITLES[name], observed)


def _dropout_draws(trained: Probe, x: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(draws (n, batch, tokens, d_out) of the train-mode output, a problem or '')."""
    xg = x.clone().requires_grad_()
    out = trained(xg)
    if not torch.isfinite(out).all():
        return out[None], f"{int((~torch.isfinite(out)).sum())} non-finite output values"
    if out.requires_grad:
        out.sum().backward()
        grads = [p.grad for p in trained.module.parameters() if p.grad is not None]
        if not all(torch.isfinite(g).all() for g in [*grads, xg.grad] if g is not None):
            return out[None], "non-finite gradients"
    n = 32 if trained.unbatched else max(32, 4096 // x.shape[1])
    with torch.no_grad():
        many = trained(x.repeat(n, 1, 1))  # (n * batch, tokens, d_out): n dropout draws
    many = many.view(n, *x.shape[:2], -1)  # (n, batch, tokens, d_out)
    if not torch.isfinite(many).all():
        return many, f"{int((~torch.isfinite(many)).sum())} non-finite values in {n} draws"
    return many.double(), ""


def _nan_causes(trained: Probe) -> list[str]:
    suspects = source.find_suspects(trained.module)
    return source.explain(suspects, ("dropout_before_softmax",)) or [
        "dropout applied to the scores before the softmax: a dropped -inf becomes NaN "
        "(-inf * 0); apply dropout to the attention weights after the softmax",
        "a fully masked row in train mode only",
    ]


def _bias_causes(trained: Probe) -> list[str]:
    suspects = source.find_suspects(trained.module)
    return source.explain(suspects, ("dropout_before_softmax",)) or [
        "dropout applied before the softmax or the mask (the expected weights change), or a "
        "hand-written dropout without the 1/(1 - p) rescaling of the kept weights",
    ]


def set_dropout_rate(module: nn.Module, rate: float) -> bool:
    """Set every nn.Dropout and float dropout attribute of `module` to `rate`; whether
    there was any."""
    found = False
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p, found = rate, True
        for attribute in _DROPOUT_ATTRIBUTES:
            if isinstance(vars(m).get(attribute), float):
                setattr(m, attribute, rate)
                found = True
    return found


_DROPOUT_ATTRIBUTES = ("dropout", "dropout_p", "attn_dropout", "attn_pdrop", "attention_dropout")


def dropout_rate(module: nn.Module) -> float:
    """The largest dropout probability found: nn.Dropout modules or a float attribute."""
    rates = [m.p for m in module.modules() if isinstance(m, nn.Dropout)]
    for m in module.modules():
        for attribute in _DROPOUT_ATTRIBUTES:
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
    moved = probe.copy()
    moved.module.to(torch.float64)
    moved.dtype = torch.float64
    try:
        with torch.no_grad():
            out = moved(moved.inputs(1, tokens, seed))
    except Exception as error:  # the finding
        if used and _runs_with_them_moved(probe, used, tokens, seed):
            observed = f"the forward uses plain tensor attributes: {', '.join(used)}"
            return failed(name, TITLES[name], observed, causes)
        observed = f"after .to(torch.float64): {_describe(error)}"
        if used:  # they are not the cause: the forward raises with them in float64 too
            observed += (
                f" (it raises with the plain tensor attributes it uses, {', '.join(used)}, "
                f"in float64 too: they are not the cause)"
            )
        return failed(name, TITLES[name], observed, [_FIXED_DTYPE])
    left = [n for n in used if not _moved_by_forward(moved.module, n, torch.float64)]
    if left:  # kept where they were made: a device or dtype they will not follow
        observed = f"the forward uses plain tensor attributes: {', '.join(left)}"
        return failed(name, TITLES[name], observed, causes)
    if out.dtype != torch.float64:
        observed = f"after .to(torch.float64) the output is {out.dtype}"
        return failed(name, TITLES[name], observed, [_FIXED_DTYPE])
    return passed(name, TITLES[name], "float64 in, float64 out; no plain tensor attributes used")


def _runs_with_them_moved(probe: Probe, used: list[str], tokens: int, seed: int) -> bool:
    """Whether the float64 forward runs once the plain tensor attributes it uses are in
    float64 too (on another copy): only then are they why it raised."""
    moved = probe.copy()
    moved.module.to(torch.float64)
    moved.dtype = torch.float64
    for name in used:
        owner_path, _, key = name.rpartition(".")
        owner = moved.module.get_submodule(owner_path) if owner_path else moved.module
        value = vars(owner).get(key)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            setattr(owner, key, value.to(torch.float64))
    try:
        with torch.no_grad():
            moved(moved.inputs(1, tokens, seed))
    except Exception:  # still raises: the attributes are not the cause
        return False
    return True


def _moved_by_forward(module: nn.Module, name: str, dtype: torch.dtype) -> bool:
    """Whether the plain attribute `name` (a dotted path) is, after a forward on float64
    input, a floating tensor of that dtype: the forward moves it itself (Meta's Llama:
    self.cache_k = self.cache_k.to(xq)), so it follows .to() though it is no buffer."""
    owner_path, _, key = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    value = vars(owner).get(key)
    return isinstance(value, torch.Tensor) and value.dtype == dtype


_FIXED_DTYPE = (
    "a dtype fixed in the forward: a tensor made without dtype= (torch.full, torch.ones, "
    "torch.zeros default to float32), filled with another dtype's finfo(...).min, or cast "
    "with .float() and never cast back (.type_as(x)); make it with dtype=x.dtype"
)
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
    other = copy.copy(probe)  # the same way of calling (unbatched too), on the fresh module
    other.module = fresh
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
        why = (
            "no context_length found: pass --context-length N (attnlab check) or "
            "context_length=N (audit)"
        )
        return skipped(name, TITLES[name], why)
    if limit >= LONG_INPUT_CAP:
        why = (
            f"context_length {limit} is at least {LONG_INPUT_CAP}: {limit + 1} tokens would "
            f"need a {limit + 1} x {limit + 1} score matrix per head, too big to try here"
        )
        return skipped(name, TITLES[name], why)
    x = probe.inputs(2, limit + 1, seed)
    try:
        with torch.no_grad():
            out = probe(x)
    except (ValueError, TypeError) as error:
        return passed(name, TITLES[name], f"clear error: {_describe(error)}")
    except Exception as error:  # loud, not wrong: the chapter's deliberate limit
        why = (
            f"{limit + 1} tokens raise {_describe(error)}: a loud limit, not a wrong result; "
            f"a ValueError naming num_tokens and context_length ({limit}) would be clearer"
        )
        return warning(name, TITLES[name], why)
    with torch.no_grad():
        prefix = probe(x[:, :limit].contiguous())
    consistent = not causal or close(out[:, :limit], prefix, probe.dtype)
    if tuple(out.shape[:2]) == (2, limit + 1) and torch.isfinite(out).all() and consistent:
        return passed(name, TITLES[name], f"{limit + 1} tokens accepted, consistent output")
    observed = f"{limit + 1} tokens give an output inconsistent with the first {limit} alone"
    causes = ["the input is silently truncated, or the mask wraps around past context_length"]
    return failed(name, TITLES[name], observed, causes)


def _describe(error: BaseException) -> str:
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message[:200]}"
