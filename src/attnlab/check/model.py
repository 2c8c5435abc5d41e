"""Auditing a whole causal language model: token ids (batch, tokens) in, logits
(batch, tokens, vocab) out (a tensor, the first of a tuple, or an output with `.logits`).

Properties: it runs; no future leak through any layer (changing later tokens leaves earlier
logits unchanged, and a prefix alone gives the same logits; a leak is traced to the first
layers whose output leaks while their input does not); batch independence; determinism in
eval; finite logits and gradients; and, where the forward takes them, left-padding
invariance with an HF-style attention_mask (and position_ids from it) and cached
generation equal to the full forward.

The cache is found by probing, not by one hard-coded name (transformers 5.24 renamed
`past_key_values` to `cache`, in the forward and its output): the forward's argument is
the first parameter annotated with a cache class (a class named `...Cache`, such as
transformers' `Cache`), else the first of CACHE_NAMES it takes; the returned cache is the
output field holding a cache (an object with `get_seq_length` or of a class named
`...Cache`, or the legacy tuple of per-layer (key, value) tensors), whatever its name.

Shapes: ids (b, t); logits (b, t, v).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from attnlab.check.properties import BATCH_MIXING_CAUSES
from attnlab.check.report import (
    AuditReport,
    PropertyResult,
    failed,
    joined,
    passed,
    skipped,
    warning,
)
from attnlab.check.runner import Step, describe, user_code

_SEED = 0
PROBE_TOKENS = 12  # enough positions to see a leak; small enough for any model
PAD = 3  # left-padding tokens
# names a forward's cache argument has gone by, in order of preference (transformers 5.24+:
# cache; before: past_key_values; older layers and GPT-2 v2: past, layer_past; Mamba's
# cache_params); an exact match only, so cache_position or use_cache never count
CACHE_NAMES = (
    "cache",
    "past_key_values",
    "past_key_value",
    "kv_cache",
    "past",
    "layer_past",
    "cache_params",
)

TITLES = {
    "runs": "token ids (batch, tokens) give logits (batch, tokens, vocab)",
    "causal": "no future leak: later tokens leave earlier logits unchanged; a prefix alone "
    "gives the same logits",
    "batch_independent": "one row's logits do not depend on the other rows",
    "deterministic": "two calls in eval mode give the same logits",
    "finite_gradients": "finite logits and gradients of a next-token loss",
    "left_padding": "left-padded rows (attention_mask 0 on the padding) give the unpadded logits",
    "kv_cache": "generating token by token with the KV cache gives the full forward's logits",
}


@dataclass
class ModelProbe:
    """A private copy of a model, what its forward accepts and the sizes to probe with."""

    module: nn.Module
    vocab_size: int
    context_length: int | None
    accepts: set[str] = field(default_factory=set)
    cache_argument: str | None = None  # the forward's cache parameter (find_cache_argument)

    @property
    def tokens(self) -> int:
        """Sequence length of the probes: PROBE_TOKENS, or less within the context."""
        return min(PROBE_TOKENS, self.context_length or PROBE_TOKENS)

    def raw(self, ids: torch.Tensor, **kwargs):
        """The forward's output as it is, with what it raises marked as the model's; a
        forward taking `targets` is given the ids as targets, so that it returns the logits
        of every position (nanoGPT's GPT returns the last one's alone without them)."""
        with user_code():
            return self.module(ids, **kwargs, **_targets(self.module, ids, kwargs))

    def __call__(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """The logits (b, t, v) for ids (b, t)."""
        out = logits_of(self.raw(ids, **kwargs))
        if out.shape != (*ids.shape, self.vocab_size):
            shape = (*ids.shape, self.vocab_size)
            raise ValueError(f"expected logits {shape}, the model returned {tuple(out.shape)}")
        return out

    def ids(self, batch: int, tokens: int, seed: int) -> torch.Tensor:
        """Random token ids (batch, tokens) from a private generator."""
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.vocab_size, (batch, tokens), generator=generator)
        return ids.to(self.device)

    @property
    def device(self) -> torch.device:
        tensor = next(iter(self.module.parameters()), None)
        return tensor.device if tensor is not None else torch.device("cpu")


def logits_of(out: object) -> torch.Tensor:
    """The logits in a forward's output: a tensor, `.logits`, ['logits'] or the first item."""
    if isinstance(out, dict) and "logits" in out:
        out = out["logits"]
    elif hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, tuple | list) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}, not logits")
    return out


