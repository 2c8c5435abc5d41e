"""The audit's report: one result per named property, passed, failed (a wrong result: what
was observed and the likely causes, in plain words), warning (a loud limitation, such as a
RuntimeError past the context length: not a wrong result), skipped (and why) or error (the
audit could not run it: a time limit, attnlab's own bug). exit_status turns a report into
the command's exit code and its reason."""

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
    def errors(self) -> list[str]:
        """Names of the properties the audit could not run (time limit, attnlab's bug)."""
        return [result.name for result in self.results if result.status == ERROR]

    def __getitem__(self, name: str) -> PropertyResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(f"no property named {name!r}; known: {[r.name for r in self.results]}")

    def to_dict(self) -> dict:
        """Plain data for --json, with `ok` and the failed names."""
        return {
            **asdict(self),
            "ok": self.ok,
            "failed": self.failed,
            "warnings": self.warnings,
            "errors": self.errors,
        }


EXIT_PASSED, EXIT_FAILED, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3


def exit_status(report: AuditReport, strict: bool = False) -> tuple[int, str]:
    """The command's exit code for `report` and the reason, in words.

    3 when the audit could not finish (report.incomplete, or a property in error: a time
    limit, attnlab's own bug), whatever it found before; else 1 when a property failed (or,
    with strict, gave a warning); else 0.

    Args:
        report: the audit's report.
        strict: count warnings as failures.

    Returns:
        (code, reason).
    """
    unfinished = report.incomplete or (
        f"could not run {', '.join(report.errors)}" if report.errors else None
    )
    failures = report.failed + (report.warnings if strict else [])
    found = f"{len(failures)} failed: {', '.join(failures)}" if failures else ""
    if strict and report.warnings:
        found += f" (--strict counts the warnings: {', '.join(report.warnings)})"
    if unfinished:
        before = f" (before it stopped, {found})" if found else ""
        return EXIT_INCOMPLETE, f"the audit did not finish: {unfinished}{before}"
    if failures:
        return EXIT_FAILED, found
    reason = "every applicable property passed"
    if report.warnings:
        reason += f", with {len(report.warnings)} warning(s): {', '.join(report.warnings)}"
    return EXIT_PASSED, reason


def passed(name: str, title: str, observed: str = "") -> PropertyResult:
    return PropertyResult(name, title, PASSED, observed)


def failed(name: str, title: str, observed: str, causes: list[str]) -> PropertyResult:
    return PropertyResult(name, title, FAILED, observed, list(causes))


def warning(name: str, title: str, why: str) -> PropertyResult:
    return PropertyResult(name, title, WARNING, why)


def skipped(name: str, title: str, why: str) -> PropertyResult:
    return PropertyResult(name, title, SKIPPED, why)


def error(name: str, title: str, why: str) -> PropertyResult:
    return PropertyResult(name, title, ERROR, why)
