"""Checkpoints: attnlab.save(module, path) writes a MultiHeadAttention's tensors as
safetensors, with its constructor arguments and a checksum in the file's metadata;
attnlab.load(path) builds it back. Nothing is unpickled: safetensors holds only tensors and
strings, and a book checkpoint (.pth/.pt, a state_dict from torch.save) is read with
torch.load(weights_only=True), which refuses pickled code.

The file is data, checked as data before anything is built from it, in this order:

1. the config against a schema (known keys, each of its type and range; no device or
   dtype: the file says what the weights are, the caller says where they go);
2. the memory the module needs beyond its stored tensors (the rotary tables, which grow with
   context_length) against the memory the machine has;
3. every tensor's name, shape and dtype, from the file's header, against a module built
   from the config on the meta device (which allocates nothing);
4. the checksum: sha256 over the metadata and every tensor's name, dtype, shape and bytes.

Then the tensors are read (memory bounded by the file's size) and assigned to the meta
module's parameters. Any failure is a ValueError naming the file, the key or tensor, and
the values; a file saved before checksums existed loads with a UserWarning.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import pickle
import secrets
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from attnlab import __version__, functional, qkv, rope_scaling
from attnlab._memory import available_bytes
from attnlab._validate import check_bool, check_dropout, check_finite, check_float, check_size
from attnlab.attention import MultiHeadAttention
from attnlab.rope import check_base

FORMAT = "attnlab.MultiHeadAttention"
_BOOK_SUFFIXES = (".pth", ".pt")
_FLOAT_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_SAFETENSORS_DTYPES = {  # the header's names, as torch names them
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
}
_METADATA_KEYS = ("format", "config", "version", "checksum")
_REQUIRED = ("d_in", "d_out", "context_length", "dropout", "num_heads")
_CALLER_KEYS = ("device", "dtype")
_ROPE_BYTES_PER_ENTRY = 24  # rotary_tables' float64 angles, cos/sin and float32 copies
_HINT_PRODUCTION = (
    "it is attnlab.MultiHeadAttention's own state_dict (torch.save(module.state_dict())), "
    "which records no configuration: build MultiHeadAttention(<its arguments>) and call "
    "module.load_state_dict(torch.load(path, weights_only=True)) (safetensors: "
    "safetensors.torch.load_file); attnlab.save(module, path) writes a file that "
    "attnlab.load reads by itself"
)
_HINT_TORCH = (
    "it is a torch.nn.MultiheadAttention state_dict: load it into nn.MultiheadAttention "
    "and convert the module with attnlab.interop.from_torch"
)


def save(module: MultiHeadAttention, path: str | os.PathLike) -> Path:
    """Write `module` to `path` (.safetensors): every state_dict tensor, contiguous and on
    the CPU, its config (numpy integers written as ints) and a checksum in the metadata.

    The file is written beside `path` and then renamed over it: a save that raises leaves
    any file already at `path` as it was.

    Args:
        module: the attnlab.MultiHeadAttention to save.
        path: where to write it; must end in .safetensors, its folder must exist.

    Returns:
        The path, as a pathlib.Path.

    Raises:
        TypeError: module is not an attnlab.MultiHeadAttention, or path not a str/PathLike.
        ValueError: path does not end in .safetensors; the module's tensors are not of one
            floating-point dtype or hold no data (meta device); its config fails the schema.
        FileNotFoundError: the folder of path does not exist.
    """
    from safetensors.torch import save_file

    if not isinstance(module, MultiHeadAttention):
        raise TypeError(
            f"module must be an attnlab.MultiHeadAttention, got {type(module).__name__}"
        )
    if module.shards > 1:
        raise ValueError(
            f"module is one shard of {module.shards} (attnlab.parallel.tensor_parallel): save "
            f"the unsharded module, whose config and weights are whole"
        )
    path = _check_path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"path must end in .safetensors, got {str(path)!r}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"path's folder {str(path.parent)!r} does not exist")
    where = "module"
    config = _check_config(where, _plain_numbers(module.config))
    tensors = _saved_tensors(module)
    _file_dtype(where, {k: (_dtype_name(v), tuple(v.shape)) for k, v in tensors.items()})
    metadata = {"format": FORMAT, "config": json.dumps(config), "version": __version__}
    metadata["checksum"] = checksum(metadata, tensors)
    _write_atomically(path, lambda target: save_file(tensors, target, metadata=metadata))
    return path


def load(
    path: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    **book_config: object,
) -> MultiHeadAttention:
    """A MultiHeadAttention from an attnlab .safetensors file, or from a book checkpoint.

    A book checkpoint (.pth/.pt: the state_dict of attnlab.book.MultiHeadAttention or the
    chapter's class) holds no configuration: pass num_heads (and dropout, causal, ... as
    wanted); d_in, d_out, context_length and qkv_bias are read from its tensors.

    Args:
        path: the file (.safetensors, .pth or .pt).
        device: where to put the module (default: the CPU).
        **book_config: MultiHeadAttention arguments, for book checkpoints only (no dtype:
            the file's tensors decide it; convert afterwards with module.to).

    Returns:
        The module, in the file's dtype, on `device`.

    Raises:
        TypeError: path is not a str/PathLike; device is not a str/torch.device; config
            arguments given for a safetensors file, or a dtype for a book file.
        FileNotFoundError: no file at path.
        ValueError: the file is not an attnlab or book checkpoint (with a hint naming the
            function that fits a state_dict of another kind), a book file lacks tensors
            (each named), its config metadata is not readable JSON (too deep included) or
            fails the schema (a size past MAX_SIZE included), its tensors do not fit its
            config or are not floating-point, its checksum does not match, the module would
            need more memory than the machine has, or device names no available device.
    """
    path = _check_path(path)
    device = _check_device(device)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint: {str(path)!r}")
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a file")
    if path.suffix in _BOOK_SUFFIXES:
        module = _load_book(path, book_config)
    elif path.suffix != ".safetensors":
        raise ValueError(f"{str(path)!r}: expected .safetensors, .pth or .pt")
    elif book_config:
        raise TypeError(
            f"load() takes configuration only for book checkpoints; {str(path)!r} carries "
            f"its own (got {sorted(book_config)})"
        )
    else:
        module = _load_safetensors(path)
    return module.to(device) if device is not None else module


def checksum(metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
    """The file's checksum: sha256 of every metadata entry but the checksum itself and of
    every tensor's name, dtype, shape and bytes, in sorted order.

    It detects accidental corruption (a flipped bit, a truncated or mixed-up file, a hand
    edit of the config); it is no signature: whoever edits a file can recompute it.

    Args:
        metadata: the file's string metadata.
        tensors: its tensors (contiguous, on the CPU).

    Returns:
        "sha256:<hex digest>", the string stored under metadata["checksum"].
    """
    digest = hashlib.sha256()
    for key in sorted(k for k in metadata if k != "checksum"):
        digest.update(json.dumps([key, metadata[key]]).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(json.dumps([name, _dtype_name(tensor), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()


# --- arguments -------------------------------------------------------------------------


def _check_path(path: object) -> Path:
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return Path(path)


def _check_device(device: object) -> torch.device | None:
    """The device, if torch can place a tensor there (probed with an empty one)."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as error:
        raise ValueError(f"device {str(device)!r} is not available: {error}") from error
    return device


# --- the config schema ---------------------------------------------------------------


def _size(key: str, value: object) -> int:
    return check_size(key, value)


def _optional_size(key: str, value: object) -> int | None:
    return None if value is None else check_size(key, value)


def _finite(key: str, value: object) -> None:
    if isinstance(value, numbers.Real) and not math.isfinite(value):
        raise ValueError(f"{key} must be finite, got {value}")


def _probability(key: str, value: object) -> float:
    _finite(key, value)
    return check_dropout(key, value)


def _rope_base(key: str, value: object) -> float:
    _finite(key, value)
    return check_base(value)


def _positive(key: str, value: object) -> float:
    return check_float(key, value, greater_than=0.0)


def _number(key: str, value: object) -> float:
    return check_float(key, value)


def _qk_norm(key: str, value: object) -> str | None:
    if value not in (None, "head", "projection"):
        raise ValueError(f"{key} must be None, 'head' or 'projection', got {value!r}")
    return value


def _backend(key: str, value: object) -> str:
    try:
        return functional.check_backend(value)
    except ValueError as error:
        raise ValueError(f"{key}: {error}") from None


_SCHEMA: dict[str, Callable[[str, object], object]] = {
    "d_in": _size,
    "d_out": _size,
    "context_length": _size,
    "dropout": _probability,
    "num_heads": _size,
    "qkv_bias": check_bool,
    "num_kv_heads": _optional_size,
    "causal": check_bool,
    "context_dim": _optional_size,
    "rope": check_bool,
    "rope_base": _rope_base,
    "window": _optional_size,
    "backend": _backend,
    "rope_scaling": lambda key, value: rope_scaling.check_scaling(value, key),
    "rotary_dim": _optional_size,
    "qk_norm": _qk_norm,
    "qk_norm_eps": _positive,
    "qk_norm_offset": _number,
    "scale": lambda key, value: None if value is None else _positive(key, value),
}


def _check_config(where: str, config: Mapping) -> dict:
    """`config` if every key is known and every value of its type and range; otherwise a
    ValueError naming the key and the value (the file is data: a wrong type is a bad value)."""
    for key, value in config.items():
        if key in _CALLER_KEYS:
            raise ValueError(
                f"{where}: config[{_shown(key)}] = {_shown(value)} is not accepted: a file says "
                f"what the weights are, the caller says where they go (attnlab.load(path, "
                f"device=...), then module.to(dtype))"
            )
        if key not in _SCHEMA:
            raise ValueError(
                f"{where}: config[{_shown(key)}] = {_shown(value)} is not a MultiHeadAttention "
                f"argument (known: {', '.join(_SCHEMA)})"
            )
        try:
            _SCHEMA[key](f"config[{key!r}]", value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {_shown(error, str)}") from error
    missing = [key for key in _REQUIRED if key not in config]
    if missing:
        raise ValueError(f"{where}: config lacks {', '.join(map(repr, missing))}")
    return dict(config)


def _shown(value: object, show: Callable[[object], str] = repr, width: int = 300) -> str:
    """A value (the file's data) as a message shows it: at most `width` characters."""
    text = show(value)
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _plain_numbers(config: Mapping) -> dict:
    """numpy (or any numbers.Integral / numbers.Real) scalars as Python int / float."""
    plain = {}
    for key, value in config.items():
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
        plain[key] = value
    return plain


# --- memory, building, tensors ---------------------------------------------------------


def _available_bytes() -> int | None:
    """Memory the machine can give now (attnlab._memory), looked up here so tests can
    patch it for this module alone."""
    return available_bytes()


def _check_rope_memory(where: str, config: Mapping) -> None:
    """Refuse a config whose rotary tables (context_length x head_dim, not stored in the
    file) would need more memory than the machine has, before they are computed."""
    sizes = [config.get(key) for key in ("context_length", "d_out", "num_heads")]
    if config.get("rope") is not True or not all(_is_size(size) for size in sizes):
        return  # no tables, or arguments the constructor refuses
    head_dim = max(1, config["d_out"] // config["num_heads"])
    needed = config["context_length"] * (8 + _ROPE_BYTES_PER_ENTRY * head_dim)
    available = _available_bytes()
    if available is not None and needed > available:
        raise ValueError(
            f"{where}: context_length ({config['context_length']}) with rope needs rotary "
            f"tables of about {needed / 2**30:.1f} GiB to build (head_dim {head_dim}); the "
            f"machine has {available / 2**30:.1f} GiB available"
        )


def _is_size(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _build_on_meta(where: str, config: Mapping, dtype: torch.dtype) -> MultiHeadAttention:
    """The module the config describes, its parameters on the meta device (no memory)."""
    try:
        return MultiHeadAttention(**config, device="meta", dtype=dtype)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: its config does not build a module: {error}") from error


def _file_dtype(where: str, specs: Mapping[str, tuple[str, tuple[int, ...]]]) -> torch.dtype:
    """The one floating-point dtype of the tensors; a ValueError naming any other."""
    for name, (dtype, _) in specs.items():
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{where}: tensor {name!r} has dtype {dtype}; weights are floating-point "
                f"({', '.join(_FLOAT_DTYPES)}), never cast from another dtype"
            )
    found = sorted({dtype for dtype, _ in specs.values()})
    if len(found) > 1:
        raise ValueError(f"{where}: its tensors must share one dtype, got {found}")
    return _FLOAT_DTYPES[found[0]] if found else torch.float32


def _check_specs(
    where: str, module: MultiHeadAttention, specs: Mapping[str, tuple[str, tuple[int, ...]]]
) -> None:
    """Every tensor's name, shape and dtype as the (meta) module needs them."""
    _file_dtype(where, specs)
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(specs)), sorted(set(specs) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{where}: its tensors do not fit its config: missing {missing}, unexpected "
            f"{unexpected}"
        )
    for name, shape in expected.items():
        if specs[name][1] != shape:
            raise ValueError(
                f"{where}: its tensors do not fit its config: tensor {name!r} has shape "
                f"{specs[name][1]} in the file, its config needs {shape}"
            )


def _assign(module: MultiHeadAttention, tensors: Mapping[str, torch.Tensor]) -> None:
    """The tensors become the meta module's parameters; the rotary tables (not stored)
    are then computed on the CPU."""
    module.load_state_dict(tensors, assign=True)
    if module.rope is not None:
        module.rope.to_empty(device="cpu")


def _saved_tensors(module: MultiHeadAttention) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, tensor in module.state_dict().items():
        if tensor.is_meta:
            raise ValueError(f"module: tensor {name!r} is on the meta device (it holds no data)")
        tensors[name] = tensor.detach().cpu().contiguous()
    return tensors


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """write(temporary) beside path, then rename it over path (atomic on one filesystem)."""
    temporary = str(path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial"))
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


# --- safetensors -----------------------------------------------------------------------


def _load_safetensors(path: Path) -> MultiHeadAttention:
    where = repr(str(path))
    metadata, specs = _read_header(path)
    config = _check_config(where, _read_config(path, metadata, specs))
    _check_rope_memory(where, config)
    dtype = _file_dtype(where, specs)
    module = _build_on_meta(where, config, dtype)
    _check_specs(where, module, specs)
    tensors = _read_tensors(path)
    _verify_checksum(where, metadata, tensors)
    _check_finite_weights(where, tensors)
    _assign(module, tensors)
    return module


def _check_finite_weights(where: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """A weight that is NaN or infinite (a diverged training run, saved) makes every output
    NaN: refused by name, with the first bad index."""
    for name, tensor in tensors.items():
        try:
            check_finite(f"tensor {name!r}", tensor)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None


def _read_header(path: Path) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...]]]]:
    """The metadata and each tensor's (dtype name, shape), without reading tensor data."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            specs = {}
            for name in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
                piece = file.get_slice(name)
                dtype = piece.get_dtype()
                specs[name] = (_SAFETENSORS_DTYPES.get(dtype, dtype), tuple(piece.get_shape()))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{str(path)!r} is not a valid safetensors file: {error}") from error
    return metadata, specs


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors, copied into memory: safetensors maps the file, and a module whose
    parameters alias the file would change when the file is overwritten."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            return {name: file.get_tensor(name).clone() for name in file.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{str(path)!r} is not a valid safetensors file: {error}") from error


def _read_config(path: Path, metadata: Mapping[str, str], specs: Mapping) -> dict:
    if metadata.get("format") != FORMAT:
        hint = _foreign_hint(specs)
        raise ValueError(
            f"{str(path)!r} is not an attnlab checkpoint (metadata format "
            f"{metadata.get('format')!r}, expected {FORMAT!r})" + (f": {hint}" if hint else "")
        )
    if "config" not in metadata:
        raise ValueError(f"{str(path)!r}: its config metadata is missing")
    try:
        config = json.loads(metadata["config"])
    except (ValueError, TypeError, RecursionError) as error:  # any JSON failure, depth too
        reason = "nested too deep" if isinstance(error, RecursionError) else error
        raise ValueError(
            f"{str(path)!r}: its config metadata is not readable JSON ({reason})"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r}: its config metadata is not a JSON object")
    unknown = sorted(set(metadata) - set(_METADATA_KEYS))
    if unknown:  # e.g. a damaged "checksum" key, which must not pass for an old file
        raise ValueError(
            f"{str(path)!r}: unknown metadata keys {unknown} (known: {list(_METADATA_KEYS)})"
        )
    return config


def _verify_checksum(where: str, metadata: Mapping[str, str], tensors: Mapping) -> None:
    stored = metadata.get("checksum")
    if stored is None:
        warnings.warn(
            f"{where} has no checksum (saved before attnlab wrote them): loaded without "
            f"verifying its bytes; attnlab.save(attnlab.load(path), path) adds one",
            UserWarning,
            stacklevel=4,
        )
        return
    computed = checksum(metadata, tensors)
    if stored != computed:
        raise ValueError(
            f"{where}: its checksum does not match its contents (stored {stored[:23]}..., "
            f"computed {computed[:23]}...): the file is corrupted or was edited"
        )


def _foreign_hint(names: Mapping | list) -> str:
    """Which function fits a state_dict that is not the book's or an attnlab file."""
    names = set(names)
    if "out_proj.weight" in names and names & {"qkv_proj.weight", "q_proj.weight"}:
        return _HINT_PRODUCTION
    if names & {"in_proj_weight", "q_proj_weight"}:
        return _HINT_TORCH
    return ""