def _targets(module: nn.Module, ids: torch.Tensor, given: dict) -> dict:
    """{"targets": ids} for a forward with a `targets` parameter not given, else {}."""
    try:
        names = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}
    wanted = "targets" in names and "targets" not in given
    return {"targets": ids.contiguous()} if wanted else {}  # .view(-1) in its loss


def takes_token_ids(module: nn.Module) -> bool:
    """True when the module looks like a language model: it holds an nn.Embedding and
    token ids (1, 2) give a (1, 2, vocab) float output. What it raises means no."""
    tables = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        return False
    ids = torch.zeros(1, 2, dtype=torch.long, device=tables[0].weight.device)
    was_training = module.training
    try:
        module.eval()
        with torch.no_grad(), user_code():
            out = logits_of(module(ids, **_targets(module, ids, {})))
    except Exception:  # not a model taking token ids: audited as attention
        return False
    finally:
        module.train(was_training)
    return out.dim() == 3 and tuple(out.shape[:2]) == (1, 2) and out.is_floating_point()


def make_model_probe(module: nn.Module, context_length: int | None = None) -> ModelProbe:
    """A ModelProbe on a copy of `module` in eval mode, its vocabulary from its logits.

    Args:
        module: the model (never changed).
        context_length: its longest input; read from the module or its config when None.

    Returns:
        The ModelProbe.

    Raises:
        TypeError: module is not an nn.Module.
        ValueError: it holds no nn.Embedding, or context_length below 1.
    """
    from attnlab.check.probe import infer_context_length

    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if context_length is not None and (
        not isinstance(context_length, int) or isinstance(context_length, bool)
    ):
        raise TypeError(f"context_length must be an int or None, got {context_length!r}")
    if context_length is not None and context_length < 1:
        raise ValueError(f"context_length must be at least 1, got {context_length}")
    tables = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        raise ValueError(f"{type(module).__name__} holds no nn.Embedding: not a language model")
    with user_code():
        private = copy.deepcopy(module).eval()
    context = context_length or infer_context_length(module) or _position_table(module)
    probe = ModelProbe(
        private, min(tables), context, _accepted(private), find_cache_argument(private)
    )
    with torch.no_grad():
        width = logits_of(probe.raw(probe.ids(1, 1, _SEED))).shape[-1]
    probe.vocab_size = min(width, max(tables))  # ids must index the token table
    return probe


def _position_table(module: nn.Module) -> int | None:
    """Rows of a learned position embedding (pos_emb, wpe, position_embeddings), if any."""
    for name, table in module.named_modules():
        leaf = name.rpartition(".")[2].lower()
        if isinstance(table, nn.Embedding) and ("pos" in leaf or leaf == "wpe"):
            return table.num_embeddings
    return None


