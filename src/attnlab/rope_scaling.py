"""Rotary frequency schedules for contexts longer than a model was trained on: Llama 3's
frequency scaling, linear position scaling and YaRN, as transformers computes them
(`ROPE_INIT_FUNCTIONS`) and as the book's Llama 3.2 (`compute_rope_params` with its
`freq_config`) does.

A scaling is a dict in transformers' format, `{"rope_type": "llama3", "factor": 32.0,
"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings":
8192}` (the older key "type" is read too), or the book's `freq_config` (`factor`,
`low_freq_factor`, `high_freq_factor`, `original_context_length`), which is Llama 3's.
`check_scaling` turns either into one canonical dict; `inverse_frequencies` gives the
rotation speed of each feature pair and the factor the cos/sin tables are multiplied by
(YaRN's attention factor; 1 otherwise).
"""

from __future__ import annotations

import math
import numbers

import torch

TYPES = ("linear", "llama3", "yarn")
_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL = {
    "linear": (),
    "llama3": (),
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}
# keys transformers' dicts carry beside the scaling's own (read elsewhere, or not at all)
_CARRIED = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# transformers reads these as absent when 0 (`if mscale and mscale_all_dim`)
_ZERO_IS_ABSENT = ("mscale", "mscale_all_dim")
_BOOK_KEYS = {"factor", "low_freq_factor", "high_freq_factor", "original_context_length"}


def check_scaling(scaling: object, name: str = "rope_scaling") -> dict | None:
    """`scaling` as a canonical dict ({"rope_type": ..., its parameters as floats}), or None
    for None or transformers' "default" type.

    Args:
        scaling: None, transformers' rope_scaling / rope_parameters dict, or the book's
            freq_config dict.
        name: the argument's name, for messages.

    Returns:
        The canonical dict, or None.

    Raises:
        TypeError: not a dict, or a parameter that is not a number.
        ValueError: an unknown type, a missing or unknown key, or a value out of range.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"{name} must be a dict or None, got {type(scaling).__name__}")
    if set(scaling) == _BOOK_KEYS:  # the book's freq_config: Llama 3's schedule
        scaling = {
            "rope_type": "llama3",
            **{k: v for k, v in scaling.items() if k != "original_context_length"},
            "original_max_position_embeddings": scaling["original_context_length"],
        }
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in TYPES:
        raise ValueError(
            f"{name} has rope_type {kind!r}; attnlab computes {TYPES} (and the default)"
        )
    return {"rope_type": kind, **_parameters(scaling, kind, name)}


def _parameters(scaling: dict, kind: str, name: str) -> dict:
    allowed = _REQUIRED[kind] + _OPTIONAL[kind]
    unknown = sorted(set(scaling) - set(allowed) - set(_CARRIED))
    if unknown:
        raise ValueError(f"{name} of rope_type {kind!r} has unknown keys {unknown}")
    missing = [key for key in _REQUIRED[kind] if scaling.get(key) is None]
    if missing:
        raise ValueError(f"{name} of rope_type {kind!r} needs {missing}")
    parameters = {}
    for key in allowed:
        value = scaling.get(key)
        if value is None or (key in _ZERO_IS_ABSENT and value == 0):
            continue
        if key == "truncate":
            parameters[key] = _check_bool(f"{name}['truncate']", value)
            continue
        parameters[key] = _check_positive(f"{name}[{key!r}]", value)
    if kind == "llama3" and parameters["high_freq_factor"] <= parameters["low_freq_factor"]:
        raise ValueError(
            f"{name}: high_freq_factor ({parameters['high_freq_factor']}) must exceed "
            f"low_freq_factor ({parameters['low_freq_factor']})"
        )
    return parameters


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return float(value)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def inverse_frequencies(
    rotary_dim: int, base: float, scaling: dict | None
) -> tuple[torch.Tensor, float]:
    """The rotation speed of each of the rotary_dim / 2 feature pairs, and the factor the
    cos/sin tables are multiplied by.

    Args:
        rotary_dim: the rotated features, even.
        base: the frequency base (rope_theta).
        scaling: a dict check_scaling returned, or None.

    Returns:
        (inv_freq (rotary_dim / 2,) float64, attention_factor).
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = base**-exponents  # (rotary_dim / 2,)
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(inv_freq, rotary_dim, base, scaling)


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's schedule: long wavelengths slowed by `factor`, short ones kept, those
    between blended smoothly."""
    context = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = context / s["low_freq_factor"], context / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    smooth = (context / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"]
    )
    blended = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated (slowed by `factor`) frequencies below a correction range,
    extrapolated (kept) above it, a linear ramp between; the attention factor from factor,
    mscale and mscale_all_dim unless given."""
    factor = s["factor"]
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    low, high = _correction_range(s.get("beta_fast", 32.0), s.get("beta_slow", 1.0), dim, base, s)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # (dim / 2,): 1 where the pair keeps its frequency
    interpolated = inv_freq / factor
    return interpolated * (1 - extrapolated) + inv_freq * extrapolated, float(attention_factor)


def _correction_range(beta_fast, beta_slow, dim, base, s) -> tuple[float, float]:
    """The feature pairs between which YaRN ramps from extrapolation to interpolation."""
    context = s["original_max_position_embeddings"]

    def pair(rotations: float) -> float:  # the pair that turns `rotations` times in context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair(beta_fast), pair(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1);
    DeepSeek's attention scale multiplies by its square.

    Args:
        factor: the context extension factor.
        mscale: the coefficient.

    Returns:
        The correction.
    """
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