# --- book checkpoints ------------------------------------------------------------------


def _load_book(path: Path, config: dict) -> MultiHeadAttention:
    """A book state_dict (W_query/W_key/W_value, out_proj, mask) into MultiHeadAttention."""
    where = repr(str(path))
    state = _read_book_state(path)
    if "W_query.weight" not in state:
        hint = _foreign_hint(state)
        raise ValueError(
            f"{where} is not a book MultiHeadAttention state_dict (no W_query.weight)"
            + (f": {hint}" if hint else "")
        )
    _check_book_tensors(where, state, config)
    if "num_heads" not in config:
        raise TypeError(
            f"a book checkpoint does not record num_heads: pass it, load({str(path)!r}, "
            f"num_heads=...)"
        )
    if "dtype" in config:
        raise TypeError("load() takes no dtype: the file's tensors decide it (then module.to)")
    config = {**_book_shapes(where, state), **config}
    weights = {k: v for k, v in state.items() if k != "mask"}
    dtype = _file_dtype(where, {k: (_dtype_name(v), tuple(v.shape)) for k, v in weights.items()})
    _check_rope_memory(where, config)
    module = _build_on_meta(where, config, dtype)
    try:
        _assign(module, state)
    except (RuntimeError, ValueError) as error:
        first = " ".join(str(error).strip().splitlines())[:400]
        raise ValueError(f"{where}: its tensors do not fit its config: {first}") from error
    return module


