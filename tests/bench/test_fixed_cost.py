"""attnlab.bench.fixed_cost: the fixed-cost rows are measured and printed (figures are
measurements, never asserted beyond being there)."""

import torch
from rich.console import Console

from attnlab import decode_cpu, plan
from attnlab.bench import fixed_cost
from attnlab.bench.fixed_cost import print_fixed_cost, run_fixed_cost


def test_every_row_is_measured_and_printed():
    report = run_fixed_cost(rounds=1, min_run_time=0.01)
    assert report.module_step_s > 0 and report.linear_s > 0 and report.python_path_s > 0
    assert report.subclass_step_s > 0
    assert (report.native_op_s is None) == (not decode_cpu.available())
    console = Console(record=True, width=120)
    print_fixed_cost(report, console)
    text = console.export_text()
    rows = ("module step", "a subclass's step", "native op alone", "checks + plan", "Python path")
    for row in rows:
        assert row in text


def test_the_subclass_row_is_the_plan_in_python_before_the_same_native_op():
    """The subclass's step: the C++ plan leaves it, the Python plan takes the native op."""
    module = fixed_cost._Subclass(64, 64, 64, 0.0, 4).eval()
    with torch.no_grad():
        cache = fixed_cost._filled(module)
        x = torch.randn(1, 1, 64)
        assert plan.decode_lane(module, x, cache) is None
        native = plan.native_decode(module, x, cache) is not None
        assert native == decode_cpu.available()
