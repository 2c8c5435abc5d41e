"""`attnlab bench`: its options, and the checks run before anything is measured (the options
against the mode, the output paths, and the memory the sizes need against the machine's).
attnlab.cli only delegates here."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from attnlab._arguments import positive_int
from attnlab.bench import budget, timing

DTYPES = ("float32", "float16", "bfloat16")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# which bench options each mode takes (the comparison is the mode with no flag)
BENCH_OPTIONS = {
    "contexts": ("decode",),
    "flex": ("compare",),
    "device": ("compare", "memory", "decode", "hf"),
    "dtype": ("compare", "memory", "decode", "hf"),
    "tokens": ("compare", "parallel", "hf"),
    "batch": ("compare", "hf"),
    "plot": ("compare",),
    "compile": ("decode", "hf"),
}
ON_DEVICE = ("compare", "memory", "decode", "hf")  # the modes whose memory is --device's
DEFAULT_CONTEXTS = (256, 1024, 4096)
PARALLEL_HEADS, PARALLEL_HEAD_DIM = 12, 64  # as attnlab.bench.parallel.run_parallel


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` subcommand and its options to `commands`; returns its parser."""
    bench = commands.add_parser(
        "bench",
        help="measure attnlab's speed and memory against its peers",
        description="With no mode: compare attnlab's attention with its peers (the book's "
        "classes, nn.MultiheadAttention, nanoGPT-style SDPA), forward and forward + backward.",
    )
    mode = bench.add_mutually_exclusive_group()
    mode.add_argument(
        "--decode",
        action="store_true",
        help="token-by-token decoding: KV cache against recomputing, bytes per head layout, "
        "time against the floor (memory bandwidth, matmul rate)",
    )
    mode.add_argument(
        "--memory",
        action="store_true",
        help="forward peak memory from 1k to 32k tokens, per implementation",
    )
    mode.add_argument(
        "--kernel",
        action="store_true",
        help="attnlab's causal CPU kernel against SDPA, forward and forward + backward, at 256 "
        "to 4096 tokens for 12/12, 12/4 and 12/1 query/key-value heads",
    )
    mode.add_argument(
        "--padded",
        action="store_true",
        help="a left-padded batch against an unpadded one through a GPT-2-small-sized stack "
        "and attention alone, attnlab against SDPA",
    )
    mode.add_argument(
        "--hf",
        action="store_true",
        help="transformers models (GPT-2 small, a Llama of its size) with "
        "attn_implementation='attnlab' against 'sdpa': forward and greedy generate "
        "(needs transformers)",
    )
    mode.add_argument(
        "--parallel",
        type=positive_int,
        metavar="N",
        help="ring attention over N CPU processes against one: per-rank memory, bytes sent",
    )
    bench.add_argument(
        "--contexts",
        type=positive_ints,
        metavar="N,N,...",
        help="context lengths for --decode (default: 256,1024,4096)",
    )
    bench.add_argument(
        "--flex", action="store_true", help="also compare FlexAttention (compiled; slow to start)"
    )
    bench.add_argument("--device", choices=("cpu", "cuda"), help="where to run (default: cpu)")
    bench.add_argument("--dtype", choices=DTYPES, help="parameters and inputs (default: float32)")
    bench.add_argument(
        "--compile",
        action="store_true",
        help="for --decode and --hf: also torch.compile(mode='reduce-overhead'), beside eager",
    )
    bench.add_argument(
        "--tokens",
        type=positive_int,
        metavar="N",
        help="tokens per sequence (default: 1024; --hf: 512 on cpu, 1024 on cuda)",
    )
    bench.add_argument(
        "--batch",
        type=positive_int,
        metavar="N",
        help="sequences (default: 2 on cpu, 8 on cuda; --hf: 1 on cpu, 8 on cuda)",
    )
    bench.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    bench.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    bench.add_argument("--plot", metavar="FILE", help="also draw the comparison as a PNG chart")
    return bench


def positive_ints(text: str) -> list[int]:
    """'256,1024' -> [256, 1024], for argparse."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected integers >= 2 joined by commas, got {text!r}")
    return values


QUICK_NOTE = (
    "Note: --quick runs tiny sizes, where every call is mostly fixed overhead: a smoke test, "
    "not representative figures (run without --quick for those)."
)


def mode_of(args: argparse.Namespace) -> str:
    """'compare', 'decode', 'memory', 'padded', 'kernel', 'hf' or 'parallel'."""
    if args.parallel is not None:
        return "parallel"
    if args.hf:
        return "hf"
    if args.padded:
        return "padded"
    if args.kernel:
        return "kernel"
    return "decode" if args.decode else "memory" if args.memory else "compare"


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`attnlab bench`: check everything (usage errors exit 2 through `parser`), then run."""
    mode = mode_of(args)
    _check_options(parser, args, mode)
    _check_paths(parser, args)
    if mode == "hf":
        _check_transformers(parser)
    import torch  # loads only for bench

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device cuda: no CUDA device is available to this torch ({torch.__version__})"
        )
    _check_memory(parser, args, mode)
    status = _run_mode(args, mode)
    if args.quick:
        print(QUICK_NOTE)
    return status


