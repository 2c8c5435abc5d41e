"""`attnlab check FILE.py:ClassName --init JSON`: import a class from a file and build it.
Every way this can go wrong is a LoadError with a message for the command line."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

from torch import nn


class LoadError(Exception):
    """The target or the constructor arguments cannot give a module (a usage error)."""


def parse_target(target: str) -> tuple[Path, str]:
    """'path/to/file.py:ClassName' -> (path, class name)."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise LoadError(f"expected FILE.py:ClassName, got {target!r}")
    file = Path(path)
    if not file.is_file():
        raise LoadError(f"no such file: {path!r}")
    return file, name


def parse_init(text: str | None) -> tuple[list, dict]:
    """--init JSON: an object gives keyword arguments, an array positional ones."""
    if text is None:
        return [], {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise LoadError(f"--init is not valid JSON ({error}): {text!r}") from error
    if isinstance(value, dict):
        return [], value
    if isinstance(value, list):
        return value, {}
    raise LoadError(f"--init must be a JSON object or array, got {type(value).__name__}")


def load_factory(target: str, init: str | None) -> tuple[str, Callable[[], nn.Module]]:
    """(class name, a function building a new instance), after building one to be sure."""
    file, name = parse_target(target)
    args, kwargs = parse_init(init)
    cls = getattr(_import(file), name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise LoadError(f"{file} has no nn.Module class named {name!r}")

    def factory() -> nn.Module:
        return cls(*args, **kwargs)

    try:
        factory()
    except Exception as error:  # the user's constructor: any error is a usage error
        call = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        message = f"{name}({call}) raised {type(error).__name__}: {error}"
        raise LoadError(message) from error
    return name, factory


def _import(file: Path):
    """Import a file as a module, with its folder on sys.path for its own imports."""
    folder = str(file.resolve().parent)
    spec = importlib.util.spec_from_file_location(f"attnlab_check_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {file} (not a Python file?)")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's file: any error is a usage error
        raise LoadError(f"importing {file} raised {type(error).__name__}: {error}") from error
    finally:
        sys.path.remove(folder)
    return module
