"""attnlab.check: audit anyone's attention module for the classic silent bugs.

audit(module) runs named properties on a private copy of the module (yours is never
changed): it runs on several shapes, is causal, keeps batch rows independent, has finite
outputs and gradients reaching every parameter, treats dropout right in eval and train,
follows .to(), survives a state_dict round trip, handles input longer than its context, and
equals the reference computation with its own weights when they follow a known layout.
Each result is passed, failed (what was observed, the likely causes) or skipped (why).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from attnlab.check import properties
from attnlab.check.probe import make_probe
from attnlab.check.reference import check_reference
from attnlab.check.report import AuditReport, PropertyResult, skipped

__all__ = ["AuditReport", "PropertyResult", "audit"]

_SEED = 0


def audit(
    module: nn.Module,
    *,
    causal: bool = True,
    d_in: int | None = None,
    context_length: int | None = None,
    factory: Callable[[], nn.Module] | None = None,
) -> AuditReport:
    """Audit `module`, which maps (batch, tokens, d_in) to (batch, tokens, d_out).

    causal: whether it should be causal (property 2 is skipped when not). d_in and
    context_length are read from the module when not given. factory builds a fresh
    instance for the state_dict round trip (default: a copy with scrambled state).
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    probe = make_probe(module, d_in, context_length)
    probe.module.eval()
    report = AuditReport(type(module).__name__, causal, probe.d_in, probe.context_length)
    runs, tokens = properties.check_runs(probe, _SEED)
    report.results.append(runs)
    if tokens is None:
        report.results += _skip_rest("the module did not run on any input")
        return report
    report.results += [
        properties.check_causal(probe, tokens, _SEED)
        if causal
        else skipped("causal", properties.TITLES["causal"], "audited with causal=False"),
        properties.check_batch_independent(probe, tokens, _SEED),
        properties.check_finite_gradients(probe, tokens, _SEED),
        properties.check_dropout_modes(probe, tokens, _SEED),
        properties.check_follows_to(probe, tokens, _SEED),
        properties.check_state_dict(probe, tokens, _SEED, factory),
        properties.check_long_input(probe, _SEED, causal),
        check_reference(probe, tokens, _SEED, causal),
    ]
    _sharpen_causal(report)
    return report


def _sharpen_causal(report: AuditReport) -> None:
    """When the reference check reproduced the output with one classic bug, that bug is
    the cause of a leak too: say so instead of listing every possible cause."""
    causal, reference = report["causal"], report["reference"]
    if causal.failed and reference.failed and "with the bug" in reference.observed:
        causal.causes = [*reference.causes, "(the reference check reproduces the output with it)"]


def _skip_rest(why: str) -> list[PropertyResult]:
    names = [name for name in properties.TITLES if name != "runs"]
    from attnlab.check.reference import NAME, TITLE

    return [skipped(name, properties.TITLES[name], why) for name in names] + [
        skipped(NAME, TITLE, why)
    ]
