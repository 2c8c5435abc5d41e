"""`attnlab check FILE.py:ClassName`: the check subcommand's options and its run."""

from __future__ import annotations

import argparse


def add_parser(commands) -> argparse.ArgumentParser:
    """Add the `check` subcommand to `commands` (argparse subparsers); returns its parser."""
    check = commands.add_parser(
        "check",
        help="audit an attention module for leaks and bugs",
        description="Import ClassName from FILE.py, build it with --init, and audit it: exit "
        "0 when every applicable property passes, 1 when one fails, 2 for a usage error.",
    )
    check.add_argument("target", metavar="FILE.py:ClassName", help="the class to audit")
    check.add_argument(
        "--init",
        metavar="JSON",
        help='constructor arguments: an object for keywords ({"d_in": 3, ...}) or an array '
        "for positional ones ([3, 2, 6, 0.0])",
    )
    check.add_argument(
        "--causal",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="whether the module should be causal (default: --causal)",
    )
    check.add_argument("--d-in", type=int, metavar="N", help="input width (default: found)")
    check.add_argument(
        "--context-length", type=int, metavar="N", help="longest input (default: found)"
    )
    check.add_argument(
        "--seed", type=int, default=0, help="torch seed for the weights (default: %(default)s)"
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(check_parser=check)
    return check


def run(args: argparse.Namespace) -> int:
    """`attnlab check`: load the class (usage errors exit 2), audit, print, 0 or 1."""
    import json

    import torch

    from attnlab.check import audit
    from attnlab.check.loader import LoadError, load_factory
    from attnlab.check.text import print_report

    parser = args.check_parser
    try:
        _, factory = load_factory(args.target, args.init)
        torch.manual_seed(args.seed)  # the same weights, the same report, every run
        report = audit(
            factory(),
            causal=args.causal,
            d_in=args.d_in,
            context_length=args.context_length,
            factory=factory,
        )
    except (LoadError, ValueError, TypeError) as error:
        parser.error(str(error))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report)
    return 0 if report.ok else 1
