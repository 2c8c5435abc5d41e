"""attnlab check survives hostile and broken modules: each gives a report (table or JSON)
and the right exit code, never a traceback, a hang or exit 0 with no report."""

import json
import sys
import threading
import types

import pytest

from attnlab import cli
from attnlab.check.report import exit_status
from attnlab.check.supervisor import fork_is_safe, supervise

HEADER = """
import os, sys, time
import torch
import torch.nn.functional as F
from torch import nn


class Base(nn.Module):
    def __init__(self, d_in=4):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_in)

    def attend(self, x):
        return F.scaled_dot_product_attention(*(self.W_query(x),) * 3, is_causal=True)
"""

MODULES = {
    "exit_in_forward": "class M(Base):\n    def forward(self, x):\n        sys.exit(0)\n",
    "interrupt_in_forward": (
        "class M(Base):\n    def forward(self, x):\n        raise KeyboardInterrupt\n"
    ),
    "sleeps_forever": "class M(Base):\n    def forward(self, x):\n        time.sleep(10**6)\n",
    "os_exit": "class M(Base):\n    def forward(self, x):\n        os._exit(0)\n",
    "exit_at_import": "sys.exit(0)\nclass M(Base):\n    pass\n",
    "exit_in_constructor": "class M(Base):\n    def __init__(self):\n        sys.exit(0)\n",
    # fails only in a later property: batch_independent is the first to call with 3 rows
    "later_exception": (
        "class M(Base):\n    def forward(self, x):\n"
        "        if x.shape[0] == 3 and x.shape[1] > 1:\n"
        "            raise RuntimeError('three rows')\n"
        "        return self.attend(x)\n"
    ),
    "no_cpu_backward": (
        "class NoBackward(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, q, k, v):\n"
        "        return F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "    @staticmethod\n    def backward(ctx, grad):\n"
        "        raise NotImplementedError('no backward on the CPU')\n"
        "class M(Base):\n    def forward(self, x):\n"
        "        q = self.W_query(x)\n        return NoBackward.apply(q, q, q)\n"
    ),
    "prints_to_stdout": (
        "print('noise at import')\nclass M(Base):\n    def forward(self, x):\n"
        "        print('noise in forward')\n        return self.attend(x)\n"
    ),
}

# (exit code, the result that carries the finding, its status, words in its text)
EXPECTED = {
    "exit_in_forward": (3, "runs", "failed", "SystemExit(0)"),
    "interrupt_in_forward": (3, "runs", "failed", "KeyboardInterrupt"),
    "sleeps_forever": (3, "runs", "error", "did not finish within 3 s"),
    "os_exit": (3, "runs", "error", "exit code 0"),
    "exit_at_import": (3, "load", "error", "SystemExit(0)"),
    "exit_in_constructor": (3, "load", "error", "SystemExit(0)"),
    "later_exception": (1, "batch_independent", "failed", "RuntimeError: three rows"),
    "prints_to_stdout": (0, "runs", "passed", ""),
    "no_cpu_backward": (0, "finite_gradients", "warning", "no backward on the CPU"),
}


def _audit(tmp_path, capsys, name, *options):
    file = tmp_path / f"{name}.py"
    file.write_text(HEADER + MODULES[name])
    code = cli.main(["check", f"{file}:M", "--timeout", "3", *options])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_hostile_module_gets_a_report_and_the_right_exit_code(tmp_path, capsys, name):
    code, printed = _audit(tmp_path, capsys, name, "--json")
    report = json.loads(printed)  # the report is JSON, whatever the module printed
    expected_code, property_name, status, words = EXPECTED[name]
    assert code == expected_code == report["exit"]["code"], report["exit"]
    result = next(r for r in report["results"] if r["name"] == property_name)
    assert result["status"] == status and words in result["observed"], result
    assert "imported the file and ran its code" in report["note"]
    if expected_code == 3:
        assert report["incomplete"] and report["ok"] is False
        assert "did not finish" in report["exit"]["reason"]


def test_the_table_prints_too_with_the_reason(tmp_path, capsys):
    code, printed = _audit(tmp_path, capsys, "exit_in_forward")
    assert code == 3
    assert printed.startswith("note: attnlab check imported the file and ran its code")
    assert "SystemExit(0)" in printed and "the audit did not finish" in printed


def test_strict_turns_the_warning_into_a_failure(tmp_path, capsys):
    code, printed = _audit(tmp_path, capsys, "no_cpu_backward", "--strict", "--json")
    report = json.loads(printed)
    assert code == 1 == report["exit"]["code"]
    assert "--strict" in report["exit"]["reason"] and report["warnings"] == ["finite_gradients"]


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.parametrize(
    "name", ["os_exit", "sleeps_forever", "exit_in_forward", "prints_to_stdout", "later_exception"]
)
def test_a_forked_and_a_spawned_child_report_the_same(tmp_path, name, start):
    """The child is this process forked where that is safe (torch and attnlab imported
    once), else a fresh interpreter: either way the same findings and exit code, and the
    parent is left with its one thread."""
    if start == "fork" and not fork_is_safe():
        pytest.skip("forking is not safe in this process (another thread, or not Linux)")
    file = tmp_path / f"{name}.py"
    file.write_text(HEADER + MODULES[name])
    job = {"target": f"{file}:M", "init": None, "causal": True, "d_in": None,
           "context_length": None, "seed": 0, "model": None}  # fmt: skip
    report = supervise(job, 3.0, start=start)
    expected_code, property_name, status, words = EXPECTED[name]
    assert exit_status(report)[0] == expected_code, report.incomplete
    result = report[property_name]
    assert result.status == status and words in result.observed, result
    assert threading.active_count() == 1


def test_a_process_running_another_thread_is_not_forked():
    """Another Python thread could hold a lock the child would inherit held: spawn."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not fork_is_safe()
        with pytest.raises(ValueError, match="forking is not safe"):
            supervise({"target": "x.py:M"}, 1.0, start="fork")
    finally:
        stop.set()
        other.join()


def test_an_unknown_way_to_start_is_named():
    with pytest.raises(ValueError, match="start must be one of"):
        supervise({"target": "x.py:M"}, 1.0, start="thread")


@pytest.mark.parametrize("start", [None, "spawn"])
def test_the_child_is_this_process_forked_where_that_is_safe(tmp_path, monkeypatch, start):
    """By default (start=None) the child is this process forked: it starts with what this
    process imported (torch and attnlab: most of an audit's seconds when spawned); spawned,
    it has none of it."""
    if start is None and not fork_is_safe():
        pytest.skip("forking is not safe in this process (another thread, or not Linux)")
    monkeypatch.setitem(sys.modules, "_attnlab_parent_marker", types.ModuleType("marker"))
    record = tmp_path / "forked.txt"
    file = tmp_path / "records.py"
    file.write_text(
        HEADER + "class M(Base):\n"
        "    def __init__(self, record):\n"
        "        super().__init__()\n"
        "        with open(record, 'w') as out:\n"
        "            out.write(str('_attnlab_parent_marker' in sys.modules))\n"
        "    def forward(self, x):\n"
        "        return self.attend(x)\n"
    )
    job = {"target": f"{file}:M", "init": json.dumps({"record": str(record)}), "causal": True,
           "d_in": None, "context_length": None, "seed": 0, "model": None}  # fmt: skip
    report = supervise(job, 30.0, start=start)
    assert report.ok, report.incomplete
    assert record.read_text() == str(start is None)