def _check_options(parser: argparse.ArgumentParser, args: argparse.Namespace, mode: str) -> None:
    """Each option against the mode; --parallel's own constraints."""
    if mode == "parallel" and args.parallel < 2:
        parser.error(f"bench: --parallel needs at least 2 processes, got {args.parallel}")
    for option, modes in BENCH_OPTIONS.items():
        if getattr(args, option) not in (None, False) and mode not in modes:
            names = ["the comparison" if m == "compare" else f"--{m}" for m in modes]
            allowed = " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))
            parser.error(f"bench: --{option} applies to {allowed} only")
    if mode == "parallel":
        tokens = parallel_tokens(args)
        if tokens % (2 * args.parallel):
            parser.error(
                f"bench: --tokens {tokens} must divide by twice --parallel {args.parallel} "
                f"(the zigzag layout cuts {2 * args.parallel} pieces)"
            )


def _check_transformers(parser: argparse.ArgumentParser) -> None:
    """--hf runs transformers models: a usage error (exit 2) where it is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        parser.error(
            "bench --hf: transformers is not installed; install it with "
            "pip install 'attnlab[hf]' (or pip install transformers)"
        )


def parallel_tokens(args: argparse.Namespace) -> int:
    """--tokens, or the default for --parallel (64 per process with --quick, else 16384)."""
    return args.tokens or (64 * args.parallel if args.quick else 16384)


def _check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--json and --plot: a file (not a folder) in an existing folder this user may write."""
    for option in ("json", "plot"):
        path = getattr(args, option)
        if path is None:
            continue
        problem = path_problem(Path(path))
        if problem:
            parser.error(f"--{option} {path!r}: {problem}")
    if args.plot is not None and Path(args.plot).suffix.lower() != ".png":
        parser.error(f"--plot {args.plot!r}: the chart is a PNG, give a file name ending in .png")


def path_problem(path: Path) -> str:
    """Why the output file `path` cannot be written ('' when it can)."""
    folder = path.parent
    if path.is_dir():
        return "is a folder, give a file name"
    if not folder.is_dir():
        return f"the folder {str(folder)!r} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {str(folder)!r} is not writable"
    if path.exists() and not os.access(path, os.W_OK):
        return "the file exists and is not writable"
    return ""


def estimate_bytes(args: argparse.Namespace, mode: str) -> tuple[int, str]:
    """The peak memory the run needs (attnlab.bench.budget) and the options it comes from,
    in words for the message."""
    from attnlab.bench import QUICK_DECODE
    from attnlab.bench.compare import DEFAULT, QUICK
    from attnlab.bench.decode import GPT2_SMALL
    from attnlab.bench.memory import DEFAULT_MAX_BYTES, MEMORY_LENGTHS, QUICK_MEMORY

    itemsize = _ITEMSIZE[args.dtype or "float32"]
    if mode == "decode":
        contexts = args.contexts or (QUICK_DECODE["contexts"] if args.quick else DEFAULT_CONTEXTS)
        layers = QUICK_DECODE["layers"] if args.quick else GPT2_SMALL["layers"]
        needed = budget.decode_bytes(
            max(contexts), d_model=GPT2_SMALL["d_model"], layers=layers, itemsize=itemsize
        )
        needed += QUICK_DECODE["read_bytes"] if args.quick else _probe_bytes(args.device)
        return needed, f"--decode --contexts {max(contexts)}"
    if mode == "hf":
        return _hf_bytes(args, itemsize)
    if mode == "padded":
        from attnlab.bench.padded import GPT2_SMALL as PADDED
        from attnlab.bench.padded import QUICK_PADDED

        sizes = QUICK_PADDED if args.quick else PADDED
        shape = budget.Sizes(sizes["batch"], sizes["tokens"], sizes["d_model"], sizes["heads"], 4)
        return budget.compare_bytes(shape, matmul_size=0), "--padded"
    if mode == "kernel":
        from attnlab.bench.kernel import DEFAULT_KERNEL, KERNEL_SHAPE, QUICK_KERNEL

        tokens = max((QUICK_KERNEL if args.quick else DEFAULT_KERNEL)["lengths"])
        b, h, d = KERNEL_SHAPE["batch"], KERNEL_SHAPE["heads"], KERNEL_SHAPE["head_dim"]
        shape = budget.Sizes(b, tokens, h * d, h, 4)  # no (t x t) scores: max_bytes 0
        return budget.compare_bytes(shape, matmul_size=0, max_bytes=0), "--kernel"
    if mode == "parallel":
        tokens = parallel_tokens(args)
        needed = budget.parallel_bytes(
            args.parallel, tokens, d_model=PARALLEL_HEADS * PARALLEL_HEAD_DIM, itemsize=4
        )
        return needed, f"--parallel {args.parallel} --tokens {tokens}"
    if mode == "memory":
        lengths, limit = (
            (QUICK_MEMORY["lengths"], QUICK_MEMORY["max_bytes"])
            if args.quick
            else (MEMORY_LENGTHS, DEFAULT_MAX_BYTES)
        )
        needed = max(
            budget.memory_bytes(budget.Sizes(1, t, 768, 12, itemsize), max_bytes=limit)
            for t in lengths
        )
        return needed, f"--memory up to {max(lengths)} tokens"
    sizes = QUICK if args.quick else DEFAULT
    batch = args.batch or (1 if args.quick else 8 if args.device == "cuda" else 2)
    tokens = args.tokens or sizes["tokens"]
    shape = budget.Sizes(batch, tokens, sizes["d_model"], sizes["num_heads"], itemsize)
    needed = budget.compare_bytes(shape, matmul_size=sizes["matmul_size"])
    return needed, f"--tokens {tokens} --batch {batch}"


