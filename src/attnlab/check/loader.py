"""`attnlab check FILE.py:ClassName --init JSON`: import a class from a file and build it.

A target or constructor arguments that cannot give a module are a LoadError (a usage
error). What the file's own code raises at import or in the constructor goes through,
marked as the module's (runner.user_code), to be reported as a finding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import json
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
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
    """A function building a new instance; what the constructor raises is the module's.
    On a machine without CUDA, `.cuda()` in the constructor (a cache allocated on the GPU,
    as reference implementations do) leaves the tensor or module on the CPU."""

    def factory() -> nn.Module:
        with user_code(), _cuda_on_cpu():
            return cls(*args, **kwargs)

    return factory


@contextlib.contextmanager
def _cuda_on_cpu() -> Iterator[None]:
    """Tensor.cuda and Module.cuda as no-ops while CUDA is unavailable (else as they are)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.Tensor.cuda, nn.Module.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    nn.Module.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda, nn.Module.cuda = saved


# constructor parameters that take a configuration object, and per-layer indices
_CONFIG_NAMES = ("config", "cfg", "args", "model_args", "params", "hparams", "conf")
_LAYER_INDEX_NAMES = ("layer_idx", "layer_id", "layer_number", "block_idx")


class ConfigDict(dict):
    """--init's object as a configuration that reads both ways: cfg["emb_dim"] (the book's
    GPTModel) and config.n_embd (nanoGPT's, minGPT's, Meta's without an annotation)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the configuration from --init has no {name!r}") from None


def adapt_init(cls: type, args: list, kwargs: dict) -> tuple[list, dict, list[str]]:
    """--init's arguments shaped for the constructor, and a line per change made:

    - a constructor taking a configuration (a parameter named config, cfg, args, ...) gets
      it built from the JSON object: the parameter's annotated class called with its
      fields (a dataclass, a transformers config), else a ConfigDict; an object whose keys
      are not constructor parameters is taken as that configuration whole;
    - a required layer index (layer_idx, layer_id, ...) not given is 0.
    """
    try:
        parameters = dict(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return args, kwargs, []
    notes: list[str] = []
    kwargs = dict(kwargs)
    config_name = next((n for n in parameters if n in _CONFIG_NAMES), None)
    if config_name and not args and not set(kwargs) & set(parameters):
        kwargs = {config_name: kwargs}  # {} too: a configuration class's defaults
    if config_name and isinstance(kwargs.get(config_name), dict):
        kwargs[config_name], built = _config(cls, config_name, kwargs[config_name])
        notes.append(f"{config_name} built from --init as {built}")
    for name, parameter in list(parameters.items())[len(args) :]:
        required = parameter.default is inspect.Parameter.empty
        if name in _LAYER_INDEX_NAMES and required and name not in kwargs:
            kwargs[name] = 0
            notes.append(f"{name}=0 (a required layer index not given)")
    return args, kwargs, notes


def _module_config_class(cls: type) -> type | None:
    """The one configuration class the module defining `cls` holds, for an unannotated
    `config`: a dataclass named ...Config or ...Args (nanoGPT's GPTConfig beside
    GPT(config)), else a transformers configuration (a ...Config with a `model_type`, as
    GPT2Attention(config) beside GPT2Config); None when there is not exactly one."""
    namespace = vars(sys.modules.get(cls.__module__, object()))
    named = [v for k, v in namespace.items() if k.endswith(("Config", "Args"))]
    named = [v for v in named if isinstance(v, type)]
    for kind in (dataclasses.is_dataclass, lambda value: hasattr(value, "model_type")):
        found = {value for value in named if kind(value)}
        if found:
            return found.pop() if len(found) == 1 else None
    return None


def _config(cls: type, name: str, fields: dict) -> tuple[object, str]:
    """The configuration object for parameter `name` from --init's fields, and its kind."""
    try:
        annotation = typing.get_type_hints(cls.__init__).get(name)
    except Exception:  # unresolvable string annotations: no class to build
        annotation = None
    if not isinstance(annotation, type):
        annotation = _module_config_class(cls)
    if isinstance(annotation, type) and annotation not in (dict, object):
        try:
            with user_code():
                return annotation(**fields), annotation.__name__
        except TypeError as error:
            raise LoadError(f"{annotation.__name__}(**--init): {error} (check --init)") from error
    return ConfigDict(fields), "a ConfigDict (attribute and item access)"


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
    sys.modules[spec.name] = module  # dataclasses and typing resolve names through it
    sys.path.insert(0, folder)
    try:
        with user_code():
            spec.loader.exec_module(module)
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module
