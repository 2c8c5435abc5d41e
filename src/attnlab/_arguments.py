"""argparse types the commands share: a whole number of at least 1, said the same way
by every command."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """'8' -> 8, for argparse; at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value
