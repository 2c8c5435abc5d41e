"""The parent side of `attnlab check`: run the audit in one child process, give each step
at most `timeout` seconds, and build the report from the child's events whatever happens to
it: a step past its time limit ends the child, and a child that dies (os._exit, a crash) is
reported, never hidden.

The child is this process forked where that is safe (Linux, no other Python thread, CUDA
not initialised): it starts with torch and attnlab already imported, where a fresh
interpreter (`python -m attnlab.check.worker`, the other way, and the only one elsewhere)
spends most of an audit's seconds importing them again.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import fields

from attnlab.check.report import AuditReport, PropertyResult, error, skipped

STARTUP_SECONDS = 120.0  # importing torch in the child, on a loaded machine
STARTS = ("fork", "spawn")


class UsageError(Exception):
    """The child found a usage error (no such class, arguments that do not fit, ...)."""


def supervise(job: dict, timeout: float, start: str | None = None) -> AuditReport:
    """Run `job` (the worker's JSON job) in a child process and return its report.

    Args:
        job: target, init, causal, d_in, context_length, seed, model.
        timeout: seconds each step may take before the child is ended.
        start: "fork" (this process forked: nothing imported again), "spawn" (a fresh
            interpreter), or None: fork where it is safe (`fork_is_safe`), else spawn.

    Returns:
        The report; report.incomplete says why when the audit could not finish.

    Raises:
        UsageError: the child found a usage error.
        ValueError: start is not one of STARTS, or "fork" where fork_is_safe() is False.
    """
    if start is not None and start not in STARTS:
        raise ValueError(f"start must be one of {STARTS} or None, got {start!r}")
    if start == "fork" and not fork_is_safe():
        raise ValueError("start='fork' where forking is not safe (see fork_is_safe)")
    forked = start == "fork" or (start is None and fork_is_safe())
    with tempfile.TemporaryFile() as stderr:
        child = _Forked(job, stderr) if forked else _spawn(job, stderr)
        events: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_read, args=(child.stdout, events), daemon=True)
        reader.start()
        try:
            return _collect(job, events, timeout, child, stderr)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
            reader.join(timeout=1.0)  # the pipe's end seen: this process is one thread again
            if not reader.is_alive():  # else a grandchild holds the pipe: left to the reader
                child.stdout.close()


def fork_is_safe() -> bool:
    """Whether the child can be this process forked: on Linux (macOS's system libraries
    are not fork-safe), with no other Python thread (none can hold a lock the child would
    inherit held; torch's own worker threads are reset at fork, as its DataLoader relies
    on), and CUDA not initialised (a forked child cannot use it)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    if threading.active_count() != 1:
        return False
    cuda = sys.modules.get("torch.cuda")
    return not (cuda is not None and cuda.is_initialized())


def _spawn(job: dict, stderr) -> subprocess.Popen:
    """A fresh interpreter running the worker, the job written on its stdin."""
    child = subprocess.Popen(
        [sys.executable, "-m", "attnlab.check.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    child.stdin.write(json.dumps(job).encode())
    child.stdin.close()
    return child


class _Forked:
    """The child as this process forked, with the parts of Popen the parent uses: stdout
    (the events), poll, kill, wait. The child runs worker.serve and never returns."""

    def __init__(self, job: dict, stderr) -> None:
        from attnlab.check import worker  # imported here: the child finds it loaded

        read, write = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # nothing buffered is written twice
                stream.flush()
        with warnings.catch_warnings():
            # Python 3.12+ warns at any fork of a process with threads, and torch's import
            # starts idle ones; fork_is_safe has checked that no Python thread runs
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child
            try:
                os.close(read)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(stderr.fileno(), 2)
                os.dup2(2, 1)  # the module's prints go to stderr, never into the events
                sys.stdin = open(os.devnull)  # noqa: SIM115 (the child's own, to its end)
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                worker.serve(job, os.fdopen(write, "w", buffering=1))
            finally:
                os._exit(70)  # serve leaves with os._exit(0): reached only if it raised
        os.close(write)
        self.pid, self.returncode = pid, None
        self.stdout = os.fdopen(read, "rb")

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


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
