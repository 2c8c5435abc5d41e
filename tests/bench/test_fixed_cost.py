"""attnlab.bench.fixed_cost: the fixed-cost rows are measured and printed (figures are
measurements, never asserted beyond being there)."""

from rich.console import Console

from attnlab import decode_cpu
from attnlab.bench.fixed_cost import print_fixed_cost, run_fixed_cost


def test_every_row_is_measured_and_printed():
    report = run_fixed_cost(rounds=1, min_run_time=0.01)
    assert report.module_step_s > 0 and report.linear_s > 0 and report.python_path_s > 0
    assert (report.native_op_s is None) == (not decode_cpu.available())
    console = Console(record=True, width=120)
    print_fixed_cost(report, console)
    text = console.export_text()
    for row in ("module step", "native op alone", "checks + plan", "Python path"):
        assert row in text
