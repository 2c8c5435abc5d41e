"""The audit's report: one result per named property, passed, failed (a wrong result: what
was observed and the likely causes, in plain words), warning (a loud limitation, such as a
RuntimeError past the context length: not a wrong result) or skipped (and why)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PASSED, FAILED, WARNING, SKIPPED = "passed", "failed", "warning", "skipped"


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
    d_in: int
    context_length: int | None
    results: list[PropertyResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no applicable property failed."""
        return not any(result.failed for result in self.results)

    @property
    def failed(self) -> list[str]:
        """Names of the failed properties."""
        return [result.name for result in self.results if result.failed]

    @property
    def warnings(self) -> list[str]:
        """Names of the properties that gave a warning."""
        return [result.name for result in self.results if result.status == WARNING]

    def __getitem__(self, name: str) -> PropertyResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(f"no property named {name!r}; known: {[r.name for r in self.results]}")

    def to_dict(self) -> dict:
        """Plain data for --json, with `ok` and the failed names."""
        return {**asdict(self), "ok": self.ok, "failed": self.failed, "warnings": self.warnings}


def passed(name: str, title: str, observed: str = "") -> PropertyResult:
    return PropertyResult(name, title, PASSED, observed)


def failed(name: str, title: str, observed: str, causes: list[str]) -> PropertyResult:
    return PropertyResult(name, title, FAILED, observed, list(causes))


def warning(name: str, title: str, why: str) -> PropertyResult:
    return PropertyResult(name, title, WARNING, why)


def skipped(name: str, title: str, why: str) -> PropertyResult:
    return PropertyResult(name, title, SKIPPED, why)
