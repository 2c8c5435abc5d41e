"""`attnlab check FILE.py:ClassName`: the check subcommand's options, checked at the door
(a usage error exits 2 with the check subcommand's usage), and its run: the audit in a
child process (supervisor.py), the report printed whatever happened, the exit code.
"""

from __future__ import annotations

import argparse
import json
import math

from attnlab._arguments import positive_int, seed

DEFAULT_TIMEOUT = 60.0


def add_parser(commands) -> argparse.ArgumentParser:
    """Add the `check` subcommand to `commands` (argparse subparsers).

    Args:
        commands: the top-level parser's subparsers.

    Returns:
        The check subcommand's parser.
    """
    check = commands.add_parser(
        "check",
        help="audit an attention module or a causal language model for leaks and bugs",
        description="Import ClassName from FILE.py, build it with --init, and audit it in a "
        "child process (the file's code is imported and run). Exit 0 when no property "
        "fails, 1 when one fails (or, with --strict, warns or is skipped), 2 for a usage "
        "error, 3 when the audit could not finish (a time limit, the module raising on every "
        "input, attnlab's own bug).",
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
    check.add_argument(
        "--model",
        action="store_true",
        default=None,
        help="audit a whole causal language model: token ids (batch, tokens) in, logits "
        "(batch, tokens, vocab) out (default: detected from the input it accepts)",
    )
    check.add_argument(
        "--d-in", type=positive_int, metavar="N", help="input width (default: --init, found)"
    )
    check.add_argument(
        "--context-length",
        type=positive_int,
        metavar="N",
        help="longest input (default: --init, then the module's context_length, block_size, "
        "n_positions or max_position_embeddings)",
    )
    check.add_argument(
        "--seed", type=seed, default=0, help="torch seed for the weights (default: %(default)s)"
    )
    check.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="time limit of each property; past it the audit stops (exit 3) (default: %(default)g)",
    )
    check.add_argument(
        "--strict",
        action="store_true",
        help="count warnings and skipped properties as failures: every property must be "
        "checked and pass (causal under --no-causal excepted)",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(check_parser=check)
    return check


def _positive_float(text: str) -> float:
    """'2.5' -> 2.5, for argparse; finite and above 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """`attnlab check`: check the target and --init (usage errors exit 2), audit in a child
    process, print the report (table or --json), return the exit code.

    Args:
        args: the parsed options (with `check_parser`, the subcommand's parser).

    Returns:
        0, 1 or 3 (see exit_status); a usage error exits 2 through the parser.
    """
    from attnlab.check.loader import LoadError, parse_init, parse_target
    from attnlab.check.report import NOTE, exit_status
    from attnlab.check.supervisor import UsageError, supervise

    parser = args.check_parser
    try:
        parse_target(args.target)
        parse_init(args.init)
        report = supervise(_job(args), args.timeout)
    except (LoadError, UsageError) as usage:
        parser.error(str(usage))
    code, reason = exit_status(report, args.strict)
    if args.json:
        exit_info = {"code": code, "reason": reason}
        print(json.dumps({"note": NOTE, **report.to_dict(), "exit": exit_info}, indent=2))
    else:
        from attnlab.check.printing import print_report  # rich, for the table alone

        print_report(report, reason=reason)
    return code


def _job(args: argparse.Namespace) -> dict:
    names = ("target", "init", "causal", "d_in", "context_length", "seed", "model")
    return {name: getattr(args, name) for name in names}
