"""KVCache: the keys and values of the tokens seen so far, so that each new token attends to
them without recomputing the prefix.

Buffers are allocated once and written in place; only the key/value heads are stored, so
grouped-query attention shrinks the cache by num_heads / num_kv_heads. With a window, the
buffer holds the `window` most recent tokens and rolls: token p lives in slot p % window.

Layout: each buffer is stored (b, hkv, hd, capacity), tokens last, and shown as a
(b, hkv, capacity, hd) view. Decoding one token reads the whole cache with a
matrix-vector product per head, and with tokens last each product streams contiguous rows:
on a CPU that reads memory about twice as fast as the (capacity, hd) layout.

Writes are in place, except where autograd records them (keys or values that require grad,
or buffers that already hold such): there a write makes new buffers, so that a backward
through several cached calls finds the tensors it saved unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from attnlab._validate import check_int


class KVCache:
    """Preallocated key/value buffers for `batch_size` sequences of up to `max_tokens`
    tokens, or, with `window`, a rolling buffer of the `window` most recent tokens."""

    def __init__(
        self,
        batch_size: int,
        max_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> None:
        self.batch_size = check_int("batch_size", batch_size)
        self.max_tokens = check_int("max_tokens", max_tokens)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_int("head_dim", head_dim)
        self.window = None if window is None else check_int("window", window)
        self.capacity = max_tokens if window is None else min(window, max_tokens)
        shape = (batch_size, num_kv_heads, head_dim, self.capacity)  # tokens last
        self._keys_t = torch.zeros(shape, dtype=dtype, device=device)  # (b, hkv, hd, capacity)
        self._values_t = torch.zeros(shape, dtype=dtype, device=device)
        self.position = 0  # tokens written since the last reset: the next token's position

    @property
    def keys(self) -> torch.Tensor:
        """The key buffer as (b, hkv, capacity, hd) (a view: tokens are stored last)."""
        return self._keys_t.transpose(-2, -1)

    @property
    def values(self) -> torch.Tensor:
        """The value buffer as (b, hkv, capacity, hd) (a view: tokens are stored last)."""
        return self._values_t.transpose(-2, -1)

    @property
    def rolling(self) -> bool:
        """True when old tokens are overwritten: a window no larger than max_tokens."""
        return self.window is not None and self.capacity == self.window

    @property
    def num_tokens(self) -> int:
        """How many tokens the buffers hold now."""
        return min(self.position, self.capacity)

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers: 2 x b x hkv x capacity x hd x itemsize."""
        return self._keys_t.nbytes + self._values_t.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self._keys_t.dtype

    @property
    def device(self) -> torch.device:
        return self._keys_t.device

    def __repr__(self) -> str:
        return (
            f"KVCache(batch_size={self.batch_size}, max_tokens={self.max_tokens}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"window={self.window}, position={self.position}, dtype={self.dtype})"
        )

    def reset(self) -> None:
        """Forget every token (the buffers are kept, not reallocated)."""
        self.position = 0

    def crop(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (to drop rejected draft tokens or
        re-decode from a point). A rolling cache that has overwritten some of them cannot."""
        check_int("num_tokens", num_tokens, minimum=0)
        if num_tokens > self.position:
            raise ValueError(
                f"num_tokens ({num_tokens}) is more than the cache holds ({self.position})"
            )
        if self.rolling and self.position > self.capacity:
            raise ValueError(
                f"this rolling cache has overwritten tokens before position "
                f"{self.position - self.capacity}: it cannot be cropped, only reset()"
            )
        self.position = num_tokens

    def check_room(self, num_new: int) -> None:
        """Raise unless `num_new` more tokens fit (a rolling cache always has room)."""
        if not self.rolling and self.position + num_new > self.capacity:
            raise ValueError(
                f"the cache holds {self.position} of at most max_tokens ({self.max_tokens}) "
                f"tokens and cannot take {num_new} more; reset() it or make a larger one"
            )

    def update(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append k and v (b, hkv, n, hd), the next n tokens. Returns the keys and values
        those tokens attend to (b, hkv, tk, hd) and the absolute position of each key
        (tk,), or None when they are positions 0 .. tk - 1 in order."""
        self._check_new(k, v)
        self.check_room(k.shape[2])
        return self.append(k, v)

    def append(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """update() for a caller that has checked k, v and the room itself
        (MultiHeadAttention checks its whole call before any state changes)."""
        n = k.shape[2]
        start = self.position
        if not self.rolling:
            self._write(k, v, slots=None)
            self.position = start + n
            return self._held(start + n)
        if n == 1:  # the window's slots then hold exactly the keys this token may see
            self._write_rolling(k, v, start)
            return (*self._held(self.num_tokens)[:2], self.slot_positions())
        # A chunk's first tokens need keys its last tokens will overwrite: attend to a copy.
        held_keys, held_values, _ = self._held(self.num_tokens)
        keys = torch.cat([held_keys, k], dim=2)  # (b, hkv, held + n, hd)
        values = torch.cat([held_values, v], dim=2)
        new_positions = torch.arange(start, start + n, device=self.device)
        positions = torch.cat([self.slot_positions(), new_positions])
        self._write_rolling(k, v, start)
        return keys, values, positions

    def _held(self, num: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The first `num` slots' keys and values, (b, hkv, num, hd) views, positions None."""
        keys = self._keys_t.narrow(3, 0, num).transpose(-2, -1)  # (b, hkv, num, hd)
        return keys, self._values_t.narrow(3, 0, num).transpose(-2, -1), None

    def slot_positions(self) -> torch.Tensor:
        """The absolute position of the token in each held slot, (num_tokens,)."""
        slots = torch.arange(self.num_tokens, device=self.device)
        last = self.position - 1
        return last - torch.remainder(last - slots, self.capacity)

    def _write_rolling(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        keep = min(k.shape[2], self.capacity)  # older tokens of the chunk would be overwritten
        self._write(k[:, :, -keep:], v[:, :, -keep:], slots=self._slots(start, k.shape[2]))
        self.position = start + k.shape[2]

    def _slots(self, start: int, num: int) -> torch.Tensor:
        """The slots tokens start .. start + num - 1 are written to (the last `capacity`)."""
        end = start + num
        keep = min(num, self.capacity)
        return torch.arange(end - keep, end, device=self.device) % self.capacity

    def _write(self, k: torch.Tensor, v: torch.Tensor, *, slots: torch.Tensor | None) -> None:
        """Store k, v (b, hkv, n, hd) in `slots` (n,), or with None in the n slots from the
        current position on (the position itself is the caller's to move)."""
        new_keys, new_values = k.transpose(-2, -1), v.transpose(-2, -1)  # (b, hkv, hd, n)
        if self._records_grad(k, v):  # new buffers: saved tensors stay as autograd saw them
            if slots is None:
                slots = torch.arange(self.position, self.position + k.shape[2], device=k.device)
            self._keys_t = self._keys_t.index_copy(3, slots, new_keys)
            self._values_t = self._values_t.index_copy(3, slots, new_values)
        elif slots is None:  # consecutive slots: a plain copy
            self._keys_t.narrow(3, self.position, k.shape[2]).copy_(new_keys)
            self._values_t.narrow(3, self.position, k.shape[2]).copy_(new_values)
        else:
            self._keys_t.index_copy_(3, slots, new_keys)
            self._values_t.index_copy_(3, slots, new_values)

    def _records_grad(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        if not torch.is_grad_enabled():
            return False
        return k.requires_grad or v.requires_grad or self._keys_t.requires_grad

    @contextlib.contextmanager
    def transaction(self, num_new: int) -> Iterator[None]:
        """All or nothing: if the body raises after writing `num_new` tokens, the cache is
        put back as it was (position, buffers and every held token), then the error goes on.

        Args:
            num_new: how many tokens the body appends.
        """
        position, keys_t, values_t = self.position, self._keys_t, self._values_t
        slots = saved_keys = saved_values = None
        if self.rolling:  # its writes overwrite held tokens: keep a copy of those slots
            slots = self._slots(position, num_new)
            saved_keys = keys_t.index_select(3, slots)  # (b, hkv, hd, n)
            saved_values = values_t.index_select(3, slots)
        try:
            yield
        except BaseException:
            written_in_place = self._keys_t is keys_t
            self.position, self._keys_t, self._values_t = position, keys_t, values_t
            if slots is not None and written_in_place:
                keys_t.index_copy_(3, slots, saved_keys)
                values_t.index_copy_(3, slots, saved_values)
            raise

    def _check_new(self, k: torch.Tensor, v: torch.Tensor) -> None:
        expected = (self.batch_size, self.num_kv_heads, self.head_dim)
        fits = k.dim() == 4 and k.shape == v.shape and k.dtype == v.dtype == self._keys_t.dtype
        if fits and (k.shape[0], k.shape[1], k.shape[3]) == expected and k.device == self.device:
            return  # the per-token case, checked in one pass
        for name, t in (("k", k), ("v", v)):
            got = (t.shape[0], t.shape[1], t.shape[3]) if t.dim() == 4 else None
            if got != expected:
                raise ValueError(
                    f"{name} of shape {tuple(t.shape)} does not fit the cache made for "
                    f"(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                    f"tokens, head_dim={self.head_dim})"
                )
            if t.dtype != self.dtype or t.device != self.device:
                raise TypeError(
                    f"{name} is {t.dtype} on {t.device} but the cache is {self.dtype} on "
                    f"{self.device}"
                )
