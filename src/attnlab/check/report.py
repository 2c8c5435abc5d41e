"""The audit's report: one result per named property, passed, failed (a wrong result: what
was observed and the likely causes, in plain words), warning (a loud limitation, such as a
RuntimeError past the context length: not a wrong result), skipped (and why: the property
could not run on this module, never silently) or error (the audit could not run it: a time
limit, attnlab's own bug). exit_status turns a report into the command's exit code and its
reason."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PASSED, FAILED, WARNING, SKIPPED, ERROR = "passed", "failed", "warning", "skipped", "error"
NOTE = "attnlab check imported the file and ran its code (import, constructor, forward, backward)"


@dataclass
class PropertyResult:
    """One property of the audited module."""

    name: str
    title: str
    status: str
    observed: str = ""
    causes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status == FAILED


@dataclass
class AuditReport:
    """Every property's result for one module, in the order they were checked."""

    module: str
    causal: bool
    d_in: int | None
    context_length: int | None
    results: list[PropertyResult] = field(default_factory=list)
    kind: str = "attention"  # or "model": token ids in, logits out
    vocab_size: int | None = None  # a model's
    incomplete: str | None = None  # why the audit could not finish, when it could not
    setup: list[str] = field(default_factory=list)  # what the check did to build and call it

    @property
    def ok(self) -> bool:
        """True when the audit finished and no applicable property failed."""
        return not self.failed and not self.errors and self.incomplete is None

    @property
    def failed(self) -> list[str]:
        """Names of the failed properties."""
        return [result.name for result in self.results if result.failed]

    @property
    def warnings(self) -> list[str]:
        """Names of the properties that gave a warning."""
        return [result.name for result in self.results if result.status == WARNING]

    @property
    def skipped(self) -> list[str]:
        """Names of the properties that were not checked (each result says why)."""
        return [result.name for result in self.results if result.status == SKIPPED]

    @property
    def errors(self) -> list[str]:
        """Names of the properties the audit could not run (time limit, attnlab's bug)."""
        return [result.name for result in self.results if result.status == ERROR]

    def __getitem__(self, name: str) -> PropertyResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(f"no property named {name!r}; known: {[r.name for r in self.results]}")

    def to_dict(self) -> dict:
        """Plain data for --json, with `ok` and the failed, warning, skipped and error names."""
        return {
            **asdict(self),
            "ok": self.ok,
            "failed": self.failed,
            "warnings": self.warnings,
            "skipped": self.skipped,
            "errors": self.errors,
        }


EXIT_PASSED, EXIT_FAILED, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3


def exit_status(report: AuditReport, strict: bool = False) -> tuple[int, str]:
    """The command's exit code for `report` and the reason, in words.

    3 when the audit could not finish (report.incomplete, or a property in error: a time
    limit, attnlab's own bug), whatever it found before; else 1 when a property failed (or,
    with strict, gave a warning or was skipped); else 0, the reason naming the warnings and
    the skipped properties.

    Strict means every property was checked: a skip fails it even where the property does
    not seem to apply (a model that takes no attention_mask skips left_padding), since a
    model that should take one looks the same. The one skip strict forgives is the one the
    caller asked for: `causal` on a report audited with causal=False (--no-causal).

    Args:
        report: the audit's report.
        strict: count warnings and skipped properties as failures.

    Returns:
        (code, reason).
    """
    unfinished = report.incomplete or (
        f"could not run {', '.join(report.errors)}" if report.errors else None
    )
    warnings = report.warnings if strict else []
    skips = strict_skips(report) if strict else []
    failures = report.failed + warnings + skips
    found = f"{len(failures)} failed: {', '.join(failures)}" if failures else ""
    counted = _listed({"the warnings": warnings, "the skipped": skips})
    if counted:
        found += f" (--strict counts {' and '.join(counted)})"
    if unfinished:
        before = f" (before it stopped, {found})" if found else ""
        return EXIT_INCOMPLETE, f"the audit did not finish: {unfinished}{before}"
    if failures:
        return EXIT_FAILED, found
    reason = "every applicable property passed"
    noted = _listed(
        {
            f"{len(report.warnings)} warning(s)": report.warnings,
            f"{len(report.skipped)} skipped": report.skipped,
        }
    )
    if noted:
        reason += f", with {'; '.join(noted)}"
    return EXIT_PASSED, reason


def strict_skips(report: AuditReport) -> list[str]:
    """The skipped properties that --strict counts as failures: all of them but `causal` on
    a report audited with causal=False (the caller turned that property off)."""
    return [name for name in report.skipped if report.causal or name != "causal"]


def _listed(groups: dict[str, list[str]]) -> list[str]:
    """'label: a, b' for each non-empty group, in order."""
    return [f"{label}: {', '.join(names)}" for label, names in groups.items() if names]


def passed(name: str, title: str, observed: str = "") -> PropertyResult:
    return PropertyResult(name, title, PASSED, observed)


def failed(name: str, title: str, observed: str, causes: list[str]) -> PropertyResult:
    """A failed result; each cause once, in the order given (the likeliest first)."""
    return PropertyResult(name, title, FAILED, observed, list(dict.fromkeys(causes)))


def joined(values: list, limit: int, separator: str = ", ") -> str:
    """At most `limit` values joined, saying how many it leaves out: "a, b and 3 more"."""
    shown = separator.join(map(str, values[:limit]))
    left = len(values) - limit
    return f"{shown} and {left} more" if left > 0 else shown


def listed(values: list, limit: int = 6) -> str:
    """values as a list of at most `limit`, saying how many it leaves out: "[0, 1, 2] and
    4 more (7 in all)"."""
    shown = f"[{', '.join(map(str, values[:limit]))}]"
    left = len(values) - limit
    return f"{shown} and {left} more ({len(values)} in all)" if left > 0 else shown


def warning(name: str, title: str, why: str) -> PropertyResult:
    return PropertyResult(name, title, WARNING, why)


def skipped(name: str, title: str, why: str) -> PropertyResult:
    return PropertyResult(name, title, SKIPPED, why)


def error(name: str, title: str, why: str) -> PropertyResult:
    return PropertyResult(name, title, ERROR, why)
