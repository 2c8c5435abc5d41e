"""The peer comparison: every implementation of peers.py timed side by side in two modes,
forward (torch.no_grad, eval mode) and forward + backward (train mode with dropout 0: the
sum of the output, backward, gradients set to None between calls), then the attention cores
alone in the same two modes.

FLOP model (one model for every row, the standard one): a module's forward does
8*b*t*d^2 in its projections (queries, keys, values and output, 2*b*t*d*d each) plus
2*b*t^2*d in attention (q k^T and the weighted sum of the values each cost 2*b*t^2*d over
all (t x t) pairs, and causal attention needs half of the pairs); the attention core alone
does that 2*b*t^2*d, and the unmasked reference core the full 4*b*t^2*d. Backward counts
twice the forward, so forward + backward is 3x. The book's wrapper has no output projection
but is counted by the same model (2*b*t*d^2 of its FLOPs are work it does not do).

Each group (a mode of a table) is timed in interleaved rounds together with a large matrix
product (2048 x 2048, in the run's dtype), whose FLOP/s is the machine's matmul throughput
under the same conditions; a row's "of matmul" is its FLOP/s as a fraction of it. Peak
memory is attnlab.bench.memory.peak_bytes: what one call adds above its inputs and weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch

from attnlab.bench.memory import (
    DEFAULT_MAX_BYTES,
    failure_reason,
    format_bytes,
    peak_bytes,
    peak_method,
)
from attnlab.bench.peers import (
    CorePeer,
    Peer,
    Shape,
    Weights,
    core_peers,
    machine_name,
    make_input,
    make_qkv,
    make_weights,
    module_peers,
)
from attnlab.bench.timing import interleaved_medians

FORWARD, BACKWARD = "forward", "forward+backward"
MODES = (FORWARD, BACKWARD)
MODULE_TABLE, CORE_TABLE = "module", "core"
REFERENCE = "nanoGPT SDPA"  # every other module's output is checked against this one
GPT2_SMALL = {"tokens": 1024, "d_model": 768, "num_heads": 12}
DEFAULT = {**GPT2_SMALL, "min_run_time": 0.2, "rounds": 3, "matmul_size": 2048}
QUICK = {
    "tokens": 64,
    "d_model": 64,
    "num_heads": 4,
    "min_run_time": 0.01,
    "rounds": 1,
    "matmul_size": 256,
}
FLOP_MODEL = (
    "module forward: 8*b*t*d^2 (projections) + 2*b*t^2*d (causal attention); core: "
    "2*b*t^2*d causal, 4*b*t^2*d unmasked; forward+backward: 3x forward"
)
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}  # half types: 5e-2


def default_batch(device: torch.device, quick: bool = False) -> int:
    """2 on the CPU and 8 on CUDA (GPT-2 small's shape kept in a few seconds); quick: 1."""
    if quick:
        return 1
    return 8 if device.type == "cuda" else 2


def module_flops(shape: Shape, *, backward: bool = False) -> float:
    """The FLOP model for one causal self-attention module call (module docstring)."""
    b, t, d = shape.batch, shape.tokens, shape.d_model
    forward = 8 * b * t * d**2 + 2 * b * t**2 * d
    return 3 * forward if backward else forward


def core_flops(shape: Shape, *, causal: bool = True, backward: bool = False) -> float:
    """The FLOP model for the attention core: 4*b*d per (query, key) pair, over t^2/2 pairs
    when causal and t^2 when not."""
    b, t, d = shape.batch, shape.tokens, shape.d_model
    forward = (2 if causal else 4) * b * t**2 * d
    return 3 * forward if backward else forward


@dataclass
class CompareRow:
    """One implementation in one mode of one table ("module" or "core"); seconds is None
    when it was skipped, with the reason."""

    table: str
    mode: str
    name: str
    flops: float
    seconds: float | None = None
    matmul_flops_per_s: float | None = None  # measured in the same interleaved rounds
    fastest_s: float | None = None  # the fastest row of the same table and mode
    peak_bytes: int | None = None
    skipped: str = ""

    @property
    def flops_per_s(self) -> float | None:
        return None if self.seconds is None else self.flops / self.seconds

    @property
    def of_matmul(self) -> float | None:
        """FLOP/s as a fraction of the machine's matmul throughput."""
        if self.flops_per_s is None or not self.matmul_flops_per_s:
            return None
        return self.flops_per_s / self.matmul_flops_per_s

    @property
    def vs_fastest(self) -> float | None:
        """Time over the fastest peer's time (1.0 for the fastest)."""
        if self.seconds is None or self.fastest_s is None:
            return None
        return self.seconds / self.fastest_s


@dataclass
class CompareReport:
    machine: str
    device: str
    dtype: str
    threads: int
    torch_version: str
    batch: int
    tokens: int
    d_model: int
    num_heads: int
    matmul_size: int
    peak_method: str | None
    flop_model: str = FLOP_MODEL
    rows: list[CompareRow] = field(default_factory=list)

    def group(self, table: str, mode: str) -> list[CompareRow]:
        """The rows of one table in one mode, in measuring order."""
        return [row for row in self.rows if row.table == table and row.mode == mode]

    def matmul_flops_per_s(self, table: str, mode: str) -> float | None:
        """The matmul throughput measured beside one group."""
        rows = [row for row in self.group(table, mode) if row.matmul_flops_per_s]
        return rows[0].matmul_flops_per_s if rows else None

    def to_dict(self) -> dict:
        """Plain numbers for --json, the derived figures included."""
        out = asdict(self)
        for row, raw in zip(self.rows, out["rows"], strict=True):
            raw.update(
                flops_per_s=row.flops_per_s, of_matmul=row.of_matmul, vs_fastest=row.vs_fastest
            )
        out["matmul_flops_per_s"] = {
            f"{table} {mode}": self.matmul_flops_per_s(table, mode)
            for table in (MODULE_TABLE, CORE_TABLE)
            for mode in MODES
        }
        return out


def compare_steps(*, flex: bool = False) -> int:
    """The number of progress steps run_compare reports."""
    return len(module_peers(flex=flex)) + 1 + 2 * 2 * len(MODES)


def run_compare(
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tokens: int | None = None,
    batch: int | None = None,
    quick: bool = False,
    flex: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: Callable[[str], None] = lambda step: None,
) -> CompareReport:
    """Time every peer (module_peers) and every core (core_peers) in both modes at
    (batch, tokens, d_model, heads): by default GPT-2 small's 1024 tokens, d_model 768 and
    12 heads, batch 2 on the CPU and 8 on CUDA. quick: 64 tokens, batch 1, d_model 64, 4
    heads, one short round (seconds in all). flex adds FlexAttention. Peers that would hold
    (b, h, t, t) float32 scores larger than max_bytes are skipped, as are those that fail."""
    device = torch.device(device)
    sizes = QUICK if quick else DEFAULT
    shape = Shape(
        batch or default_batch(device, quick),
        tokens or sizes["tokens"],
        sizes["d_model"],
        sizes["num_heads"],
        dtype,
        device,
    )
    report = CompareReport(
        machine_name(device),
        str(device),
        str(dtype).removeprefix("torch."),
        torch.get_num_threads(),
        torch.__version__,
        shape.batch,
        shape.tokens,
        shape.d_model,
        shape.num_heads,
        sizes["matmul_size"],
        peak_method(device),
    )
    rig = _Rig(shape, *_matmul(sizes["matmul_size"], shape), sizes["rounds"], sizes["min_run_time"])
    weights, x = make_weights(shape), make_input(shape)
    peers = module_peers(flex=flex)
    modules, reasons = _build_modules(peers, shape, weights, max_bytes, progress)
    progress("checking that the peers agree")
    reasons |= _check_agreement(peers, modules, weights, x)
    for mode in MODES:
        steps = {name: _module_step(module, x, mode) for name, module in modules.items()}
        flops = module_flops(shape, backward=mode == BACKWARD)
        report.rows.extend(rig.measure(MODULE_TABLE, mode, steps, flops, reasons, progress))
    del modules
    q, k, v = make_qkv(shape)
    for mode in MODES:
        cores = core_peers()
        steps = {peer.name: _core_step(peer, q, k, v, mode) for peer in cores}
        flops = {
            peer.name: core_flops(shape, causal=peer.causal, backward=mode == BACKWARD)
            for peer in cores
        }
        report.rows.extend(rig.measure(CORE_TABLE, mode, steps, flops, {}, progress))
    return report


def _build_modules(
    peers: list[Peer],
    shape: Shape,
    weights: Weights,
    max_bytes: int,
    progress: Callable[[str], None],
) -> tuple[dict[str, torch.nn.Module | None], dict[str, str]]:
    """Each peer built (None where skipped, with the reason)."""
    modules: dict[str, torch.nn.Module | None] = {}
    reasons: dict[str, str] = {}
    for peer in peers:
        progress(f"building {peer.name}")
        modules[peer.name] = None
        if peer.materialises_scores and shape.score_bytes > max_bytes:
            reasons[peer.name] = f"(t x t) scores need {format_bytes(shape.score_bytes)}"
            continue
        try:
            module = peer.build(shape, weights)
        except (RuntimeError, NotImplementedError) as error:
            reasons[peer.name] = failure_reason(error)
            continue
        modules[peer.name] = module
    return modules, reasons


def _check_agreement(
    peers: list[Peer],
    modules: dict[str, torch.nn.Module | None],
    weights: Weights,
    x: torch.Tensor,
) -> dict[str, str]:
    """One forward of each module against the reference's output: the peers must compute
    the same function, or the comparison means nothing (a mismatch raises RuntimeError).
    The first call also compiles what needs compiling; a module that fails is skipped (set
    to None in `modules`), and the reasons are returned."""
    outputs: dict[str, torch.Tensor] = {}
    reasons: dict[str, str] = {}
    for peer in peers:
        module = modules[peer.name]
        if module is None:
            continue
        try:
            out = _module_step(module, x, FORWARD)()
        except (RuntimeError, NotImplementedError) as error:
            reasons[peer.name] = failure_reason(error)
            modules[peer.name] = None
            continue
        if not peer.projects_output:  # the wrapper's heads side by side, (b, t, d)
            out = torch.nn.functional.linear(out, weights.out, weights.out_bias)
        outputs[peer.name] = out
    expected = outputs.get(REFERENCE)
    tolerance = _TOLERANCE.get(x.dtype, 5e-2)
    for name, out in outputs.items():
        if expected is not None and not torch.allclose(
            out, expected, rtol=tolerance, atol=tolerance
        ):
            error = (out - expected).abs().max().item()
            raise RuntimeError(f"{name} differs from {REFERENCE} by up to {error:.3g}")
    return reasons


def _module_step(
    module: torch.nn.Module | None, x: torch.Tensor, mode: str
) -> Callable[[], object] | None:
    """One timed call (None for a skipped module): forward under no_grad in eval mode, or
    forward + backward in train mode (dropout is 0) with the input's and every parameter's
    gradient set to None after."""
    if module is None:
        return None
    if mode == FORWARD:
        module.eval()

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return module(x)

        return forward
    module.train()
    x = x.detach().requires_grad_()
    params = list(module.parameters())

    def forward_backward() -> None:
        module(x).sum().backward()
        x.grad = None
        for p in params:
            p.grad = None

    return forward_backward


def _core_step(peer: CorePeer, q, k, v, mode: str) -> Callable[[], object]:
    """The core's timed call on (b, h, t, hd) q, k, v, in the same two modes."""
    if mode == FORWARD:

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return peer.attend(q, k, v)

        return forward
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]

    def forward_backward() -> None:
        peer.attend(*inputs).sum().backward()
        for t in inputs:
            t.grad = None

    return forward_backward


