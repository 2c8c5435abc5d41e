"""The `attnlab` command: argument parsing only; the work is done in the modules it calls."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from attnlab import __version__


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
    bench = commands.add_parser("bench", help="measure attnlab's speed and memory")
    bench.add_argument(
        "--decode",
        action="store_true",
        help="token-by-token decoding: KV cache against recomputing, bytes per head layout, "
        "time against the memory-bandwidth floor",
    )
    bench.add_argument(
        "--contexts",
        type=_positive_ints,
        metavar="N,N,...",
        help="context lengths for --decode (default: 256,1024,4096)",
    )
    bench.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    bench.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    return parser


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
        if not args.decode:
            parser.error("bench: choose what to measure: --decode")
        from attnlab.bench import decode_command  # rich and the timers load only here

        decode_command(args.contexts, quick=args.quick, json_path=args.json)
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
