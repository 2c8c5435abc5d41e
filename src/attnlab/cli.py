"""The `attnlab` command: argument parsing only; the work is done in the modules it calls."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from attnlab import __version__
from attnlab.check import cli as check_cli


def build_parser() -> argparse.ArgumentParser:
    """The `attnlab` parser: one subcommand per tool."""
    parser = argparse.ArgumentParser(
        prog="attnlab", description="Attention mechanisms for PyTorch, step by step."
    )
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="walk through the chapter on the six-token example, with heatmaps"
    )
    demo.add_argument(
        "--out",
        default="attnlab-out",
        metavar="DIR",
        help="folder for the PNG heatmaps (default: %(default)s)",
    )
    check_cli.add_parser(commands)
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
        "time against the memory-bandwidth floor",
    )
    mode.add_argument(
        "--memory",
        action="store_true",
        help="forward peak memory from 1k to 32k tokens, per implementation",
    )
    mode.add_argument(
        "--parallel",
        type=_positive_int,
        metavar="N",
        help="ring attention over N CPU processes against one: per-rank memory, bytes sent",
    )
    bench.add_argument(
        "--contexts",
        type=_positive_ints,
        metavar="N,N,...",
        help="context lengths for --decode (default: 256,1024,4096)",
    )
    bench.add_argument(
        "--flex", action="store_true", help="also compare FlexAttention (compiled; slow to start)"
    )
    bench.add_argument("--device", choices=("cpu", "cuda"), help="where to run (default: cpu)")
    bench.add_argument("--dtype", choices=_DTYPES, help="parameters and inputs (default: float32)")
    bench.add_argument(
        "--tokens", type=_positive_int, metavar="N", help="tokens per sequence (default: 1024)"
    )
    bench.add_argument(
        "--batch", type=_positive_int, metavar="N", help="sequences (default: 2 on cpu, 8 on cuda)"
    )
    bench.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    bench.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    bench.add_argument("--plot", metavar="FILE", help="also draw the comparison as a PNG chart")
    return parser


_DTYPES = ("float32", "float16", "bfloat16")
# which bench options each mode takes (the comparison is the mode with no flag)
_BENCH_OPTIONS = {
    "contexts": ("decode",),
    "flex": ("compare",),
    "device": ("compare", "memory"),
    "dtype": ("compare", "memory"),
    "tokens": ("compare", "parallel"),
    "batch": ("compare",),
    "plot": ("compare",),
}


def _positive_int(text: str) -> int:
    """'8' -> 8, for argparse; at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _positive_ints(text: str) -> list[int]:
    """'256,1024' -> [256, 1024], for argparse."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected integers >= 2 joined by commas, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command named in `argv` (default: sys.argv); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if Path(args.out).exists() and not Path(args.out).is_dir():
            parser.error(f"--out {args.out!r} exists and is not a folder")
        from attnlab.demo import run_demo  # matplotlib is imported only when drawing

        run_demo(args.out)
        return 0
    if args.command == "bench":
        return _bench(parser, args)
    if args.command == "check":
        return check_cli.run(args)
    parser.print_help()
    return 2


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`attnlab bench`: check the options against the mode, then run it."""
    mode = "decode" if args.decode else "memory" if args.memory else "compare"
    if args.parallel is not None:
        mode = "parallel"
        if args.parallel < 2:
            parser.error(f"bench: --parallel needs at least 2 processes, got {args.parallel}")
    for option, modes in _BENCH_OPTIONS.items():
        if getattr(args, option) not in (None, False) and mode not in modes:
            allowed = " and ".join("the comparison" if m == "compare" else f"--{m}" for m in modes)
            parser.error(f"bench: --{option} applies to {allowed} only")
    for option in ("json", "plot"):
        path = getattr(args, option)
        if path is not None and not Path(path).parent.is_dir():
            parser.error(
                f"--{option} {path!r}: the folder {str(Path(path).parent)!r} does not exist"
            )
    if args.plot is not None and Path(args.plot).suffix.lower() != ".png":
        parser.error(f"--plot {args.plot!r}: the chart is a PNG, give a file name ending in .png")
    import torch  # loads only for bench

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device cuda: no CUDA device is available to this torch ({torch.__version__})"
        )
    from attnlab import bench  # rich and the timers load only here

    if mode == "decode":
        bench.decode_command(args.contexts, quick=args.quick, json_path=args.json)
        return 0
    if mode == "parallel":
        tokens = args.tokens or (64 * args.parallel if args.quick else 16384)
        if tokens % (2 * args.parallel):
            parser.error(
                f"bench: --tokens {tokens} must divide by twice --parallel {args.parallel} "
                f"(the zigzag layout cuts {2 * args.parallel} pieces)"
            )
        bench.parallel_command(args.parallel, tokens=tokens, json_path=args.json)
        return 0
    options = {
        "device": args.device or "cpu",
        "dtype": getattr(torch, args.dtype or "float32"),
        "quick": args.quick,
        "json_path": args.json,
    }
    if mode == "memory":
        bench.memory_command(**options)
        return 0
    bench.compare_command(
        **options, tokens=args.tokens, batch=args.batch, flex=args.flex, plot_path=args.plot
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
