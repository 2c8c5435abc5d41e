"""The `attnlab` command: argument parsing only; the work is done in the modules it calls."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from attnlab import __version__, prebuild
from attnlab.bench.cli import add_parser as add_bench_parser
from attnlab.bench.cli import run as run_bench
from attnlab.check import cli as check_cli
from attnlab.explore import cli as explore_cli


def build_parser() -> argparse.ArgumentParser:
    """The `attnlab` parser: one subcommand per tool."""
    parser = argparse.ArgumentParser(
        prog="attnlab", description="Attention mechanisms for PyTorch, step by step."
    )
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="walk through the chapter on the six-token example, with heatmaps",
        description=(
            "Walk through the chapter on its six-token example: each step's tensors printed "
            "and checked against the book's, and heatmaps of the attention weights saved as "
            "PNG files in --out."
        ),
    )
    demo.add_argument(
        "--out",
        default="attnlab-out",
        metavar="DIR",
        help="folder for the PNG heatmaps (default: %(default)s)",
    )
    check_cli.add_parser(commands)
    explore_cli.add_parser(commands)
    add_bench_parser(commands)
    prebuild.add_parser(commands)
    return parser


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
        return run_bench(parser, args)
    if args.command == "check":
        return check_cli.run(args)
    if args.command == "explore":
        return explore_cli.run(args)
    if args.command == "build":
        return prebuild.run(args)
    parser.print_help()
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
