"""`attnlab bench --hf`: transformers models through attn_implementation="attnlab" against
"sdpa", side by side: GPT-2 small's shape (12 layers, d_model 768, 12 heads) and a Llama
of the same size with 12/4 query/key-value heads, random weights from their configs (the
attnlab model loads the sdpa model's state_dict: the same function).

Measures, each the median of interleaved rounds (the two implementations alternate, so
that a neighbour's load falls on both) after a warm-up call:

- forward: the logits of (batch, tokens) random ids under no_grad (use_cache=False);
- forward + backward: the logits' sum, backward (eager only);
- generate: greedy decoding of new_tokens tokens after a prompt of prompt_tokens, batch 1,
  as seconds per new token (the prompt's prefill included).

With compile=True, also the forward of torch.compile(model, mode="reduce-overhead"), and
generate with cache_implementation="static", whose decode steps transformers compiles
(its CompileConfig: mode "reduce-overhead"; asked for on the CPU too).

Before anything is timed, attnlab's logits are checked against sdpa's (relative to their
largest value: 1e-3 in float32, 5e-2 in bfloat16/float16), and so are its generated ids:
identical, or where they part, the logits of every step up to there (which both computed
from the same tokens) agree, so that the parting is a near-tie the dtype's rounding breaks
either way (the row says so in a note; the work timed is the same, new_tokens tokens). A
pair that differs, or fails to run or compile, is a skipped row with the reason.
transformers is imported only here, when the mode runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from attnlab.bench.agreement import FAILURES, differs, relative_error, tolerance
from attnlab.bench.memory import failure_reason
from attnlab.bench.peers import machine_name
from attnlab.bench.timing import interleaved_medians

SDPA, ATTNLAB = "sdpa", "attnlab"
FORWARD, BACKWARD, GENERATE = "forward", "forward+backward", "generate"
COMPILE_MODE = "reduce-overhead"
GPT2_NAME, LLAMA_NAME = "GPT-2 small", "Llama, 768 wide, 12 layers, 12/4 heads"
# the models by name: their transformers config class and sizes (positions set per run)
MODELS = {
    GPT2_NAME: ("GPT2Config", {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}),
    LLAMA_NAME: (
        "LlamaConfig",
        {
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
        },
    ),
}
QUICK_MODELS = {
    "GPT-2, tiny": (
        "GPT2Config",
        # GPT-2's bos/eos id 50256 is past this vocabulary
        {
            "n_layer": 2,
            "n_embd": 64,
            "n_head": 4,
            "vocab_size": 512,
            "bos_token_id": 511,
            "eos_token_id": 511,
        },
    ),
    "Llama, tiny, 4/2 heads": (
        "LlamaConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
        },
    ),
}
# (batch, tokens) of the forward and the tokens generated, by device; --quick: tiny configs
SIZES = {
    "cpu": {"batch": 1, "tokens": 512, "prompt_tokens": 16, "new_tokens": 32},
    "cuda": {"batch": 8, "tokens": 1024, "prompt_tokens": 16, "new_tokens": 64},
}
TIMING = {"rounds": 3, "min_run_time": 0.2}
QUICK_HF = {"batch": 1, "tokens": 32, "prompt_tokens": 4, "new_tokens": 4}
QUICK_TIMING = {"rounds": 1, "min_run_time": 0.01}


@dataclass
class HFRow:
    """One model, measure and mode: median seconds per call (generate: per new token) of
    each implementation, or the reason the pair was skipped."""

    model: str
    measure: str
    compiled: bool
    sdpa_s: float | None = None
    attnlab_s: float | None = None
    skipped: str = ""
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """attnlab's time over sdpa's."""
        if self.sdpa_s is None or self.attnlab_s is None:
            return None
        return self.attnlab_s / self.sdpa_s


@dataclass
class HFReport:
    machine: str
    device: str
    dtype: str
    torch_version: str
    transformers_version: str
    batch: int
    tokens: int
    prompt_tokens: int
    new_tokens: int
    rounds: int
    compile_mode: str | None
    rows: list[HFRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain numbers for --json, the ratios included."""
        out = asdict(self)
        for row, raw in zip(self.rows, out["rows"], strict=True):
            raw.update(ratio=row.ratio)
        return out


def model_configs(*, quick: bool = False, positions: int = 1024) -> dict[str, object]:
    """The configs compared, by name (MODELS, or QUICK_MODELS with quick), each of
    `positions` tokens at most."""
    import transformers

    configs = {}
    for name, (kind, sizes) in (QUICK_MODELS if quick else MODELS).items():
        length = "n_positions" if kind == "GPT2Config" else "max_position_embeddings"
        configs[name] = getattr(transformers, kind)(**sizes, **{length: positions})
    return configs


