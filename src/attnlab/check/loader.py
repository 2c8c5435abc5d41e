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
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from attnlab.check import model_parallel, weights
from attnlab.check.report import joined
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


class Factory:
    """Builds new instances of the audited class; what the constructor raises is the
    module's. Around the constructor:

    - on a machine without CUDA, `.cuda()` (a cache allocated on the GPU, as reference
      implementations do) leaves the tensor or module on the CPU;
    - a file that imported fairscale's model parallelism gets a one-process group;
    - matrix weights left unset (not set from the seed, so different at a second build from
      the same random state, or non-finite, huge or all zero: weights) are filled from
      `seed`.

    `setup` says, a line each, what was done for the audit to run (read by the report).
    """

    def __init__(self, cls: type[nn.Module], args: list, kwargs: dict, seed: int = 0):
        self.cls, self.args, self.kwargs, self.seed = cls, args, kwargs, seed
        self.setup: list[str] = []
        self._unseeded: set[str] | None = None  # known after the first build

    def __call__(self) -> nn.Module:
        group = model_parallel.prepare()
        state = torch.random.get_rng_state()
        module = self._build()
        if self._unseeded is None:  # a twin from the same state: what the seed does not set
            after = torch.random.get_rng_state()
            torch.random.set_rng_state(state)
            self._unseeded = weights.unseeded(module, self._build())
            torch.random.set_rng_state(after)
        filled = weights.fill_unset(module, self.seed, self._unseeded)
        if group:
            self.setup.append(group)
        if filled and not any(line.startswith(_FILLED) for line in self.setup):
            self.setup.append(f"{_FILLED} {joined(filled, 6)}, filled from the seed")
        return module

    def _build(self) -> nn.Module:
        with user_code(), _cuda_on_cpu():
            return self.cls(*self.args, **self.kwargs)


_FILLED = "weights the constructor leaves unset (not from the seed, NaN, huge or zero):"


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
    - a layer index (layer_idx, layer_id, ...) not given, required or defaulting to None,
      is 0 (a cache is indexed by it).
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
        unset = parameter.default is inspect.Parameter.empty or parameter.default is None
        if name in _LAYER_INDEX_NAMES and unset and name not in kwargs:
            kwargs[name] = 0  # a cache is indexed by it: transformers' classes default to None
            notes.append(f"{name}=0 (a layer index not given)")
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


def _config_class(cls: type, name: str) -> tuple[type | None, bool]:
    """The class parameter `name` is annotated with, or the one its module holds, in the
    nearest class of cls's MRO that says (a subclass written elsewhere takes its base's),
    and whether it came from an annotation."""
    for base in cls.__mro__[:-1]:  # object says nothing
        try:
            annotation = typing.get_type_hints(base.__init__).get(name)
        except Exception:  # unresolvable string annotations: no class to build
            annotation = None
        if isinstance(annotation, type):
            return annotation, True
        found = _module_config_class(base)
        if found is not None:
            return found, False
    return None, False


def _config(cls: type, name: str, fields: dict) -> tuple[object, str]:
    """The configuration object for parameter `name` from --init's fields, and its kind.
    An annotated class that does not take the fields is a usage error; a class guessed from
    the file (its one ...Config or ...Args dataclass) that does not take them leaves the
    parameter a ConfigDict (another class of the file reads its config as a dict)."""
    found, annotated = _config_class(cls, name)
    if isinstance(found, type) and found not in (dict, object):
        try:
            with user_code():
                return found(**fields), found.__name__
        except TypeError as error:
            if annotated:
                message = f"{found.__name__}(**--init): {error} (check --init)"
                raise LoadError(message) from error
            kind = f"a ConfigDict (attribute and item access; the file's {found.__name__} "
            return ConfigDict(fields), f"{kind}does not take them: {error})"
    return ConfigDict(fields), "a ConfigDict (attribute and item access)"


_SIZES = {
    "d_in": ("d_in", "embed_dim", "d_model", "n_embd", "hidden_size", "dim"),
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
    """d_in, context_length and num_heads where the constructor's arguments name them, or
    the configuration it takes does (a `cfg`/`config`/`args`... dict, as the book's
    GPTModel(cfg) takes, or object: a dataclass such as Meta's ModelArgs, an HF config)."""
    found: dict[str, int] = {}
    nested = [v for k, v in arguments.items() if k in _CONFIG_NAMES and v is not None]
    for source in (arguments, *nested):
        for size, names in _SIZES.items():
            for name in names:
                value = (
                    source.get(name) if isinstance(source, dict) else getattr(source, name, None)
                )
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
                if ok and size not in found:
                    found[size] = value
    return found


def _package_name(file: Path) -> str | None:
    """The dotted name a file of a package on sys.path (every folder between with an
    __init__.py) imports as, when that name imports this very file; else None."""
    if not (file.parent / "__init__.py").is_file():
        return None
    for entry in sys.path:
        root = Path(entry or ".").resolve()
        if root in file.parents and all(
            (folder / "__init__.py").is_file()
            for folder in file.parents
            if folder != root and root in folder.parents
        ):
            parts = file.relative_to(root).with_suffix("").parts
            spec = importlib.util.find_spec(parts[0])
            if (
                spec is not None
                and spec.origin
                and Path(spec.origin).resolve().parent == root / parts[0]
            ):
                return ".".join(parts)
    return None


def _import(file: Path):
    """Import a file as a module: a file of an importable package (transformers'
    modeling_llama.py, with its relative imports) by its dotted name, any other with its
    folder on sys.path for its own imports."""
    dotted = _package_name(file.resolve())
    if dotted is not None:
        with user_code():
            return importlib.import_module(dotted)
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
