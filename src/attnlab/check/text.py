"""The audit report on the terminal: one row per property, causes under each failure."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from attnlab.check.report import FAILED, PASSED, AuditReport

_MARKS = {PASSED: "[green]passed[/green]", FAILED: "[red]FAILED[/red]"}


def print_report(report: AuditReport, console: Console | None = None) -> None:
    """A table of the properties and a verdict line."""
    console = console or Console()
    context = report.context_length if report.context_length is not None else "unknown"
    table = Table(
        title=f"attnlab check: {report.module} (d_in {report.d_in}, context_length {context}, "
        f"{'causal' if report.causal else 'not causal'})",
        show_lines=True,
    )
    table.add_column("property")
    table.add_column("result")
    table.add_column("what was seen, and the likely causes")
    for result in report.results:
        detail = result.observed
        if result.causes:
            detail += "".join(f"\n- {cause}" for cause in result.causes)
        table.add_row(result.name, _MARKS.get(result.status, "skipped"), detail)
    console.print(table)
    verdict = (
        "every applicable property passed"
        if report.ok
        else (f"{len(report.failed)} failed: {', '.join(report.failed)}")
    )
    console.print(verdict)
