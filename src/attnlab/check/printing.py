"""The audit report on the terminal: a note that the file's code was run, one row per
property (causes under each failure), and the verdict with the exit reason."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from attnlab.check.report import ERROR, FAILED, NOTE, PASSED, WARNING, AuditReport, exit_status

_MARKS = {
    PASSED: "[green]passed[/green]",
    FAILED: "[red]FAILED[/red]",
    WARNING: "[yellow]warning[/yellow]",
    ERROR: "[red]ERROR[/red]",
}


def print_report(
    report: AuditReport, console: Console | None = None, reason: str | None = None
) -> None:
    """A note, a table of the properties and a verdict line.

    Args:
        report: the audit's report.
        console: where to print (default: a new rich Console on stdout).
        reason: the exit reason to print (default: exit_status(report)'s).
    """
    console = console or Console()
    console.print(f"note: {escape(NOTE)}.", highlight=False)
    for line in report.setup:
        console.print(f"set up: {escape(line)}", highlight=False)
    table = Table(title=escape(_title(report)), show_lines=True)
    table.add_column("property")
    table.add_column("result")
    table.add_column("what was seen, and the likely causes")
    for result in report.results:
        detail = result.observed
        if result.causes:
            detail += "".join(f"\n- {cause}" for cause in result.causes)
        table.add_row(result.name, _MARKS.get(result.status, "skipped"), escape(detail))
    console.print(table)
    console.print(escape(reason or exit_status(report)[1]), highlight=False)


def _title(report: AuditReport) -> str:
    context = report.context_length if report.context_length is not None else "unknown"
    if report.kind == "model":
        sizes = f"causal language model, vocab {report.vocab_size}"
    else:
        d_in = report.d_in if report.d_in is not None else "unknown"
        sizes = f"d_in {d_in}"
    causal = "causal" if report.causal else "not causal"
    return f"attnlab check: {report.module} ({sizes}, context_length {context}, {causal})"
