"""Tests of scripts/: each imports its script with scripts/ on sys.path (as running it from
there does, so that a script can import the scripts beside it)."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@contextlib.contextmanager
def script(name: str):
    """scripts/`name`.py imported, scripts/ on sys.path for the block."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))
