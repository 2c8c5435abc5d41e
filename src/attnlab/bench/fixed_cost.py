"""The fixed cost of a cached decode step per layer: what a layer pays for one token beyond
its arithmetic and memory traffic (the module call, forward's checks, the call plan, the
op's dispatch and any parallel region), measured on a tiny module (d_model 64, 4 heads, 16
tokens held) where the arithmetic is negligible.

Rows, timed side by side in interleaved rounds (attnlab.bench.timing):

- "module step": module(x, cache=cache), the whole call a model makes per layer (its plan
  read in C++: attnlab.plan.decode_lane);
- "subclass step": the same call on an empty subclass of MultiHeadAttention, which the C++
  plan leaves to forward's checks and the plan in Python (plan.native_decode) before the
  same native op: what the plan costs in Python;
- "native op": the native decode step alone (decode_cpu.step: no module call, checks or
  plan), so that module step - native op is the Python around it;
- "nn.Linear(64, 192)": one PyTorch projection of the token, the smallest call a layer
  makes anyway, for scale;
- "Python path": the same step with the native step turned off (the reference path).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from attnlab import decode_cpu, plan
from attnlab.attention import MultiHeadAttention
from attnlab.bench.timing import interleaved_medians

D_MODEL, HEADS, HELD = 64, 4, 16


@dataclass
class FixedCostReport:
    """Median seconds per call of each row (None where the native step is unavailable)."""

    module_step_s: float
    subclass_step_s: float
    native_op_s: float | None
    linear_s: float
    python_path_s: float
    threads: int

    def to_dict(self) -> dict:
        return asdict(self)


def run_fixed_cost(*, rounds: int = 5, min_run_time: float = 0.2) -> FixedCostReport:
    """Time the rows of the module docstring on one token through a tiny module.

    Args:
        rounds: interleaved rounds; each row's figure is the median over all of them.
        min_run_time: seconds per row per round.

    Returns:
        The FixedCostReport.
    """
    torch.manual_seed(0)
    module = MultiHeadAttention(D_MODEL, D_MODEL, 4 * HELD, 0.0, HEADS).eval()
    reference = MultiHeadAttention(D_MODEL, D_MODEL, 4 * HELD, 0.0, HEADS, backend="sdpa")
    reference.load_state_dict(module.state_dict())
    reference.eval()
    subclass = _Subclass(D_MODEL, D_MODEL, 4 * HELD, 0.0, HEADS)
    subclass.load_state_dict(module.state_dict())
    subclass.eval()
    x = torch.randn(1, 1, D_MODEL)  # (b, 1, d)
    with torch.no_grad():
        candidates = {
            "module step": _step(module, x),
            "subclass step": _step(subclass, x),
            "nn.Linear(64, 192)": _linear(module, x),
            "Python path": _step(reference, x),
        }
        native = _native_op(module, x)
        if native is not None:
            candidates["native op"] = native
        medians = interleaved_medians(candidates, rounds=rounds, min_run_time=min_run_time)
    return FixedCostReport(
        module_step_s=medians["module step"],
        subclass_step_s=medians["subclass step"],
        native_op_s=medians.get("native op"),
        linear_s=medians["nn.Linear(64, 192)"],
        python_path_s=medians["Python path"],
        threads=torch.get_num_threads(),
    )


class _Subclass(MultiHeadAttention):
    """MultiHeadAttention as it is, under another class: the plan in Python takes its calls
    (no method overridden), the plan in C++ (exact classes only) does not."""


def _filled(module: MultiHeadAttention):
    cache = module.make_cache(1)
    module(torch.randn(1, HELD, D_MODEL), cache=cache)
    return cache


def _step(module: MultiHeadAttention, x: torch.Tensor):
    cache = _filled(module)

    def step():
        cache.crop(HELD)
        return module(x, cache=cache)

    return step


def _linear(module: MultiHeadAttention, x: torch.Tensor):
    layer = module.qkv_proj
    return lambda: layer(x)


def _native_op(module: MultiHeadAttention, x: torch.Tensor):
    cache = _filled(module)
    weights = plan.native_decode(module, x, cache)
    if weights is None:
        return None
    scale = 1.0 / math.sqrt(module.head_dim)

    def op():
        cache.crop(HELD)
        return decode_cpu.step(x, weights, HEADS, scale, cache, None)

    return op


def print_fixed_cost(report: FixedCostReport, console: Console) -> None:
    """The fixed-cost table: each row in microseconds and the Python around the op."""
    table = Table(
        title=f"fixed cost of a cached decode step per layer (d_model {D_MODEL}, {HEADS} heads, "
        f"{HELD} tokens held, {report.threads} threads)"
    )
    table.add_column("call")
    table.add_column("us per token", justify="right")
    rows = [
        ("module step (what a model pays)", report.module_step_s),
        ("a subclass's step (the plan in Python)", report.subclass_step_s),
        ("native op alone", report.native_op_s),
        ("checks + plan + module call (difference)", _difference(report)),
        ("nn.Linear(64, 192) alone, for scale", report.linear_s),
        ("Python path (native step off)", report.python_path_s),
    ]
    for name, seconds in rows:
        table.add_row(name, "n/a" if seconds is None else f"{seconds * 1e6:.1f}")
    console.print(table)


def _difference(report: FixedCostReport) -> float | None:
    if report.native_op_s is None:
        return None
    return report.module_step_s - report.native_op_s
