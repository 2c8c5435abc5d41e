"""Checkpoints: attnlab.save(module, path) writes a MultiHeadAttention's tensors as
safetensors, with its constructor arguments in the file's metadata; attnlab.load(path)
builds it back. Nothing is unpickled: safetensors holds only tensors and strings, and a
book checkpoint (.pth/.pt, a state_dict from torch.save) is read with
torch.load(weights_only=True), which refuses pickled code.

A file that is not valid safetensors, carries no attnlab metadata, or whose tensors do not
fit its own configuration is a ValueError naming the file and what is wrong.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from attnlab import __version__
from attnlab.attention import MultiHeadAttention

FORMAT = "attnlab.MultiHeadAttention"
_BOOK_SUFFIXES = (".pth", ".pt")


def save(module: MultiHeadAttention, path: str | Path) -> Path:
    """Write `module` to `path` (.safetensors): every state_dict tensor, contiguous and on
    the CPU, and its config in the metadata. Returns the path."""
    from safetensors.torch import save_file

    if not isinstance(module, MultiHeadAttention):
        raise TypeError(
            f"module must be an attnlab.MultiHeadAttention, got {type(module).__name__}"
        )
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"path must end in .safetensors, got {str(path)!r}")
    tensors = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    metadata = {"format": FORMAT, "config": json.dumps(module.config), "version": __version__}
    save_file(tensors, str(path), metadata=metadata)
    return path


def load(
    path: str | Path,
    *,
    device: torch.device | str | None = None,
    **book_config,
) -> MultiHeadAttention:
    """A MultiHeadAttention from an attnlab .safetensors file, or from a book checkpoint
    (.pth/.pt: the state_dict of attnlab.book.MultiHeadAttention or the chapter's class),
    which holds no configuration: pass num_heads (and dropout, causal, ... as wanted);
    d_in, d_out, context_length and qkv_bias are read from its tensors."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such checkpoint: {str(path)!r}")
    if path.suffix in _BOOK_SUFFIXES:
        return _load_book(path, device, book_config)
    if path.suffix != ".safetensors":
        raise ValueError(f"{str(path)!r}: expected .safetensors, .pth or .pt")
    if book_config:
        raise TypeError(
            f"load() takes configuration only for book checkpoints; {str(path)!r} carries "
            f"its own (got {sorted(book_config)})"
        )
    tensors, config = _read_safetensors(path)
    module = _build(path, config)
    _load_state(path, module, tensors)
    return module.to(device) if device is not None else module


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{str(path)!r} is not a valid safetensors file: {error}") from error
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"{str(path)!r} is not an attnlab checkpoint (metadata format "
            f"{metadata.get('format')!r}, expected {FORMAT!r})"
        )
    try:
        config = json.loads(metadata["config"])
    except (KeyError, json.JSONDecodeError) as error:
        raise ValueError(f"{str(path)!r}: its config metadata is missing or not JSON") from error
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r}: its config metadata is not a JSON object")
    return tensors, config


def _build(path: Path, config: dict) -> MultiHeadAttention:
    """The module the config describes (on the CPU; the dtype follows the tensors)."""
    try:
        return MultiHeadAttention(**config)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{str(path)!r}: its config does not build a module: {error}") from error


def _load_state(path: Path, module: MultiHeadAttention, tensors: dict) -> None:
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        module.to(dtypes.pop())
    try:
        module.load_state_dict(tensors)
    except (RuntimeError, ValueError) as error:
        first = str(error).strip().splitlines()
        raise ValueError(
            f"{str(path)!r}: its tensors do not fit its config: {' '.join(first)[:400]}"
        ) from error


def _load_book(path: Path, device, config: dict) -> MultiHeadAttention:
    """A book state_dict (W_query/W_key/W_value, out_proj, mask) into MultiHeadAttention."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise ValueError(
            f"{str(path)!r} is not a plain state_dict of tensors (torch.load with "
            f"weights_only=True refused it: {reason})"
        ) from error
    if not isinstance(state, dict) or "W_query.weight" not in state:
        raise ValueError(
            f"{str(path)!r} is not a book MultiHeadAttention state_dict (no W_query.weight)"
        )
    if "num_heads" not in config:
        raise TypeError(
            f"a book checkpoint does not record num_heads: pass it, load({str(path)!r}, "
            f"num_heads=...)"
        )
    weight = state["W_query.weight"]
    mask = state.get("mask")
    inferred = {
        "d_in": weight.shape[1],
        "d_out": weight.shape[0],
        "qkv_bias": "W_query.bias" in state,
        "dropout": 0.0,
    }
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        inferred["context_length"] = mask.shape[0]
    module = _build(path, {**inferred, **config})
    _load_state(path, module, state)
    return module.to(device) if device is not None else module