def hf_steps(*, compile: bool = False) -> int:
    """The number of progress steps run_hf reports."""
    return 2 * (5 if compile else 3)


def run_hf(
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch: int | None = None,
    tokens: int | None = None,
    compile: bool = False,
    quick: bool = False,
    progress: Callable[[str], None] = lambda step: None,
    on_row: Callable[[HFReport], None] = lambda report: None,
) -> HFReport:
    """Measure both models (module docstring).

    Args:
        device: where the models run.
        dtype: their parameters' dtype.
        batch: sequences of the forward (default 1 on the CPU, 8 on CUDA).
        tokens: tokens per sequence of the forward (default 512 on the CPU, 1024 on CUDA).
        compile: also the compiled forward and the compiled static-cache generate.
        quick: tiny models and sizes, one short round: a smoke test.
        progress: called with a description before each measure.
        on_row: called with the report after each row (to keep what a run killed midway
            has measured).

    Returns:
        The HFReport.
    """
    import transformers

    device = torch.device(device)
    sizes = dict(QUICK_HF if quick else SIZES.get(device.type, SIZES["cuda"]))
    sizes.update({k: v for k, v in (("batch", batch), ("tokens", tokens)) if v is not None})
    timing = QUICK_TIMING if quick else TIMING
    report = HFReport(
        machine_name(device),
        str(device),
        str(dtype).removeprefix("torch."),
        torch.__version__,
        transformers.__version__,
        **sizes,
        rounds=timing["rounds"],
        compile_mode=COMPILE_MODE if compile else None,
    )
    positions = max(sizes["tokens"], sizes["prompt_tokens"] + sizes["new_tokens"])
    for name, config in model_configs(quick=quick, positions=positions).items():
        models = _pair(config, device, dtype)
        inputs = _inputs(config.vocab_size, sizes, device)
        for measure, compiled in _measures(compile):
            progress(f"{name}: {measure}{', compiled' if compiled else ''}")
            callers = _callers(models, measure, compiled, inputs, sizes["new_tokens"])
            per = sizes["new_tokens"] if measure == GENERATE else 1
            row = HFRow(name, measure, compiled)
            report.rows.append(_measured(row, callers, per, timing, dtype))
            on_row(report)
        del models
    return report


def _measures(compile: bool) -> list[tuple[str, bool]]:
    eager = [(FORWARD, False), (BACKWARD, False), (GENERATE, False)]
    return eager + ([(FORWARD, True), (GENERATE, True)] if compile else [])


