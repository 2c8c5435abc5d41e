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
largest value: 1e-3 in float32, 5e-2 in bfloat16/float16) and its generated ids must be
identical; a pair that differs, or fails to run or compile, is a skipped row with the
reason. transformers is imported only here, when the mode runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from attnlab.bench.agreement import FAILURES, differs
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
    "cuda": {"batch": 8, "tokens": 1024, "prompt_tokens": 16, "new_tokens": 128},
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

    Returns:
        The HFReport.
    """
    import transformers

    from attnlab.interop import hf

    hf.register()
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
            report.rows.append(_row(name, measure, compiled, callers, per, timing))
        del models
    return report


def _measures(compile: bool) -> list[tuple[str, bool]]:
    eager = [(FORWARD, False), (BACKWARD, False), (GENERATE, False)]
    return eager + ([(FORWARD, True), (GENERATE, True)] if compile else [])


def _pair(config, device: torch.device, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The sdpa model from `config` (seeded) and the attnlab model with its weights, each
    from its own copy of the config (transformers writes the implementation into it)."""
    from transformers import AutoModelForCausalLM

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
    """One call per implementation for `measure`: each returns what is checked (logits, ids;
    None for forward + backward)."""
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
    }
    if static:
        options.update(cache_implementation="static", compile_config=_compile_config())
    else:
        options.update(disable_compile=True)

    def generate() -> torch.Tensor:
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


def _row(name: str, measure: str, compiled: bool, callers: dict, per: int, timing) -> HFRow:
    """Run each caller once (the warm-up, and compilation), check attnlab's output against
    sdpa's, then time both side by side."""
    row = HFRow(name, measure, compiled)
    try:
        outputs = {implementation: _kept(call()) for implementation, call in callers.items()}
    except FAILURES as error:  # a compiler that fails is a row, not a crash
        row.skipped = failure_reason(error)
        return row
    if outputs[SDPA] is not None:
        row.skipped = differs(outputs[ATTNLAB], outputs[SDPA], SDPA)
    if row.skipped:
        return row
    times = interleaved_medians(callers, **timing)
    row.sdpa_s, row.attnlab_s = times[SDPA] / per, times[ATTNLAB] / per
    return row


def _kept(output: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of a call's output (a CUDA graph's is overwritten by its next replay)."""
    return None if output is None else output.detach().clone()


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
