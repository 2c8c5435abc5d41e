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


def seed(text: str) -> int:
    """'0' -> 0, for argparse; torch seeds are 0 to 2**64 - 1."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**64 - 1, got {text!r}")
    return value