def _check_book_tensors(where: str, state: Mapping[str, torch.Tensor], config: Mapping) -> None:
    """Every tensor a book MultiHeadAttention state_dict holds, named if missing: the query,
    key and value weights (and all three biases or none), out_proj's weight and bias, and the
    causal mask, which records context_length (not needed when the caller passes it)."""
    weights = [f"{p}.weight" for p in qkv.BOOK_PROJECTIONS]
    biases = [f"{p}.bias" for p in qkv.BOOK_PROJECTIONS]
    needed = [*weights, *(biases if any(b in state for b in biases) else ()), "out_proj.weight"]
    needed += ["out_proj.bias", *(() if "context_length" in config else ("mask",))]
    missing = [name for name in needed if name not in state]
    if missing:
        hint = (
            " (the mask records context_length: pass context_length=... where the file has none)"
            if "mask" in missing
            else ""
        )
        raise ValueError(
            f"{where}: a book MultiHeadAttention state_dict must hold {needed}; this one "
            f"lacks {missing}{hint}"
        )
    mask = state.get("mask")
    if mask is not None and (mask.dim() != 2 or mask.shape[0] != mask.shape[1]):
        raise ValueError(
            f"{where}: tensor 'mask' must be (context_length, context_length), got shape "
            f"{tuple(mask.shape)}"
        )


