"""Decoding beside the layer a GPU user would otherwise write: a stack of `layers` attention
layers (each its own weights and cache, batch 1, the run's dtype and device) decodes `steps`
tokens after a prompt of context - 1 tokens, through

- attnlab's MultiHeadAttention with its KVCache (make_cache), the reference;
- attnlab's MultiHeadAttention with its StaticKVCache (make_cache(static=True)), where this
  attnlab has one (attnlab.static_cache; otherwise a note says its rows are omitted);
- a minimal gpt-fast-style static-cache SDPA layer (peers.StaticCacheSDPA), as gpt-fast
  runs it: one mask row per step for every layer, the position a device tensor moved on
  in place after each step;

eager, and with compile=True the two static-cache stacks also compiled whole with
torch.compile(mode="reduce-overhead", fullgraph=True) (one CUDA graph per step on a GPU).
attnlab's KVCache stack is not compiled: its shapes change with every token.

Every stack has the same weights and is prompted with the same tokens; before anything is
timed, each implementation's next-token output is checked against the reference's (a row
that differs, or fails to build or compile, is reported as skipped, with the reason).

A timed call puts the caches back to context - 1 tokens (KVCache/StaticKVCache.crop, the
peer's position fill_) and decodes `steps` tokens; a row's figure is per step, the median of
interleaved rounds. Its floor is the bytes a step must read, every layer's weights and the
keys and values of the tokens held (at the mean step), over the bandwidth measured in the
same rounds (timing.bandwidth_probe: a device copy on CUDA, a sum on the CPU). The static
stacks attend over the whole capacity (max(contexts) + steps), more than the floor counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from attnlab.attention import MultiHeadAttention
from attnlab.bench import decode
from attnlab.bench.agreement import FAILURES, differs
from attnlab.bench.memory import failure_reason
from attnlab.bench.peers import StaticCacheSDPA, StaticCacheSDPAStack, machine_name
from attnlab.bench.timing import bandwidth_probe, interleaved_medians

KVCACHE, STATIC, PEER = "attnlab KVCache", "attnlab StaticKVCache", "static-cache SDPA (gpt-fast)"
COMPILE_MODE = "reduce-overhead"
MODEL = {"d_model": 768, "num_heads": 12, "layers": 12}
KV_HEADS = (12, 4)  # multi-head and grouped-query layouts of MODEL's 12 heads
QUICK_PEERS = {"layers": 2, "steps": 2, "rounds": 1, "min_run_time": 0.01, "read_bytes": 8 << 20}
NO_STATIC = "attnlab.static_cache.StaticKVCache is not in this attnlab: its rows are omitted"
_BANDWIDTH = "bandwidth"


@dataclass
class PeerRow:
    """One implementation at one context: its median step (None when skipped, with the
    reason), the bytes a step must read, and the bandwidth measured beside it."""

    implementation: str
    compiled: bool
    num_kv_heads: int
    context: int
    bytes_read: int
    read_bytes_per_s: float
    step_s: float | None = None
    peer_s: float | None = None  # the static-cache SDPA layer's step, compiled alike
    skipped: str = ""

    @property
    def floor_s(self) -> float:
        return self.bytes_read / self.read_bytes_per_s

    @property
    def over_floor(self) -> float | None:
        return None if self.step_s is None else self.step_s / self.floor_s

    @property
    def vs_peer(self) -> float | None:
        """Step over the static-cache SDPA layer's step in the same mode."""
        return None if self.step_s is None or not self.peer_s else self.step_s / self.peer_s