def _probe_bytes(device: str | None) -> int:
    """The bandwidth probe's buffers: a read on the CPU, a copy's two buffers on a device."""
    return 2 * timing.DEVICE_COPY_BYTES if device == "cuda" else timing.read_bytes()


def _hf_bytes(args: argparse.Namespace, itemsize: int) -> tuple[int, str]:
    """--hf's estimate at the forward's (batch, tokens) (budget.hf_bytes)."""
    from attnlab.bench.hf import MODELS, QUICK_HF, QUICK_MODELS, SIZES

    sizes = QUICK_HF if args.quick else SIZES[args.device or "cpu"]
    batch, tokens = args.batch or sizes["batch"], args.tokens or sizes["tokens"]
    _, gpt2 = next(iter((QUICK_MODELS if args.quick else MODELS).values()))  # the larger
    needed = budget.hf_bytes(
        batch,
        tokens,
        d_model=gpt2["n_embd"],
        layers=gpt2["n_layer"],
        vocab=gpt2["vocab_size"],
        itemsize=itemsize,
    )
    return needed, f"--hf --tokens {tokens} --batch {batch}"


def _check_memory(parser: argparse.ArgumentParser, args: argparse.Namespace, mode: str) -> None:
    """Refuse (exit 2) a run whose estimated peak exceeds the memory available where it runs."""
    from attnlab.bench.memory import format_bytes

    needed, options = estimate_bytes(args, mode)
    available, where = _available(args.device if mode in ON_DEVICE else None)
    if available is not None and needed > available:
        parser.error(
            f"bench: {options} need about {format_bytes(needed)} of memory (estimated from the "
            f"sizes), more than the {format_bytes(available)} available {where}; give smaller sizes"
        )


def _available(device: str | None) -> tuple[int | None, str]:
    """Free bytes on the CUDA device for --device cuda, else the machine's available memory."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0], "on the CUDA device"
    return budget.available_bytes(), "on this machine"


def _run_mode(args: argparse.Namespace, mode: str) -> int:
    """Run the checked mode; 0."""
    import torch

    from attnlab import bench  # rich and the timers load only here

    device, dtype = args.device or "cpu", getattr(torch, args.dtype or "float32")
    if mode == "decode":
        bench.decode_command(
            args.contexts,
            device=device,
            dtype=dtype,
            compile=args.compile,
            quick=args.quick,
            json_path=args.json,
        )
        return 0
    if mode == "hf":
        bench.hf_command(
            device=device,
            dtype=dtype,
            batch=args.batch,
            tokens=args.tokens,
            compile=args.compile,
            quick=args.quick,
            json_path=args.json,
        )
        return 0
    if mode == "padded":
        bench.padded_command(quick=args.quick, json_path=args.json)
        return 0
    if mode == "kernel":
        bench.kernel_command(quick=args.quick, json_path=args.json)
        return 0
    if mode == "parallel":
        tokens = parallel_tokens(args)
        bench.parallel_command(args.parallel, tokens=tokens, json_path=args.json)
        return 0
    options = {"device": device, "dtype": dtype, "quick": args.quick, "json_path": args.json}
    if mode == "memory":
        bench.memory_command(**options)
        return 0
    bench.compare_command(
        **options, tokens=args.tokens, batch=args.batch, flex=args.flex, plot_path=args.plot
    )
    return 0