def _parameters(module: nn.Module) -> dict[str, inspect.Parameter]:
    """The forward's parameters by name; none when its signature cannot be read."""
    try:
        return dict(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return {}


def _accepted(module: nn.Module) -> set[str]:
    return set(_parameters(module))


def find_cache_argument(module: nn.Module) -> str | None:
    """The name of the forward's KV-cache parameter, found by probing its signature.

    The first parameter (that can be given by keyword) annotated with a cache class wins:
    an annotation naming a class called `...Cache` or derived from one (transformers'
    `Cache | None`, a string annotation too), so a future rename is followed. Else the
    first of CACHE_NAMES, in that order, that the forward takes (exact names:
    `cache_position` and `use_cache` are not caches).

    Args:
        module: the model whose forward is read (not called).

    Returns:
        The parameter's name, or None when the forward takes no cache.
    """
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = {n: p for n, p in _parameters(module).items() if p.kind in keyword}
    for name, parameter in parameters.items():
        if _names_a_cache(parameter.annotation):
            return name
    return next((name for name in CACHE_NAMES if name in parameters), None)


def _names_a_cache(annotation: object) -> bool:
    """True for an annotation naming a class called ...Cache (a union or a string too)."""
    if isinstance(annotation, str):
        return re.search(r"Cache\b", annotation) is not None
    if isinstance(annotation, type):
        return any(cls.__name__.endswith("Cache") for cls in annotation.__mro__)
    return any(_names_a_cache(arg) for arg in typing.get_args(annotation))


def _is_cache(value: object) -> bool:
    """A KV cache: an object with get_seq_length or of a class named ...Cache, or the legacy
    tuple of per-layer tuples of tensors."""
    if isinstance(value, torch.Tensor) or value is None:
        return False
    if callable(getattr(value, "get_seq_length", None)):
        return True
    if type(value).__name__.endswith("Cache"):
        return True
    return (
        isinstance(value, tuple | list)
        and bool(value)
        and all(
            isinstance(layer, tuple | list)
            and bool(layer)
            and all(isinstance(x, torch.Tensor) for x in layer)
            for layer in value
        )
    )


def find_returned_cache(out: object, argument: str | None = None) -> tuple[object, str] | None:
    """The KV cache in a forward's output and where it was, whatever the field's name.

    Looks at `argument`'s field first (a forward commonly returns its cache under the name
    it takes it), then at every other field: the items of a mapping (a transformers
    ModelOutput, `.cache`; a dict, `['cache']`), the fields of a named tuple, a dataclass
    or a plain object, or the items after the first of a tuple (`[1]`).

    Args:
        out: the forward's output.
        argument: the forward's cache parameter, when known.

    Returns:
        (cache, where) with `where` as `.name`, `['name']` or `[i]`; None when the output
        holds no cache.
    """
    if isinstance(out, tuple | list) and not hasattr(out, "_fields"):
        found = ((out[i], f"[{i}]") for i in range(1, len(out)))
        return next(((v, w) for v, w in found if _is_cache(v)), None)
    if isinstance(out, Mapping):
        plain = type(out) is dict
        fields = [(k, v, f"[{k!r}]" if plain else f".{k}") for k, v in out.items()]
    else:
        if hasattr(out, "_fields"):
            names = list(out._fields)
        elif dataclasses.is_dataclass(out):
            names = [f.name for f in dataclasses.fields(out)]
        else:
            names = list(getattr(out, "__dict__", {}))
        names += [n for n in (argument, *CACHE_NAMES) if n and n not in names]
        fields = [(n, getattr(out, n, None), f".{n}") for n in names]
    fields.sort(key=lambda item: item[0] != argument)  # the argument's own name first
    return next(((v, w) for k, v, w in fields if k != "logits" and _is_cache(v)), None)


def new_report(name: str, probe: ModelProbe) -> AuditReport:
    """An empty model report for `probe`."""
    return AuditReport(
        name, True, None, probe.context_length, kind="model", vocab_size=probe.vocab_size
    )


def plan(probe: ModelProbe) -> list[tuple[str, str]]:
    """(name, title) of every model property, in order."""
    return list(TITLES.items())


def audit_model(module: nn.Module, *, context_length: int | None = None) -> AuditReport:
    """Audit a causal language model in this process (no time limit).

    Args:
        module: token ids (batch, tokens) -> logits (batch, tokens, vocab); never changed.
        context_length: its longest input; read from the module when None.

    Returns:
        The AuditReport (kind "model").

    Raises:
        TypeError: module is not an nn.Module, or context_length not an int.
        ValueError: no nn.Embedding in the module, or context_length below 1.
    """
    from attnlab.check import source_files
    from attnlab.check.runner import run_step

    probe = make_model_probe(module, context_length)
    report = new_report(type(module).__name__, probe)
    for step in model_steps(probe, report):
        report.results.append(run_step(step, source_files(module)))
    return report


def model_steps(probe: ModelProbe, report: AuditReport) -> Iterator[Step]:
    """The model's properties in order; after `runs` fails on every input, the rest skip."""
    ran: dict = {}

    def runs() -> PropertyResult:
        result = check_runs(probe)
        ran["ok"] = not result.failed
        if result.failed and "raised" in result.observed:
            report.incomplete = f"the model raised on every input ({result.observed})"
        return result

    yield "runs", TITLES["runs"], runs
    checks = {
        "causal": check_causal,
        "batch_independent": check_batch_independent,
        "deterministic": check_deterministic,
        "finite_gradients": check_finite_gradients,
        "left_padding": check_left_padding,
        "kv_cache": check_kv_cache,
    }
    for name, check in checks.items():
        if ran.get("ok"):
            yield name, TITLES[name], lambda check=check: check(probe)
        else:
            why = "the model did not run on token ids"
            yield name, TITLES[name], lambda name=name, why=why: skipped(name, TITLES[name], why)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    atol = 2e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-4
    return a.shape == b.shape and torch.allclose(a, b, atol=atol, rtol=atol, equal_nan=True)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().nan_to_num(0.0).max().item()


def check_runs(probe: ModelProbe) -> PropertyResult:
    """Batch 1 and 2, 1, 2 and probe.tokens tokens: logits (b, t, vocab)."""
    name, problems, worked = "runs", [], 0
    for batch in (1, 2):
        for tokens in sorted({1, min(2, probe.tokens), probe.tokens}):
            try:
                with torch.no_grad():
                    probe(probe.ids(batch, tokens, _SEED))
                worked += 1
            except Exception as raised:  # the finding
                problems.append(f"batch {batch}, {tokens} tokens: {describe(raised)}")
    if not problems:
        return passed(name, TITLES[name], f"logits (batch, tokens, {probe.vocab_size})")
    observed = "; ".join(problems[:3]) + ("" if worked else " (raised on every input)")
    causes = ["the forward fails or reshapes wrongly for some batch sizes or lengths"]
    return failed(name, TITLES[name], observed, causes)


def check_causal(probe: ModelProbe) -> PropertyResult:
    """Changing tokens from `start` on leaves logits before `start` unchanged, and the
    prefix alone gives the same logits; a leak is traced to the layers where it starts."""
    name, t = "causal", probe.tokens
    if t < 2:
        return skipped(name, TITLES[name], "needs a context of at least 2 tokens")
    ids = probe.ids(2, t, _SEED)
    with torch.no_grad():
        full = probe(ids)
        for start in sorted({1, t // 2, t - 1}):
            changed = ids.clone()
            changed[:, start:] = (ids[:, start:] + 1 + probe.ids(2, t - start, start)) % (
                probe.vocab_size
            )
            after = probe(changed)[:, :start]
            if not _close(after, full[:, :start]):
                return _leak(probe, ids, changed, start, _gap(after, full[:, :start]))
            prefix = probe(ids[:, :start])
            if not _close(prefix, full[:, :start]):
                observed = (
                    f"the first {start} tokens alone give other logits than within {t} tokens "
                    f"(max |difference| {_gap(prefix, full[:, :start]):.3g}), though later "
                    "tokens do not change them"
                )
                causes = [
                    "positions counted from the end of the sequence or scaled by its length",
                    "a statistic over the whole padded length, or a mask sized by the input",
                ]
                return failed(name, TITLES[name], observed, causes)
    return passed(name, TITLES[name], f"checked at {t} tokens, from positions 1, {t // 2}, {t - 1}")


def _leak(probe: ModelProbe, ids, changed, start: int, gap: float) -> PropertyResult:
    name = "causal"
    observed = (
        f"changing tokens {start} onward changed the logits before position {start} "
        f"(max |difference| {gap:.3g})"
    )
    layers = leaking_layers(probe, ids, changed, start)
    if layers:
        observed += f"; the leak starts in {', '.join(layers)}"
    causes = [
        "a layer attends to later tokens: no causal mask, is_causal missing, or a mask of "
        "the wrong polarity (a bidirectional layer)",
        "a statistic over the tokens (a mean, a norm or a softmax over dim=1) mixes later "
        "tokens into earlier positions",
    ]
    return failed(name, TITLES[name], observed, causes)


def leaking_layers(probe: ModelProbe, ids, changed, start: int) -> list[str]:
    """Submodules whose output before `start` differs between the two inputs while their
    inputs there are equal, innermost first (at most 3): where the leak begins."""
    first, second = _record(probe, ids), _record(probe, changed)
    leaking = []
    for name, (ins_a, out_a) in first.items():
        ins_b, out_b = second.get(name, (None, None))
        if out_b is None or len(ins_a) != len(ins_b):
            continue
        inputs_equal = all(
            _close(a[:, :start], b[:, :start]) for a, b in zip(ins_a, ins_b, strict=True)
        )
        if inputs_equal and not _close(out_a[:, :start], out_b[:, :start]):
            leaking.append(name)
    innermost = [n for n in leaking if not any(o.startswith(f"{n}.") for o in leaking)]
    return [f"{n} ({type(probe.module.get_submodule(n)).__name__})" for n in innermost[:3]]


def _record(probe: ModelProbe, ids: torch.Tensor) -> dict:
    """name -> (batch-first tensor inputs, output) of each submodule's first call."""
    seen: dict = {}
    b, t = ids.shape

    def batch_first(x) -> bool:
        return isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[:2]) == (b, t)

    def hook(name):
        def record(module, args, kwargs, out):
            out = out[0] if isinstance(out, tuple | list) and out else out
            ins = [a for a in (*args, *kwargs.values()) if batch_first(a)]
            if name not in seen and batch_first(out) and ins:
                seen[name] = ([a.detach().float() for a in ins], out.detach().float())

        return record

    handles = [
        m.register_forward_hook(hook(n), with_kwargs=True)
        for n, m in probe.module.named_modules()
        if n
    ]
    try:
        with torch.no_grad():
            probe(ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def check_batch_independent(probe: ModelProbe) -> PropertyResult:
    """Each row's logits equal its logits alone."""
    name = "batch_independent"
    ids = probe.ids(3, probe.tokens, _SEED)
    with torch.no_grad():
        together = probe(ids)
        for row in range(3):
            alone = probe(ids[row : row + 1])[0]
            if not _close(together[row], alone):
                observed = (
                    f"row {row}'s logits change with the rest of the batch (max |difference| "
                    f"{_gap(together[row], alone):.3g})"
                )
                return failed(name, TITLES[name], observed, BATCH_MIXING_CAUSES)
    return passed(name, TITLES[name], "3 rows, each equal to its logits alone")


def check_deterministic(probe: ModelProbe) -> PropertyResult:
    """Two calls in eval mode give the same logits."""
    name = "deterministic"
    ids = probe.ids(2, probe.tokens, _SEED)
    with torch.no_grad():
        first, second = probe(ids), probe(ids)
    if torch.equal(first.nan_to_num(), second.nan_to_num()):
        return passed(name, TITLES[name], "two calls, equal logits")
    causes = [
        "dropout applied in eval mode (F.dropout(..., training=True), or a dropout that "
        "ignores self.training)",
        "another source of randomness, or state kept between calls",
    ]
    observed = f"two calls differ by up to {_gap(first, second):.3g}"
    return failed(name, TITLES[name], observed, causes)


def check_finite_gradients(probe: ModelProbe) -> PropertyResult:
    """Finite logits and gradients of the next-token cross-entropy; parameters without a
    gradient are a warning (a model may hold unused parameters)."""
    name = "finite_gradients"
    model = copy.deepcopy(probe.module)
    copied = dataclasses.replace(probe, module=model)
    ids = probe.ids(2, probe.tokens, _SEED)
    logits = copied(ids)
    if not torch.isfinite(logits).all():
        observed = f"{int((~torch.isfinite(logits)).sum())} non-finite logits"
        return failed(name, TITLES[name], observed, ["a fully masked softmax row gives NaN"])
    target = torch.roll(ids, -1, dims=1)  # next tokens; the last one wraps, harmless here
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
    with user_code():
        loss.backward()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    bad = [n for n, p in params if p.grad is not None and not torch.isfinite(p.grad).all()]
    if bad:
        observed = f"non-finite gradients for {joined(bad, 5)}"
        return failed(name, TITLES[name], observed, ["NaN in the backward of a masked softmax"])
    missing = [n for n, p in params if p.grad is None]
    if missing:
        return warning(name, TITLES[name], f"no gradient reaches {joined(missing, 5)}")
    return passed(name, TITLES[name], f"{len(params)} parameters, all with finite gradients")


def check_left_padding(probe: ModelProbe) -> PropertyResult:
    """A row left-padded by PAD tokens, with attention_mask 0 there (and position_ids
    from the mask when the forward takes them), gives the unpadded row's logits."""
    name, t = "left_padding", probe.tokens
    if "attention_mask" not in probe.accepts:
        return skipped(name, TITLES[name], "the forward takes no attention_mask")
    if probe.context_length is not None and t + PAD > probe.context_length:
        t = probe.context_length - PAD
    if t < 1:
        return skipped(name, TITLES[name], f"the context is too short to pad by {PAD}")
    ids = probe.ids(2, t + PAD, _SEED)
    padded = ids.clone()
    padded[0, :PAD] = 0  # row 0: PAD padding tokens, then its t real ones
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    kwargs = {"attention_mask": mask}
    if "position_ids" in probe.accepts:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)  # (b, t)
    with torch.no_grad():
        both = probe(padded, **kwargs)
        short = probe(ids[:1, PAD:])[0]
        full = probe(ids[1:])[0]
    if _close(both[0, PAD:], short) and _close(both[1], full):
        with_positions = " and position_ids" if "position_ids" in kwargs else ""
        observed = f"{PAD} padding tokens masked with attention_mask{with_positions}"
        return passed(name, TITLES[name], observed)
    observed = (
        f"the left-padded row's logits differ from the row alone by up to "
        f"{_gap(both[0, PAD:], short):.3g}"
    )
    causes = [
        "the attention_mask is ignored, or read with the wrong polarity (1 = a real token)",
        "positions count the padding: take position_ids from attention_mask.cumsum(-1) - 1",
    ]
    return failed(name, TITLES[name], observed, causes)


def check_kv_cache(probe: ModelProbe) -> PropertyResult:
    """Half the tokens at once (with use_cache=True where the forward takes it), then one at
    a time with the returned cache, give the full forward's logits at every position; the
    cache is passed and found under whatever names the model uses (find_cache_argument,
    find_returned_cache), and `observed` says which."""
    name, t = "kv_cache", probe.tokens
    argument = probe.cache_argument
    if argument is None:
        why = (
            "the forward takes no cache argument (looked for a parameter annotated as a "
            f"Cache or named {', '.join(CACHE_NAMES)})"
        )
        return skipped(name, TITLES[name], why)
    if t < 2:
        return skipped(name, TITLES[name], "needs a context of at least 2 tokens")
    use = {"use_cache": True} if "use_cache" in probe.accepts else {}
    asked = "use_cache=True" if use else "the first call"
    ids = probe.ids(2, t, _SEED)
    first = t // 2
    with torch.no_grad():
        full = probe(ids)
        out = probe.raw(ids[:, :first], **use)
        steps, where = [logits_of(out)], None
        for i in range(first, t):
            found = find_returned_cache(out, argument)
            if found is None:
                why = (
                    f"{asked} returned no cache after {i} tokens (the forward takes "
                    f"`{argument}=`; looked for a field holding a Cache or a tuple of "
                    "per-layer tensors)"
                )
                return skipped(name, TITLES[name], why)
            cache, where = found
            out = probe.raw(ids[:, i : i + 1], **{argument: cache}, **use)
            steps.append(logits_of(out))
    cached = torch.cat(steps, dim=1)  # (b, t, v)
    names = f"cache passed as `{argument}=`, returned as `{where}`"
    if _close(cached, full):
        return passed(name, TITLES[name], f"{names}; {first} tokens, then {t - first} one by one")
    position = next(j for j in range(t) if not _close(cached[:, j], full[:, j]))
    observed = (
        f"cached generation differs from the full forward from position {position} "
        f"(max |difference| {_gap(cached, full):.3g}; {names})"
    )
    causes = [
        "the new token's position ignores the cached length (positions restart at 0)",
        "the cache is appended in the wrong order, or a causal mask is applied to the new "
        "query against the cached keys as if they were the future",
    ]
    return failed(name, TITLES[name], observed, causes)