def _read_book_state(path: Path) -> dict[str, torch.Tensor]:
    """torch.load(weights_only=True), then a dict of str to tensors or a ValueError."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise ValueError(
            f"{str(path)!r} is not a plain state_dict of tensors (torch.load with "
            f"weights_only=True refused it: {reason})"
        ) from error
    if not isinstance(state, dict):
        raise ValueError(f"{str(path)!r} is not a state_dict: it holds a {type(state).__name__}")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{str(path)!r}: entry {key!r} is not a tensor ({type(value).__name__}); a "
                f"state_dict maps names to tensors"
            )
    return state


def _book_shapes(where: str, state: Mapping[str, torch.Tensor]) -> dict:
    """d_in, d_out, qkv_bias and context_length as the book's tensors record them."""
    weight = state["W_query.weight"]
    if weight.dim() != 2:
        raise ValueError(
            f"{where}: tensor 'W_query.weight' must be 2-D (d_out, d_in), got shape "
            f"{tuple(weight.shape)}"
        )
    names = [f"W_{kind}.weight" for kind in ("query", "key", "value")]
    shapes = {n: tuple(state[n].shape) for n in names if n in state}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"{where}: the query, key and value weights differ in shape: {shapes}")
    inferred = {"d_in": weight.shape[1], "d_out": weight.shape[0]}
    inferred.update(qkv_bias="W_query.bias" in state, dropout=0.0)
    mask = state.get("mask")
    if mask is not None and mask.dim() == 2:
        inferred["context_length"] = mask.shape[0]
    return inferred
