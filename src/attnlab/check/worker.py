"""The child process of `attnlab check`: one child runs the whole audit (import, constructor,
every property), so that the parent can end it at a time limit whatever the module does.
Forked from the parent where that is safe (supervisor.py: it has torch and attnlab imported
already), the child calls `serve(job, channel)`; else `python -m attnlab.check.worker`
reads its job as JSON on stdin. Either way it writes events as JSON lines on its channel;
its own prints, and the audited code's, go to stderr.

Events: ready; start (a step begins: name, title); result (its PropertyResult); header
(the report's fields and the plan, once the module is built); usage (a usage error:
message); final (the finished report); bug (attnlab's own error: message).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict

import torch

from attnlab.check import attention_steps, finish, plan, source_files
from attnlab.check import model as model_audit
from attnlab.check.loader import (
    Factory,
    LoadError,
    adapt_init,
    bind,
    load_class,
    parse_init,
    parse_target,
    sizes_from_init,
)
from attnlab.check.probe import make_probe
from attnlab.check.report import AuditReport, error
from attnlab.check.runner import describe, from_module, run_step

Emit = Callable[..., None]


def main() -> None:
    """Run the job read from stdin (JSON), writing the events on stdout: the spawned
    child's entry."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the module's prints go to stderr, never into the events
    serve(json.loads(sys.stdin.read()), channel)


def serve(job: dict, channel) -> None:
    """Run `job`, writing its events as JSON lines on `channel` (a text file), then leave
    with os._exit, so that no code of the module's (atexit handlers, threads) runs after the
    report: the child's whole life, spawned (main) or forked (supervisor). fd 1 and
    sys.stdout already lead to stderr."""
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # one thread: the audit's tensors are a few tokens wide, and OpenMP threads waiting
    # for each other on a busy machine made an audit take 13-52 s instead of 3 (an outside
    # tester's runs, 2 shared cores); the results are the same
    torch.set_num_threads(1)

    def emit(event: str, **fields) -> None:
        channel.write(json.dumps({"event": event, **fields}) + "\n")

    emit("ready")
    try:
        run_job(job, emit)
    except LoadError as usage:
        emit("usage", message=str(usage))
    except BaseException:  # attnlab's own bug: say so, with where
        emit("bug", message=traceback.format_exc(limit=-3))
    channel.flush()
    os._exit(0)


def run_job(job: dict, emit: Emit) -> None:
    """Load the class, build it, then audit it as a model or an attention module."""
    file, name = parse_target(job["target"])
    args, kwargs = parse_init(job["init"])
    emit("start", name="load", title=LOAD_TITLE)
    try:
        cls = load_class(file, name)
        args, kwargs, adapted = adapt_init(cls, args, kwargs)
        sizes = sizes_from_init(bind(cls, args, kwargs))
        factory = Factory(cls, args, kwargs, job["seed"])
        torch.manual_seed(job["seed"])  # the same weights, the same report, every run
        module = factory()
        setup = [*adapted, *factory.setup]
        is_model = job["model"] or model_audit.takes_token_ids(module)
    except LoadError:
        raise
    except BaseException as raised:
        if not from_module(raised, [str(file)]):
            raise
        emit("final", report=_load_failed(name, job, raised))
        return
    files = [str(file), *source_files(module)]
    if is_model:
        _audit_model(module, name, job, sizes, setup, files, emit)
    else:
        _audit_attention(module, name, job, sizes, setup, factory, files, emit)


LOAD_TITLE = "the file imports and the class builds with --init"


def _audit_attention(module, name, job, sizes, setup, factory, files, emit: Emit) -> None:
    context = job["context_length"] or sizes.get("context_length")
    try:
        d_in, heads = job["d_in"] or sizes.get("d_in"), sizes.get("num_heads")
        probe = make_probe(module, d_in, context, heads, causal=job["causal"])
    except ValueError as usage:
        raise LoadError(str(usage)) from usage
    if probe.extra:
        setup = [*setup, f"forward given {', '.join(probe.extra)}, made as a model makes them"]
    report = AuditReport(name, job["causal"], probe.d_in, probe.context_length, setup=setup)
    emit("header", report=asdict(report), plan=plan(job["causal"]))
    _run(attention_steps(probe, report, factory), report, files, emit)
    finish(report)
    emit("final", report=asdict(report))


def _audit_model(module, name, job, sizes, setup, files, emit: Emit) -> None:
    context = job["context_length"] or sizes.get("context_length")
    probe = model_audit.make_model_probe(module, context)
    report = model_audit.new_report(name, probe)
    report.setup = setup
    emit("header", report=asdict(report), plan=model_audit.plan(probe))
    _run(model_audit.model_steps(probe, report), report, files, emit)
    emit("final", report=asdict(report))


def _run(steps, report: AuditReport, files: list[str], emit: Emit) -> None:
    for step in steps:
        emit("start", name=step[0], title=step[1])
        result = run_step(step, files)
        report.results.append(result)
        emit("result", result=asdict(result))


def _load_failed(name: str, job: dict, raised: BaseException) -> dict:
    """The report when the file's import or the constructor raised."""
    report = AuditReport(name, job["causal"], job["d_in"], job["context_length"])
    where = "importing the file or building the class"
    report.results.append(error("load", LOAD_TITLE, f"{where} raised {describe(raised)}"))
    report.incomplete = f"{where} raised {describe(raised)}"
    return asdict(report)


if __name__ == "__main__":
    main()
