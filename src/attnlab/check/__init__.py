"""attnlab.check: audit anyone's attention module for the classic silent bugs.

audit(module) runs named properties on a private copy of the module (yours is never
changed): it runs on several shapes, is causal, keeps batch rows independent, has finite
outputs and gradients reaching every parameter, treats dropout right in eval and train,
follows .to(), survives a state_dict round trip, handles input longer than its context, and
equals the reference computation with its own weights when they follow a known layout.
Each result is passed, failed (what was observed, the likely causes) or skipped (why).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator

from torch import nn

from attnlab.check import properties
from attnlab.check.arguments import known_names
from attnlab.check.probe import Probe, make_probe
from attnlab.check.reference import NAME as REFERENCE
from attnlab.check.reference import TITLE as REFERENCE_TITLE
from attnlab.check.reference import check_reference
from attnlab.check.report import AuditReport, PropertyResult, error, exit_status, skipped
from attnlab.check.runner import Step, describe, from_module, module_raised, run_step

__all__ = ["AuditReport", "PropertyResult", "audit", "exit_status"]

_SEED = 0


def audit(
    module: nn.Module,
    *,
    causal: bool = True,
    d_in: int | None = None,
    context_length: int | None = None,
    factory: Callable[[], nn.Module] | None = None,
) -> AuditReport:
    """Audit `module`, which maps (batch, tokens, d_in) to (batch, tokens, d_out), in this
    process: whatever the module raises becomes a finding, but nothing limits its time (the
    `attnlab check` command runs the audit in a child process with a time limit).

    Args:
        module: the attention module (never changed: the audit runs on a copy).
        causal: whether it should be causal (the causal property is skipped when not).
        d_in: its input width; read from the module when None.
        context_length: its longest input; read from the module when None.
        factory: builds a fresh instance for the state_dict round trip (default: a copy
            with scrambled state).

    Returns:
        The AuditReport (`report.ok`, `report.failed`, `report["causal"]`).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: d_in or context_length below 1, or d_in not given and not found.
    """
    check_arguments(module, causal, d_in, context_length, factory)
    probe = make_probe(module, d_in, context_length, causal=causal)
    report = AuditReport(type(module).__name__, causal, probe.d_in, probe.context_length)
    for step in attention_steps(probe, report, factory):
        report.results.append(run_step(step, source_files(module)))
    finish(report)
    return report


def check_arguments(
    module: object, causal: object, d_in: object, context_length: object, factory: object
) -> None:
    """The checks at audit()'s door (TypeError / ValueError naming the argument)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    for name, value in (("d_in", d_in), ("context_length", context_length)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if factory is not None and not callable(factory):
        raise TypeError(f"factory must be callable or None, got {type(factory).__name__}")


def source_files(module: nn.Module) -> list[str]:
    """The files defining the module's classes (its own code, for telling its errors apart)."""
    files = set()
    for part in module.modules():
        try:
            files.add(inspect.getsourcefile(type(part)))
        except (TypeError, OSError):
            continue
    return sorted(f for f in files if f)


def plan(causal: bool) -> list[tuple[str, str]]:
    """(name, title) of every attention property, in the order they run."""
    return (
        [("runs", properties.TITLES["runs"])]
        + [(name, properties.TITLES[name]) for name in properties.TITLES if name != "runs"]
        + [(REFERENCE, REFERENCE_TITLE)]
    )