def _matmul(n: int, shape: Shape) -> tuple[Callable[[], torch.Tensor], float]:
    """An (n x n) by (n x n) product in the run's dtype and device, and its 2*n^3 FLOPs. It is
    F.linear(a, b) = a @ b^T, the layout of every projection: the same speed as torch.mm in
    float32, while on CPUs without half-precision instructions torch.mm in float16 or
    bfloat16 takes a path about ten times slower than linear's."""
    generator = torch.Generator().manual_seed(3)
    a, b = (torch.randn(n, n, generator=generator).to(shape.device, shape.dtype) for _ in "ab")
    return (lambda: torch.nn.functional.linear(a, b)), 2.0 * n**3


@dataclass
class _Rig:
    """What every group is measured with: the shape's device, the matmul timed beside each
    group (and its FLOPs), and the interleaved rounds' settings."""

    shape: Shape
    matmul: Callable[[], torch.Tensor]
    matmul_flops: float
    rounds: int
    min_run_time: float

    def measure(
        self,
        table: str,
        mode: str,
        steps: Mapping[str, Callable[[], object] | None],
        flops: float | Mapping[str, float],
        reasons: Mapping[str, str],
        progress: Callable[[str], None],
    ) -> list[CompareRow]:
        """Time one group's steps interleaved with the matmul, then measure each one's peak.
        A step whose first call fails (no backward, say) becomes a skipped row."""
        rows: dict[str, CompareRow] = {}
        runnable: dict[str, Callable[[], object]] = {}
        for name, step in steps.items():
            row_flops = flops[name] if isinstance(flops, Mapping) else flops
            rows[name] = CompareRow(table, mode, name, row_flops, skipped=reasons.get(name, ""))
            if step is None:
                continue
            try:
                step()
            except (RuntimeError, NotImplementedError) as error:
                rows[name].skipped = failure_reason(error)
                continue
            runnable[name] = step
        progress(f"timing the {table} table, {mode}")
        times = interleaved_medians(
            {**runnable, _MATMUL: self.matmul}, rounds=self.rounds, min_run_time=self.min_run_time
        )
        matmul_flops_per_s = self.matmul_flops / times.pop(_MATMUL)
        fastest = min(times.values(), default=None)
        progress(f"peak memory, {table} table, {mode}")
        for name, seconds in times.items():
            row = rows[name]
            row.seconds, row.fastest_s = seconds, fastest
            row.matmul_flops_per_s = matmul_flops_per_s
            row.peak_bytes = peak_bytes(runnable[name], self.shape.device)
        return list(rows.values())


_MATMUL = "matmul (machine throughput)"