def _pair(config, device: torch.device, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The sdpa model from `config` (seeded) and the attnlab model with its weights, each
    from its own copy of the config (transformers writes the implementation into it)."""
    from transformers import AutoModelForCausalLM

    from attnlab.interop import hf

    hf.register()
    torch.manual_seed(0)
    models = {}
    for implementation in (SDPA, ATTNLAB):
        model = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=implementation
        )
        models[implementation] = model
    models[ATTNLAB].load_state_dict(models[SDPA].state_dict())
    return {name: model.to(device, dtype).eval() for name, model in models.items()}


def _inputs(vocab: int, sizes: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The forward's ids (batch, tokens) and the prompt (1, prompt_tokens), seeded."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (sizes["batch"], sizes["tokens"]), generator=generator)
    prompt = torch.randint(0, vocab, (1, sizes["prompt_tokens"]), generator=generator)
    return {"ids": ids.to(device), "prompt": prompt.to(device)}


def _callers(models, measure: str, compiled: bool, inputs, new_tokens: int) -> dict:
    """One call per implementation for `measure`: each returns what is checked (logits, a
    generate output; None for forward + backward)."""
    if measure == FORWARD:
        return {name: _forward(model, inputs["ids"], compiled) for name, model in models.items()}
    if measure == BACKWARD:
        return {name: _backward(model, inputs["ids"]) for name, model in models.items()}
    return {
        name: _generate(model, inputs["prompt"], new_tokens, static=compiled)
        for name, model in models.items()
    }


def _forward(model, ids: torch.Tensor, compiled: bool) -> Callable[[], torch.Tensor]:
    call = torch.compile(model, mode=COMPILE_MODE) if compiled else model

    def forward() -> torch.Tensor:
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the last call's outputs are dropped
        with torch.no_grad():
            return call(ids, use_cache=False).logits

    return forward


def _backward(model, ids: torch.Tensor) -> Callable[[], None]:
    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, use_cache=False).logits.sum().backward()

    return forward_backward


def _generate(model, prompt: torch.Tensor, new_tokens: int, *, static: bool) -> Callable:
    """Greedy decoding of exactly new_tokens tokens: eager with transformers' dynamic cache,
    or (static) with its static cache and its compiled decode step."""
    options = {
        "attention_mask": torch.ones_like(prompt),
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "pad_token_id": 0,
        "return_dict_in_generate": True,
        "output_logits": True,  # each step's logits, for the check (both sides alike)
    }
    if static:
        options.update(cache_implementation="static", compile_config=_compile_config())
    else:
        options.update(disable_compile=True)

    def generate():
        with torch.no_grad():
            return model.generate(prompt, **options)

    return generate


def _compile_config():
    """transformers' CompileConfig for generate (mode "reduce-overhead"), asked for on every
    device (transformers compiles on CUDA only, unless told)."""
    from transformers import CompileConfig

    config = CompileConfig(mode=COMPILE_MODE)
    config._compile_all_devices = True  # the CPU too: its documented switch for testing
    return config


def _measured(row: HFRow, callers: dict, per: int, timing: dict, dtype: torch.dtype) -> HFRow:
    """Run each caller once (the warm-up, and compilation), check attnlab's output against
    sdpa's (computed in `dtype`), then time both side by side: `row` filled in."""
    try:
        outputs = {implementation: _kept(call()) for implementation, call in callers.items()}
    except FAILURES as error:  # a compiler that fails is a row, not a crash
        row.skipped = failure_reason(error)
        return row
    if row.measure == GENERATE:
        row.skipped, row.note = generation_differs(outputs[ATTNLAB], outputs[SDPA], dtype)
    elif outputs[SDPA] is not None:
        row.skipped = differs(outputs[ATTNLAB], outputs[SDPA], SDPA)
    if row.skipped:
        return row
    times = interleaved_medians(callers, **timing)
    row.sdpa_s, row.attnlab_s = times[SDPA] / per, times[ATTNLAB] / per
    return row


def _kept(output):
    """A copy of a call's tensor output (a CUDA graph's is overwritten by its next replay)."""
    return output.detach().clone() if isinstance(output, torch.Tensor) else output


def generation_differs(out, reference, dtype: torch.dtype) -> tuple[str, str]:
    """(why attnlab's greedy generation differs from sdpa's, or ''; a note, or ''): the same
    ids, or ids that part at a near-tie, after steps whose logits agree to `dtype`'s
    tolerance (module docstring). out and reference are generate outputs: sequences (b, t),
    logits one (b, vocab) per new token."""
    ids, expected = out.sequences, reference.sequences
    if ids.shape != expected.shape:
        return f"generated {tuple(ids.shape)} ids against sdpa's {tuple(expected.shape)}", ""
    if torch.equal(ids, expected):
        return "", ""
    new = len(reference.logits)
    step = int((ids[:, -new:] != expected[:, -new:]).any(dim=0).nonzero()[0, 0])
    logits = torch.stack(out.logits[: step + 1], dim=1)  # (b, step + 1, vocab)
    error = relative_error(logits, torch.stack(reference.logits[: step + 1], dim=1))
    where = f"ids part from sdpa's at new token {step}"
    if error > tolerance(dtype):
        return f"{where}, after logits that differ by {error:.2g} of their largest value", ""
    return "", f"{where}: a near-tie, the logits up to there agree to {error:.2g}"


def print_hf(report: HFReport, console) -> None:
    """One table: each model and measure, sdpa against attnlab, and their ratio."""
    from rich.table import Table

    compiled = f", compiled: mode={report.compile_mode!r}" if report.compile_mode else ""
    table = Table(
        title=f"transformers models, attn_implementation 'attnlab' against 'sdpa': "
        f"{report.machine}, {report.device}, {report.dtype}, torch {report.torch_version}, "
        f"transformers {report.transformers_version}; forward at (batch, tokens) = "
        f"({report.batch}, {report.tokens}); generate: batch 1, {report.prompt_tokens} "
        f"prompt tokens, {report.new_tokens} new, ms per new token{compiled}; median of "
        f"{report.rounds} interleaved rounds"
    )
    for column in ("model", "measure", "sdpa ms", "attnlab ms", "attnlab / sdpa"):
        table.add_column(column, justify="left" if column in ("model", "measure") else "right")
    for row in report.rows:
        measure = f"{row.measure}, compiled" if row.compiled else row.measure
        if row.note:
            measure += f"\n[dim]{row.note}[/dim]"
        if row.ratio is None:
            table.add_row(row.model, f"{measure}\n[dim]skipped: {row.skipped}[/dim]", "-", "-", "-")
            continue
        table.add_row(
            row.model,
            measure,
            f"{row.sdpa_s * 1e3:.2f}",
            f"{row.attnlab_s * 1e3:.2f}",
            f"{row.ratio:.2f}",
        )
    console.print(table)
