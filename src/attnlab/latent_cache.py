"""LatentCache: what multi-head latent attention (attnlab.mla) keeps of the tokens seen so
far: per token, the normalised key/value latent (kv_lora_rank features) and the one rotary
key all heads share (qk_rope_head_dim features), and nothing per head. Keys and values are
expanded from it (or the queries folded into its space) at every step; the cache is
(kv_lora_rank + qk_rope_head_dim) / (2 * num_heads * head_dim) the size of a per-head
KVCache of the same width (DeepSeek-V3: 576 values a token against 32,768 for 128 heads of
128 features).

Layout: one buffer (b, capacity, kv_lora_rank + qk_rope_head_dim), each token a row of the
latent followed by its rotary key (DeepSeek's and FlashMLA's layout), so that the absorbed
decode step reads the held rows as one multi-query key head without a copy, and the latent
alone (its values) as a view of the same rows.

Shapes: latent (b, n, kv_lora_rank), rotary key (b, n, qk_rope_head_dim) per call; the held
rows come back (b, tokens so far, kv_lora_rank + qk_rope_head_dim).

Writes are in place, except where autograd records them (a latent that requires grad, or a
buffer that already holds such): there a write makes a new buffer, so that a backward through
several cached calls finds the tensors it saved unchanged. A narrower storage dtype
(bfloat16 or float16 for a float32 module) halves the cache; rows are read back in the
module's dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from attnlab import _own_code, kv_cache
from attnlab._validate import check_device, check_size

NARROWER = (torch.bfloat16, torch.float16)  # stored narrower than given, read back wider


class LatentCache:
    """Preallocated latent rows for `batch_size` sequences of up to `max_tokens` tokens.

    MultiHeadLatentAttention.make_cache builds one for a module; pass it as `cache=`. One
    cache per layer.

    Args:
        batch_size: sequences held (an int >= 1).
        max_tokens: positions each sequence may reach (an int >= 1).
        kv_lora_rank: features of the key/value latent (an int >= 1).
        qk_rope_head_dim: features of the shared rotary key (an int >= 0; 0 holds none).
        dtype: the storage dtype: the module's, or narrower (bfloat16/float16); default
            torch's.
        device: where the buffer goes.

    Raises:
        TypeError: a size that is not an int, a dtype that is not floating point.
        ValueError: a size out of range, or a device torch does not know.

    Example:
        >>> cache = LatentCache(2, 128, kv_lora_rank=512, qk_rope_head_dim=64)
        >>> cache.bytes_per_token  # (512 + 64) features x 4 bytes x 2 sequences
        4608
    """

    def __init__(
        self,
        batch_size: int,
        max_tokens: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.batch_size = check_size("batch_size", batch_size)
        self.max_tokens = check_size("max_tokens", max_tokens)
        self.kv_lora_rank = check_size("kv_lora_rank", kv_lora_rank)
        self.qk_rope_head_dim = check_size("qk_rope_head_dim", qk_rope_head_dim, minimum=0)
        width = self.kv_lora_rank + self.qk_rope_head_dim
        check_size(
            f"batch_size x max_tokens x (kv_lora_rank + qk_rope_head_dim) ({batch_size} x "
            f"{max_tokens} x {width})",
            batch_size * max_tokens * width,
        )
        dtype = check_latent_dtype(dtype)
        device = check_device("device", device)
        shape = (batch_size, max_tokens, width)  # (b, capacity, r + dr)
        self._rows = torch.zeros(shape, dtype=dtype, device=device)
        self.position = 0  # tokens written since the last reset: the next token's position

    @property
    def width(self) -> int:
        """Features held per token: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def capacity(self) -> int:
        """Slots per sequence: max_tokens."""
        return self.max_tokens

    @property
    def rows(self) -> torch.Tensor:
        """Every slot as stored, (b, capacity, kv_lora_rank + qk_rope_head_dim): the latent,
        then the rotary key (a view of the buffer)."""
        return self._rows

    @property
    def latents(self) -> torch.Tensor:
        """The held tokens' latents (b, num_tokens, kv_lora_rank), a view as stored."""
        return self._rows.narrow(1, 0, self.position).narrow(2, 0, self.kv_lora_rank)

    @property
    def rotary_keys(self) -> torch.Tensor:
        """The held tokens' rotary keys (b, num_tokens, qk_rope_head_dim), a view as stored."""
        held = self._rows.narrow(1, 0, self.position)
        return held.narrow(2, self.kv_lora_rank, self.qk_rope_head_dim)

    @property
    def num_tokens(self) -> int:
        """How many tokens the buffer holds now."""
        return self.position

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more token position takes across the batch: (kv_lora_rank +
        qk_rope_head_dim) x itemsize x batch_size. No per-head term: every head's key and
        value is expanded from these."""
        return self.width * self.dtype.itemsize * self.batch_size

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer: bytes_per_token x max_tokens."""
        return self._rows.nbytes

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype."""
        return self._rows.dtype

    @property
    def device(self) -> torch.device:
        """Where the buffer lives."""
        return self._rows.device

    @property
    def records_grad(self) -> bool:
        """True when the buffer holds tensors autograd records (written under autograd)."""
        return self._rows.requires_grad

    @property
    def locked_by_inference_mode(self) -> bool:
        """True when the buffer was made under torch.inference_mode() and the caller is
        outside it, where it cannot be written (never while torch.compile traces)."""
        if torch.compiler.is_compiling():
            return False
        return self._rows.is_inference() and not torch.is_inference_mode_enabled()

    def __repr__(self) -> str:
        return (
            f"LatentCache(batch_size={self.batch_size}, max_tokens={self.max_tokens}, "
            f"kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"position={self.position}, dtype={self.dtype})"
        )

    def accepts(self, dtype: torch.dtype) -> bool:
        """Whether latents of `dtype` can be stored: the cache's own dtype, or for a
        narrower store (bfloat16, float16) any wider floating-point dtype."""
        if dtype == self.dtype:
            return True
        narrower = self.dtype in NARROWER
        return narrower and dtype.is_floating_point and dtype.itemsize > self.dtype.itemsize

    def is_on_device_of(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is on the buffer's device."""
        rows = self._rows
        if rows.is_cpu:
            return tensor.is_cpu
        return rows.device == tensor.device

    def reset(self) -> None:
        """Forget every token (the buffer is kept, not reallocated)."""
        self.position = 0

    def crop(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (to drop rejected draft tokens or
        re-decode from a point).

        Args:
            num_tokens: an int in [0, num_tokens held].

        Raises:
            ValueError: more than the cache holds, or negative (TypeError: not an int).
        """
        num_tokens = check_size("num_tokens", num_tokens, minimum=0)
        if num_tokens > self.position:
            raise ValueError(
                f"num_tokens ({num_tokens}) is more than the cache holds ({self.position})"
            )
        self.position = num_tokens

    def check_room(self, num_new: int) -> None:
        """Raise unless `num_new` more tokens fit.

        Args:
            num_new: tokens to append, an int >= 1.

        Raises:
            ValueError: they do not fit, or num_new < 1 (TypeError: not an int).
        """
        num_new = check_size("num_new", num_new)
        if self.position + num_new > self.capacity:
            raise ValueError(
                f"the cache holds {self.position} of at most max_tokens ({self.max_tokens}) "
                f"tokens and cannot take {num_new} more; reset() it or make a larger one"
            )

    def update(self, latent: torch.Tensor, rotary_key: torch.Tensor) -> torch.Tensor:
        """Append the next n tokens' latents and rotary keys.

        Args:
            latent: (b, n, kv_lora_rank), in the cache's dtype, or for a narrower store any
                wider floating-point dtype; on the cache's device.
            rotary_key: (b, n, qk_rope_head_dim), the same dtype and device.

        Returns:
            Every held token's row (b, tokens so far, kv_lora_rank + qk_rope_head_dim) in
            latent's dtype (as stored: rounded by a narrower store).

        Raises:
            TypeError: a non-tensor, or a dtype or device the cache cannot store.
            ValueError: shapes that do not fit, or no room for n more tokens.
        """
        self._check_new(latent, rotary_key)
        self.check_room(latent.shape[1])
        return self.append(latent, rotary_key)

    def append(self, latent: torch.Tensor, rotary_key: torch.Tensor) -> torch.Tensor:
        """update() for a caller that has checked the tensors and the room itself
        (MultiHeadLatentAttention checks its whole call before any state changes)."""
        start, n = self.position, latent.shape[1]
        if start + n > self.capacity:  # a caller that did not check: refused, not wrapped
            self.check_room(n)
        stored = self.dtype
        kv_cache.check_storable("latents", latent, stored)  # float16 holds at most 65504
        kv_cache.check_storable("rotary keys", rotary_key, stored)
        if torch.is_grad_enabled() and (
            latent.requires_grad or rotary_key.requires_grad or self._rows.requires_grad
        ):  # out of place: the tensors autograd saved stay as it saw them
            new = torch.cat([latent, rotary_key], dim=-1).to(stored)  # (b, n, r + dr)
            self._rows = torch.slice_scatter(self._rows, new, dim=1, start=start, end=start + n)
        else:
            slots = self._rows.narrow(1, start, n)  # (b, n, r + dr)
            slots.narrow(2, 0, self.kv_lora_rank).copy_(latent)
            slots.narrow(2, self.kv_lora_rank, self.qk_rope_head_dim).copy_(rotary_key)
        self.position = start + n
        held = self._rows.narrow(1, 0, start + n)  # (b, tokens so far, r + dr)
        return held if held.dtype == latent.dtype else held.to(latent.dtype)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """All or nothing: if the body raises, the cache is put back as it was (position and
        buffer; the slots past the position it may have written are not held), then the
        error goes on.

        Yields:
            None, once the state to restore is saved.
        """
        position, rows = self.position, self._rows
        try:
            yield
        except BaseException:
            self.position, self._rows = position, rows
            raise

    def _check_new(self, latent: object, rotary_key: object) -> None:
        for name, t, width in (
            ("latent", latent, self.kv_lora_rank),
            ("rotary_key", rotary_key, self.qk_rope_head_dim),
        ):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or (t.shape[0], t.shape[2]) != (self.batch_size, width):
                raise ValueError(
                    f"{name} of shape {tuple(t.shape)} does not fit the cache made for "
                    f"(batch_size={self.batch_size}, tokens, {width})"
                )
            if not (t.is_floating_point() and self.accepts(t.dtype)) or not self.is_on_device_of(t):
                raise TypeError(
                    f"{name} is {t.dtype} on {t.device} but the cache is {self.dtype} on "
                    f"{self.device} (it stores its own dtype, or a wider float narrowed)"
                )
        if latent.shape[1] != rotary_key.shape[1] or latent.dtype != rotary_key.dtype:
            raise ValueError(
                f"latent {tuple(latent.shape)} {latent.dtype} and rotary_key "
                f"{tuple(rotary_key.shape)} {rotary_key.dtype} must have the same number of "
                f"tokens and dtype"
            )
        if latent.shape[1] == 0:
            raise ValueError("latent holds no tokens: nothing to append")


# multi-head latent attention's native lane stands for its methods (csrc/latent_plan.h): a
# class-level patch takes the Python path, which calls them
_AS_DEFINED = _own_code.as_defined(LatentCache)


def code_as_written() -> bool:
    """True when LatentCache's methods and properties are the ones this file defines (no
    class patch)."""
    return _AS_DEFINED(LatentCache)


def check_latent_dtype(dtype: object) -> torch.dtype | None:
    """`dtype` if it is None (torch's default) or a real floating-point dtype.

    Raises:
        TypeError: anything else (int8 included: a latent cache is not quantised).
    """
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    if not dtype.is_floating_point or dtype.is_complex:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    return dtype
