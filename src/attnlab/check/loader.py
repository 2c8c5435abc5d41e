"""`attnlab check FILE.py:ClassName --init JSON`: import a class from a file and build it.

A target or constructor arguments that cannot give a module are a LoadError (a usage
error). What the file's own code raises at import or in the constructor goes through,
marked as the module's (runner.user_code), to be reported as a finding.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path

from torch import nn

from attnlab.check.runner import user_code


class LoadError(Exception):
    """The target or the constructor arguments cannot give a module (a usage error)."""


def parse_target(target: str) -> tuple[Path, str]:
    """'path/to/file.py:ClassName' -> (path, class name).

    Raises:
        LoadError: not FILE:ClassName, or no such file.
    """
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise LoadError(f"expected FILE.py:ClassName, got {target!r}")
    file = Path(path)
    if not file.is_file():
        raise LoadError(f"no such file: {path!r}")
    return file, name


def parse_init(text: str | None) -> tuple[list, dict]:
    """--init JSON: an object gives keyword arguments, an array positional ones.

    Raises:
        LoadError: not JSON, nested too deep, or neither an object nor an array.
    """
    if text is None:
        return [], {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise LoadError(f"--init is not valid JSON ({error}): {text[:80]!r}") from error
    except RecursionError as error:
        raise LoadError("--init is nested too deeply to read") from error
    if isinstance(value, dict):
        return [], value
    if isinstance(value, list):
        return value, {}
    raise LoadError(f"--init must be a JSON object or array, got {type(value).__name__}")


def load_class(file: Path, name: str) -> type[nn.Module]:
    """The nn.Module class `name` of `file`, imported with its folder on sys.path.

    Raises:
        LoadError: no nn.Module class of that name.
        BaseException: whatever the file raises at import, marked as the module's.
    """
    cls = getattr(_import(file), name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise LoadError(f"{file} has no nn.Module class named {name!r}")
    return cls


def bind(cls: type, args: list, kwargs: dict) -> dict:
    """The constructor's parameters by name, for `cls(*args, **kwargs)`.

    Raises:
        LoadError: the arguments do not fit the constructor's signature.
    """
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return dict(kwargs)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        call = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise LoadError(f"{cls.__name__}({call}): {error} (check --init)") from error
    return dict(bound.arguments)


def factory_of(cls: type[nn.Module], args: list, kwargs: dict) -> Callable[[], nn.Module]:
    """A function building a new instance; what the constructor raises is the module's."""

    def factory() -> nn.Module:
        with user_code():
            return cls(*args, **kwargs)

    return factory


_SIZES = {
    "d_in": ("d_in", "embed_dim", "d_model", "n_embd", "hidden_size"),
    "context_length": (
        "context_length",
        "block_size",
        "n_positions",
        "max_position_embeddings",
        "max_seq_len",
    ),
    "num_heads": ("num_heads", "n_head", "n_heads", "num_attention_heads"),
}


def sizes_from_init(arguments: dict) -> dict[str, int]:
    """d_in, context_length and num_heads where the constructor's arguments name them
    (a nested `cfg`/`config` dict too, as the book's GPTModel(cfg) takes)."""
    found: dict[str, int] = {}
    nested = [v for k, v in arguments.items() if k in ("cfg", "config") and isinstance(v, dict)]
    for source in (arguments, *nested):
        for size, names in _SIZES.items():
            for name in names:
                value = source.get(name)
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
                if ok and size not in found:
                    found[size] = value
    return found


def _import(file: Path):
    """Import a file as a module, with its folder on sys.path for its own imports."""
    folder = str(file.resolve().parent)
    spec = importlib.util.spec_from_file_location(f"attnlab_check_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {file} (not a Python file?)")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    try:
        with user_code():
            spec.loader.exec_module(module)
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module