@dataclass
class PeerDecodeReport:
    machine: str
    device: str
    dtype: str
    torch_version: str
    d_model: int
    num_heads: int
    layers: int
    steps: int
    capacity: int
    compile_mode: str | None
    notes: list[str] = field(default_factory=list)
    rows: list[PeerRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain numbers for --json, the derived figures included."""
        out = asdict(self)
        for row, raw in zip(self.rows, out["rows"], strict=True):
            raw.update(floor_s=row.floor_s, over_floor=row.over_floor, vs_peer=row.vs_peer)
        return out


def static_cache_available() -> bool:
    """Whether this attnlab has attnlab.static_cache.StaticKVCache."""
    try:
        from attnlab.static_cache import StaticKVCache  # noqa: F401
    except ImportError:
        return False
    return True


def peer_steps(contexts: Sequence[int], kv_heads: Sequence[int] = KV_HEADS) -> int:
    """The number of progress steps run_decode_peers reports."""
    return len(contexts) * len(kv_heads)


def run_decode_peers(
    contexts: Sequence[int] = (256, 1024, 4096),
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    compile: bool = False,
    kv_heads: Sequence[int] = KV_HEADS,
    d_model: int = MODEL["d_model"],
    num_heads: int = MODEL["num_heads"],
    layers: int = MODEL["layers"],
    steps: int = 16,
    rounds: int = 3,
    min_run_time: float = 0.2,
    read_bytes: int | None = None,
    progress: Callable[[str], None] = lambda step: None,
) -> PeerDecodeReport:
    """Measure every implementation of the module docstring at each context and head layout.

    Args:
        contexts: context lengths (tokens held when a timed call starts, plus one).
        device: where everything runs.
        dtype: the layers' and caches' dtype.
        compile: also the static-cache stacks compiled with mode="reduce-overhead".
        kv_heads: key/value head layouts, each dividing num_heads.
        d_model: model width.
        num_heads: query heads.
        layers: layers in each stack.
        steps: tokens decoded per timed call.
        rounds: interleaved rounds.
        min_run_time: seconds per timing.
        read_bytes: the bandwidth probe's buffer (timing.bandwidth_probe's default).
        progress: called with a description before each group of rows.

    Returns:
        The PeerDecodeReport.
    """
    device = torch.device(device)
    contexts = sorted(contexts, reverse=True)  # longest first: crop() only goes back
    capacity = contexts[0] + steps
    report = PeerDecodeReport(
        machine_name(device),
        str(device),
        str(dtype).removeprefix("torch."),
        torch.__version__,
        d_model,
        num_heads,
        layers,
        steps,
        capacity,
        COMPILE_MODE if compile else None,
    )
    static = static_cache_available()
    if not static:
        report.notes.append(NO_STATIC)
    probe = bandwidth_probe(device, read_bytes)
    timing = {"steps": steps, "rounds": rounds, "min_run_time": min_run_time}
    for heads in kv_heads:
        torch.manual_seed(heads)
        modules = decode._stack(d_model, num_heads, heads, capacity, dtype, layers, device)
        decoders = _decoders(modules, capacity, contexts[0] - 1, static=static, compile=compile)
        x = torch.randn(1, 1, d_model, **decode.factory(modules[0]))  # (b, 1, d)
        for context in contexts:
            progress(f"{heads} key/value heads, context {context}, against static-cache SDPA")
            where = {"num_kv_heads": heads, "bytes_read": bytes_read(modules, context, steps)}
            report.rows.extend(_measure(decoders, x, context, probe, where, **timing))
        del decoders, modules
    return report


class _Decoder:
    """One implementation's stack: reset(context) leaves context - 1 tokens in every cache;
    step(x) decodes the next token, (b, 1, d) -> (b, 1, d)."""

    def __init__(self, call: Callable, reset: Callable[[int], None], compiled: bool) -> None:
        self.call, self.reset, self.compiled = call, reset, compiled

    def step(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are dropped
        return self.call(x)


def _decoders(modules, capacity: int, prompt_tokens: int, *, static: bool, compile: bool):
    """The implementations, keyed (name, compiled), each prompted with the same tokens."""
    prompt = torch.randn(1, prompt_tokens, modules[0].d_in, **decode.factory(modules[0]))
    kinds = {KVCACHE: {}, **({STATIC: {"static": True}} if static else {})}
    decoders = {}
    for name, options in kinds.items():
        caches = [m.make_cache(1, capacity, **options) for m in modules]
        run = _layers(modules, caches)
        with torch.no_grad():
            run(prompt)
        decoders[name, False] = _Decoder(run, _cropper(caches), compiled=False)
        if compile and options:
            compiled = torch.compile(run, mode=COMPILE_MODE, fullgraph=True)
            decoders[name, True] = _Decoder(compiled, _cropper(caches), compiled=True)
    peer = StaticCacheSDPAStack([StaticCacheSDPA(m, 1, capacity) for m in modules])
    position = torch.arange(prompt_tokens, device=prompt.device)  # (t,)
    with torch.no_grad():
        peer(prompt, position)
    decoders[PEER, False] = _peer_decoder(peer, peer, compiled=False)
    if compile:
        compiled = torch.compile(peer, mode=COMPILE_MODE, fullgraph=True)
        decoders[PEER, True] = _peer_decoder(peer, compiled, compiled=True)
    return decoders


def _layers(modules: Sequence[MultiHeadAttention], caches: Sequence) -> Callable:
    """x (b, t, d) through every layer with its cache -> (b, t, d)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        for module, cache in zip(modules, caches, strict=True):
            x = module(x, cache=cache)
        return x

    return run


def _cropper(caches: Sequence) -> Callable[[int], None]:
    def reset(context: int) -> None:
        for cache in caches:
            cache.crop(context - 1)

    return reset


