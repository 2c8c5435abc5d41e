"""`attnlab explore -o FILE`: the explore subcommand's options and its run.

With no target it writes the chapter's example. A target is taken the way `attnlab check`
takes one (FILE.py:ClassName built with --init), or a transformers model by name or path
with --hf. Usage errors exit 2 with the subcommand's usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnlab._arguments import positive_int, seed
from attnlab.check.loader import LoadError
from attnlab.check.runner import describe

DEFAULT_OUT = "attnlab-out/explore.html"


def add_parser(commands) -> argparse.ArgumentParser:
    """Add the `explore` subcommand to `commands` (argparse subparsers).

    Args:
        commands: the top-level parser's subparsers.

    Returns:
        The explore subcommand's parser.
    """
    explore = commands.add_parser(
        "explore",
        help="write an interactive attention explorer (one HTML file, works offline)",
        description="Write one self-contained HTML file (no network, no CDN) to explore "
        "attention maps: a layers x heads grid, a head view, a heatmap with exact values, "
        "per-head statistics, two maps side by side. With no target: the chapter's example "
        "stage by stage. FILE.py:ClassName (built with --init, as `attnlab check` takes it; "
        "the file's code is imported and run) or --hf NAME (a transformers model) otherwise.",
    )
    explore.add_argument(
        "target", nargs="?", metavar="FILE.py:ClassName", help="a module to run (optional)"
    )
    explore.add_argument(
        "--init",
        metavar="JSON",
        help="constructor arguments: an object for keywords or an array for positional ones",
    )
    explore.add_argument(
        "--hf",
        metavar="NAME",
        help="a transformers model's local path, or the name of one in the local Hugging Face "
        "cache (AutoModel; nothing is downloaded)",
    )
    explore.add_argument(
        "--text",
        help="the input text (default: the chapter's sentence); a module gets a seeded random "
        "embedding per whitespace-separated token, a transformers model its tokenizer's ids",
    )
    explore.add_argument(
        "--decoder-text", metavar="TEXT", help="an encoder-decoder model's decoder input"
    )
    explore.add_argument(
        "-o",
        "--out",
        default=DEFAULT_OUT,
        metavar="FILE",
        help="the HTML file to write (default: %(default)s)",
    )
    explore.add_argument(
        "--max-tokens",
        type=positive_int,
        default=256,
        metavar="N",
        help="cut the input to N tokens (default: %(default)s)",
    )
    explore.add_argument(
        "--max-cells",
        type=positive_int,
        default=12 * 12 * 256 * 256,
        metavar="N",
        help="most map cells in the page; past it groups keep their first layers, then "
        "heads, then queries and keys (default: %(default)s, 12 layers x 12 heads x 256 x 256)",
    )
    explore.add_argument(
        "--precision",
        choices=("auto", "8", "16"),
        default="auto",
        help="bits per stored value (default: auto, 16 up to 4 M cells, else 8)",
    )
    explore.add_argument(
        "--seed", type=seed, default=0, help="torch seed for a module's weights (default: 0)"
    )
    explore.set_defaults(explore_parser=explore)
    return explore


def run(args: argparse.Namespace) -> int:
    """`attnlab explore`: build the source, write the page, print where it is.

    Args:
        args: the parsed options (with `explore_parser`, the subcommand's parser).

    Returns:
        0; 1 when the model raises on the input (said in one line); a usage error exits 2
        through the parser.
    """
    from attnlab.explore import explore

    parser = args.explore_parser
    out = Path(args.out)
    if out.is_dir():
        parser.error(f"-o {args.out!r} is a folder; give a file name such as explore.html")
    precision = args.precision if args.precision == "auto" else int(args.precision)
    options = {"max_tokens": args.max_tokens, "max_cells": args.max_cells, "precision": precision}
    from attnlab.explore.hf import ModelNotFoundError

    try:
        source, inputs, extra = _source(args, parser)
        result = explore(source, inputs, **extra, **options)
    except ModelNotFoundError as error:  # said at once: the hub is never asked
        parser.error(f"--hf {error.name!r} {error.reason}")
    except (LoadError, ValueError, TypeError, ImportError) as error:
        parser.error(str(error))
    except OSError as error:  # a cached model transformers could not read
        parser.error(f"--hf {args.hf!r}: {error}")
    except (RuntimeError, IndexError) as error:  # the model's own forward on this input
        print(f"error: the model raised {describe(error)} on this input", file=sys.stderr)
        print("  (an input longer than its context, or ids past its vocabulary?)", file=sys.stderr)
        return 1
    try:
        path = result.save(out)
    except OSError as error:
        parser.error(f"-o {args.out!r}: cannot write it ({error.strerror or error})")
    size = path.stat().st_size
    print(f"wrote {path} ({size / 1e6:.2f} MB): {result.capture.title}")
    for group in result.capture.groups:
        layers, heads, queries, keys = group.shape
        print(f"  {group.name}: {layers} x {heads} maps of {queries} x {keys}")
    for cut in result.capture.cuts:
        print(f"  cut: {cut}")
    print("open it in any browser: it needs no network and no server")
    return 0


def _source(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple:
    """(source, inputs, extra keyword arguments) for explore()."""
    if args.target and args.hf:
        parser.error("give either FILE.py:ClassName or --hf NAME, not both")
    if args.hf:
        text = args.text or "Your journey starts with one step"
        return args.hf, text, {"decoder_inputs": args.decoder_text}
    if args.decoder_text is not None:
        parser.error("--decoder-text applies to --hf encoder-decoder models only")
    if not args.target:
        if args.init or args.text:
            parser.error("--init and --text need a target (FILE.py:ClassName or --hf NAME)")
        return None, None, {}
    return _built(args), args.text, {}


def _built(args: argparse.Namespace):
    """The target module, built with --init under --seed (as attnlab check builds it)."""
    import torch

    from attnlab.check.loader import adapt_init, load_class, parse_init, parse_target

    file, name = parse_target(args.target)
    positional, keywords = parse_init(args.init)
    cls = load_class(file, name)
    positional, keywords, notes = adapt_init(cls, positional, keywords)
    for note in notes:
        print(f"note: {note}")
    print(
        "note: attnlab explore imported the file and ran its code (import, constructor, forward)."
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        try:
            return cls(*positional, **keywords)
        except TypeError as error:
            raise LoadError(f"{name}(**--init): {error} (check --init)") from error
