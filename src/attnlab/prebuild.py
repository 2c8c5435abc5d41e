"""The `attnlab build` command: build attnlab's C++ extensions ahead of time (once per
environment, see attnlab._build), so that no first call waits for the compiler."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

# (module, what it builds): each module's load_error() builds and loads its extension
EXTENSIONS = (
    ("attnlab.flash_cpu", "causal attention kernel (backend 'flash', 'auto')"),
    ("attnlab.decode_cpu", "native decode step (cached generation)"),
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add the `build` subcommand to the `attnlab` parser's subcommands."""
    commands.add_parser(
        "build",
        help="build attnlab's C++ kernels now instead of on first use",
        description=(
            "Build attnlab's C++ kernels for this environment (torch, Python, compiler, "
            "flags). Later runs load them without compiling; another virtual environment "
            "gets its own build. Exit status 1 when one is unavailable; "
            "ATTNLAB_NO_EXTENSION=1 turns them off."
        ),
    )


def run(args: argparse.Namespace) -> int:
    """Build and load every extension, one line each; 0 when all are ready, else 1."""
    ready = True
    for module_name, what in EXTENSIONS:
        start = time.perf_counter()
        error = importlib.import_module(module_name).load_error()
        seconds = time.perf_counter() - start
        if error is None:
            print(f"{module_name}: ready ({seconds:.1f} s): {what}")
        else:
            print(f"{module_name}: unavailable: {error}", file=sys.stderr)
            ready = False
    return 0 if ready else 1
