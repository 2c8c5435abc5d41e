"""The parent side of `attnlab check`: run the audit in one child process
(`python -m attnlab.check.worker`), give each step at most `timeout` seconds, and build
the report from the child's events whatever happens to it: a step past its time limit
ends the child, and a child that dies (os._exit, a crash) is reported, never hidden.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import tempfile
import threading
from dataclasses import fields

from attnlab.check.report import AuditReport, PropertyResult, error, skipped

STARTUP_SECONDS = 120.0  # importing torch in the child, on a loaded machine


class UsageError(Exception):
    """The child found a usage error (no such class, arguments that do not fit, ...)."""


def supervise(job: dict, timeout: float) -> AuditReport:
    """Run `job` (the worker's JSON job) in a child process and return its report.

    Args:
        job: target, init, causal, d_in, context_length, seed, model.
        timeout: seconds each step may take before the child is ended.

    Returns:
        The report; report.incomplete says why when the audit could not finish.

    Raises:
        UsageError: the child found a usage error.
    """
    with tempfile.TemporaryFile() as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "attnlab.check.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        events: queue.Queue = queue.Queue()
        threading.Thread(target=_read, args=(child.stdout, events), daemon=True).start()
        try:
            child.stdin.write(json.dumps(job).encode())
            child.stdin.close()
            return _collect(job, events, timeout, child, stderr)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()


def _read(stream, events: queue.Queue) -> None:
    for line in stream:
        try:
            events.put(json.loads(line))
        except json.JSONDecodeError:
            continue
    events.put(None)


def _collect(job, events: queue.Queue, timeout: float, child, stderr) -> AuditReport:
    report = AuditReport(job["target"].rpartition(":")[2], job["causal"], job["d_in"], None)
    planned: list = []
    step, limit = None, STARTUP_SECONDS
    while True:
        try:
            event = events.get(timeout=limit)
        except queue.Empty:
            child.kill()
            what = f"{step[0]} did not finish within {limit:g} s" if step else "no start"
            return _stopped(report, planned, step, f"{what} (--timeout)")
        if event is None:
            code = child.wait()
            tail = _tail(stderr)
            during = step[0] if step else "start-up"
            what = f"the audit process ended (exit code {code}) during {during}"
            return _stopped(report, planned, step, f"{what}{tail}")
        kind = event["event"]
        limit = timeout
        if kind == "start":
            step = (event["name"], event["title"])
        elif kind == "header":
            report, planned = _report(event["report"]), [tuple(p) for p in event["plan"]]
        elif kind == "result":
            report.results.append(PropertyResult(**event["result"]))
            step = None
        elif kind == "final":
            return _report(event["report"])
        elif kind == "usage":
            raise UsageError(event["message"])
        elif kind == "bug":
            return _stopped(report, planned, step, f"attnlab's own bug: {event['message']}")


def _report(data: dict) -> AuditReport:
    names = {f.name for f in fields(AuditReport)}
    values = {k: v for k, v in data.items() if k in names}
    values["results"] = [PropertyResult(**r) for r in data.get("results", [])]
    return AuditReport(**values)


def _stopped(report, planned, step, why: str) -> AuditReport:
    """The report so far, the running step in error and the steps left skipped."""
    if step is not None:
        report.results.append(error(step[0], step[1], why))
    done = {result.name for result in report.results}
    for name, title in planned:
        if name not in done:
            report.results.append(skipped(name, title, "not run: the audit stopped before it"))
    report.incomplete = why
    return report


def _tail(stderr) -> str:
    """': the last line the child wrote on stderr', when there is one."""
    stderr.seek(0)
    lines = [line for line in stderr.read().decode(errors="replace").splitlines() if line.strip()]
    return f": {lines[-1].strip()[:300]}" if lines else ""