def attention_steps(
    probe: Probe, report: AuditReport, factory: Callable[[], nn.Module] | None
) -> Iterator[Step]:
    """The audit's steps, in order; each runs when the consumer calls it, before the next is
    made (later steps use the token count the first one found)."""
    probe.module.eval()
    found: dict = {}

    def runs() -> PropertyResult:
        if probe.needs:  # a call would only raise TypeError: say what it needs instead
            report.incomplete = needs_arguments(probe)
            return error("runs", properties.TITLES["runs"], report.incomplete)
        try:
            result, found["tokens"] = properties.check_runs(probe, _SEED)
        except BaseException as raised:  # SystemExit, KeyboardInterrupt: the audit stops
            if not from_module(raised):
                raise
            result = module_raised("runs", properties.TITLES["runs"], raised)
            report.incomplete = f"the module raised {describe(raised)}"
        else:
            if found["tokens"] is None:
                report.incomplete = _every_input_raised(probe)
        return result

    yield "runs", properties.TITLES["runs"], runs
    tokens = found.get("tokens")
    if tokens is None:
        yield from _skip_rest(report.incomplete or "the module did not run on any input")
        return
    causal = report.causal
    checks = {
        "causal": lambda: (
            properties.check_causal(probe, tokens, _SEED)
            if causal
            else skipped("causal", properties.TITLES["causal"], "audited with causal=False")
        ),
        "batch_independent": lambda: properties.check_batch_independent(probe, tokens, _SEED),
        "finite_gradients": lambda: properties.check_finite_gradients(probe, tokens, _SEED),
        "dropout_modes": lambda: properties.check_dropout_modes(probe, tokens, _SEED),
        "follows_to": lambda: properties.check_follows_to(probe, tokens, _SEED),
        "state_dict_round_trip": lambda: properties.check_state_dict(probe, tokens, _SEED, factory),
        "long_input": lambda: properties.check_long_input(probe, _SEED, causal),
    }
    for name, check in checks.items():
        yield name, properties.TITLES[name], check
    yield REFERENCE, REFERENCE_TITLE, lambda: check_reference(probe, tokens, _SEED, causal)


def needs_arguments(probe: Probe) -> str:
    """Why a forward whose required arguments the check cannot build is not called."""
    return (
        f"the forward needs these arguments: {', '.join(probe.needs)} ({probe.needs_why}); "
        f"the check builds only the ones a model passes under a known name "
        f"({', '.join(known_names())}): audit it through a wrapper whose forward(x) "
        f"passes them"
    )


def finish(report: AuditReport) -> None:
    """After the last step: a leak that the reference reproduces names that bug alone."""
    names = {result.name for result in report.results}
    if "dropout_modes" in names and report["dropout_modes"].observed == properties.RANDOM_EVAL:
        _untrusted_comparisons(report)
    if {"causal", REFERENCE} <= names:
        _sharpen_causal(report)
    if {"causal", "long_input"} <= names and report["causal"].failed:
        _leak_explains_long_input(report)


def _leak_explains_long_input(report: AuditReport) -> None:
    """A leaking module's first positions change when a token is appended: long_input's
    inconsistency is the leak again, reported once, by causal."""
    result = report["long_input"]
    if result.failed and "inconsistent" in result.observed:
        why = "not decided: the module leaks (see causal), so a longer input changes every row"
        report.results[report.results.index(result)] = skipped(result.name, result.title, why)


_COMPARISONS = ("causal", "batch_independent", "state_dict_round_trip", "long_input", REFERENCE)


def _untrusted_comparisons(report: AuditReport) -> None:
    """A module random in eval mode differs from itself: the failures of the properties
    that compare two calls say nothing more; dropout_modes carries the finding."""
    for result in report.results:
        if result.name in _COMPARISONS and result.failed:
            why = (
                "not decided: two eval calls on the same input already differ (see "
                "dropout_modes), so comparing two calls proves nothing"
            )
            report.results[report.results.index(result)] = skipped(result.name, result.title, why)


def _every_input_raised(probe: Probe) -> str | None:
    """Why the audit cannot go on when the module raises even on one token, else None
    (a wrong shape on every input is a failure of `runs`, not an unfinished audit)."""
    try:
        probe(probe.inputs(1, 1, _SEED))
    except BaseException as raised:  # the module's: a finding, whatever it is
        return f"the module raised on every input ({describe(raised)})"
    return None


def _sharpen_causal(report: AuditReport) -> None:
    """When the reference check reproduced the output with one classic bug, that bug is
    the cause of a leak too: say so instead of listing every possible cause."""
    causal, reference = report["causal"], report[REFERENCE]
    if causal.failed and reference.failed and "with the bug" in reference.observed:
        causal.causes = [*reference.causes, "(the reference check reproduces the output with it)"]


def _skip_rest(why: str) -> Iterable[Step]:
    for name, title in plan(True)[1:]:
        yield name, title, lambda name=name, title=title: skipped(name, title, why)