def _peer_decoder(peer: StaticCacheSDPAStack, call: Callable, *, compiled: bool) -> _Decoder:
    """gpt-fast's loop: the position (1,) on the device, moved on in place after each step."""
    position = torch.zeros(1, dtype=torch.long, device=peer.causal_mask.device)

    def step(x: torch.Tensor) -> torch.Tensor:
        out = call(x, position)
        position.add_(1)
        return out

    return _Decoder(step, lambda context: position.fill_(context - 1), compiled=compiled)


def _measure(
    decoders, x, context, probe, where: dict, *, steps, rounds, min_run_time
) -> list[PeerRow]:
    """Check each implementation's next token against the reference's, then time those that
    agree side by side with the bandwidth probe: a row each, with `where`'s fields (the
    layout and the bytes a step reads)."""
    with torch.no_grad():
        reference = _first_step(decoders[KVCACHE, False], x, context)
    calls, reasons = {}, {}
    for key, decoder in decoders.items():
        try:
            with torch.no_grad():
                reasons[key] = differs(_first_step(decoder, x, context), reference, KVCACHE)
        except FAILURES as error:  # a layer or a compiler that fails is a row, not a crash
            reasons[key] = failure_reason(error)
        if not reasons[key]:
            calls[_label(*key)] = _timed(decoder, x, context, steps)
    read, moved = probe
    times = interleaved_medians(
        {**calls, _BANDWIDTH: read}, rounds=rounds, min_run_time=min_run_time
    )
    bandwidth = moved / times[_BANDWIDTH]
    rows = []
    for name, compiled in decoders:
        seconds = times.get(_label(name, compiled))
        peer = times.get(_label(PEER, compiled))
        rows.append(
            PeerRow(
                name,
                compiled,
                context=context,
                read_bytes_per_s=bandwidth,
                step_s=None if seconds is None else seconds / steps,
                peer_s=None if peer is None else peer / steps,
                skipped=reasons[name, compiled],
                **where,
            )
        )
    return rows


def _label(name: str, compiled: bool) -> str:
    return f"{name}, compiled" if compiled else name


def _first_step(decoder: _Decoder, x: torch.Tensor, context: int) -> torch.Tensor:
    decoder.reset(context)
    return decoder.step(x).clone()


def _timed(decoder: _Decoder, x: torch.Tensor, context: int, steps: int) -> Callable[[], None]:
    """A timed call: caches back to context - 1 tokens, then `steps` tokens decoded."""

    def run() -> None:
        with torch.no_grad():
            decoder.reset(context)
            for _ in range(steps):
                decoder.step(x)

    return run


def bytes_read(modules: Sequence[MultiHeadAttention], context: int, steps: int) -> int:
    """The bytes the mean step of a timed call must read: every layer's weights, and the keys
    and values of the tokens held (context + (steps - 1) / 2 on average) in its dtype."""
    first = modules[0]
    weights = sum(p.nbytes for p in first.parameters())
    per_token = 2 * first.kv_dim * first.out_proj.weight.dtype.itemsize
    held_twice = 2 * context + steps - 1  # twice the mean tokens held
    return len(modules) * (weights + held_twice * per_token // 2)


def print_decode_peers(report: PeerDecodeReport, console: Console) -> None:
    """One table: each implementation's step against the floor and the static-cache SDPA
    layer compiled alike; the notes under it."""
    mode = f", compiled with mode={report.compile_mode!r}" if report.compile_mode else ""
    table = Table(
        title=f"Decode step against a static-cache SDPA layer: {report.machine}, "
        f"{report.device}, {report.dtype}, torch {report.torch_version}; {report.layers} "
        f"layers, d_model {report.d_model}, {report.num_heads} heads, batch 1, "
        f"{report.steps} tokens per call, capacity {report.capacity}{mode}; floor = "
        f"(weights + cache held) / bandwidth measured beside each row"
    )
    columns = ("kv", "context", "implementation", "step ms", "GB/s", "floor ms", "x floor")
    for column in (*columns, "x SDPA layer"):
        table.add_column(column, justify="left" if column == "implementation" else "right")
    for row in report.rows:
        table.add_row(str(row.num_kv_heads), str(row.context), *_cells(row))
    console.print(table)
    for note in report.notes:
        console.print(f"Note: {note}")


def _cells(row: PeerRow) -> tuple[str, ...]:
    name = _label(row.implementation, row.compiled)
    if row.step_s is None:
        return (f"{name}\n[dim]skipped: {row.skipped}[/dim]", *("-" * 5))
    vs_peer = "-" if row.vs_peer is None else f"{row.vs_peer:.2f}"
    return (
        name,
        f"{row.step_s * 1e3:.3f}",
        f"{row.read_bytes_per_s / 1e9:.1f}",
        f"{row.floor_s * 1e3:.3f}",
        f"{row.over_floor:.2f}",
        vs_peer,
    )
