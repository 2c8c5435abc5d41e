"""KVCache: the keys and values of the tokens seen so far, so that each new token attends to
them without recomputing the prefix.

Buffers are allocated once and written in place; only the key/value heads are stored, so
grouped-query attention shrinks the cache by num_heads / num_kv_heads. With a window, the
buffer holds the `window` most recent tokens and rolls: token p lives in slot p % window.

Layout: each head's keys are held in blocks of tokens, each block stored (hd, its tokens)
row-major: tokens last within a block, so that decoding one token reads a block's keys with
a matrix-vector product over contiguous rows (a query's scores are a sum of rows). By default
the whole capacity is one block, which the Python path reads as views. For attnlab's native
CPU decode step (MultiHeadAttention.make_cache asks for it) a block is BLOCK_TOKENS (256)
tokens and the blocks follow one another, so that a short context is one contiguous read
however large the capacity (with tokens last over the whole capacity, each of the hd rows of
a 256-token context is a separate 1 KiB read, capacity apart); the Python path then copies
the held keys out of the blocks. Each head's values are rows (capacity, hd) row-major in
every layout: the output p @ v is then a sum of rows scaled by their weights, and the values
of a short context are the first rows, one contiguous read. The buffers are (b, hkv, hd *
capacity); `keys` and `values` give them back as (b, hkv, capacity, hd).

Off the CPU (make_cache's choice for any other device) the keys are rows too
(`tokens_last=False`): each head's buffer is (capacity, hd) row-major, one block, the layout
SDPA's GPU kernels read without a copy; the tokens-last layout would be copied whole at
every decoded token there.

Writes are in place, except where autograd records them (keys or values that require grad,
or buffers that already hold such): there a write makes new buffers, so that a backward
through several cached calls finds the tensors it saved unchanged.

Smaller caches: the buffers may be stored in a narrower dtype than the keys and values they
are given and return. bfloat16 (or float16) halves a float32 cache; int8 quarters it, with
symmetric per-token, per-head scales stored beside the buffers (b, hkv, capacity): a
token's head is stored as round(x / s) with s = max |x| / 127, and read back as q * s. Keys
and values are read back in the dtype they were given (the module's), so attention itself
runs at full precision; the error is the storage's rounding (README, "Smaller caches").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from attnlab import _own_code, debug, masks
from attnlab._validate import (
    check_bool,
    check_device,
    check_int,
    check_product,
    check_size,
    largest_magnitude,
)

COMPRESSED = (torch.bfloat16, torch.float16, torch.int8)  # stored narrower than given
BLOCK_TOKENS = 256  # tokens per block where the native decode step reads the cache


class KVCache:
    """Preallocated key/value buffers for `batch_size` sequences of up to `max_tokens`
    tokens, or, with `window`, a rolling buffer of the `window` most recent tokens.

    MultiHeadAttention.make_cache builds one for a module; the accessors named for native
    kernels (keys_t, values_t, block, scales, native_slots, accepts, compressed,
    records_grad) expose the stored layout to attnlab's decode step.

    Args:
        batch_size: sequences held (an int >= 1).
        max_tokens: positions each sequence may reach (without a window).
        num_kv_heads: key/value heads.
        head_dim: features per head.
        dtype: the storage dtype: the module's, or narrower (bfloat16/float16, or int8
            with per-token, per-head scales); default torch's.
        device: where the buffers go.
        window: keep only the `window` most recent tokens (a rolling buffer).
        block_tokens: store each head's keys in blocks of this many tokens (see the
            module's docstring; MultiHeadAttention.make_cache gives BLOCK_TOKENS where its
            native decode step reads the cache); default one block of the whole capacity.
        tokens_last: store each block of keys (hd, tokens) (the default: the CPU's layout),
            or, False, each head's keys as rows (capacity, hd) in one block (a GPU's). The
            values are rows (capacity, hd) either way.

    Raises:
        TypeError: a size that is not an int, a dtype that is neither floating point nor
            int8.
        ValueError: a size < 1, or a device torch does not know.
    """

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
        block_tokens: int | None = None,
        tokens_last: bool = True,
    ) -> None:
        self.batch_size = check_size("batch_size", batch_size)
        self.max_tokens = check_size("max_tokens", max_tokens)
        self.num_kv_heads = check_size("num_kv_heads", num_kv_heads)
        self.head_dim = check_size("head_dim", head_dim)
        self.window = None if window is None else check_int("window", window)
        self.capacity = self.max_tokens if window is None else min(self.window, self.max_tokens)
        check_product(
            "batch_size x num_kv_heads x capacity x head_dim",
            *(self.batch_size, self.num_kv_heads, self.capacity, self.head_dim),
        )
        dtype = check_storage_dtype(dtype)
        device = check_device("device", device)
        shape = (batch_size, num_kv_heads, head_dim * self.capacity)  # see _Layout
        self._keys_t = torch.zeros(shape, dtype=dtype, device=device)
        self._values_t = torch.zeros(shape, dtype=dtype, device=device)
        self.block = (
            self.capacity if block_tokens is None else check_size("block_tokens", block_tokens)
        )
        self.tokens_last = check_bool("tokens_last", tokens_last)
        if not tokens_last and block_tokens is not None:
            raise ValueError(
                f"block_tokens ({block_tokens}) lays out a tokens-last cache: give "
                f"tokens_last=True with it, or no block_tokens"
            )
        self._key_layout = _Layout(tokens_last, self.block, self.capacity, self.head_dim)
        self._value_layout = _Layout(False, self.capacity, self.capacity, self.head_dim)
        self._key_scales = self._value_scales = None
        if self.dtype == torch.int8:  # one float32 scale per token and head: (b, hkv, capacity)
            scales = (batch_size, num_kv_heads, self.capacity)
            self._key_scales = torch.zeros(scales, device=device)
            self._value_scales = torch.zeros_like(self._key_scales)
        self.position = 0  # tokens written since the last reset: the next token's position

    @property
    def keys(self) -> torch.Tensor:
        """Every slot's key as stored, (b, hkv, capacity, hd): a view for a cache of one
        block (the default), a copy of the blocks otherwise; an int8 cache's unscaled
        integers (see key_scales)."""
        return self._key_layout.tokens(self._keys_t, self.capacity)

    @property
    def values(self) -> torch.Tensor:
        """Every slot's value as stored, (b, hkv, capacity, hd) (a view or a copy, as keys)."""
        return self._value_layout.tokens(self._values_t, self.capacity)

    @property
    def key_scales(self) -> torch.Tensor | None:
        """An int8 cache's key scales (b, hkv, capacity), float32 (keys = int8 x scale);
        None for a floating-point cache."""
        return self._key_scales

    @property
    def value_scales(self) -> torch.Tensor | None:
        """An int8 cache's value scales (b, hkv, capacity), float32; None otherwise."""
        return self._value_scales

    @property
    def keys_t(self) -> torch.Tensor:
        """The key buffer as stored, (b, hkv, hd * capacity), for native kernels: each head's
        tokens in blocks of `block` tokens (the last may hold fewer), a block of n tokens
        (hd, n) row-major (with tokens_last=False, one block (capacity, hd))."""
        return self._keys_t

    @property
    def values_t(self) -> torch.Tensor:
        """The value buffer as stored, (b, hkv, capacity * hd), for native kernels: each
        head's tokens as rows (capacity, hd) row-major, whatever the keys' layout."""
        return self._values_t

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key scales, value scales), empty tensors for a floating-point cache."""
        if self._key_scales is None:
            return _EMPTY, _EMPTY
        return self._key_scales, self._value_scales

    @property
    def compressed(self) -> bool:
        """True when the buffers are stored narrower than the keys given (bf16, f16, int8)."""
        return self.dtype in COMPRESSED

    def accepts(self, dtype: torch.dtype) -> bool:
        """Whether keys and values of `dtype` can be stored: the cache's own dtype, or for a
        narrower store (bf16, f16, int8) any wider floating-point dtype."""
        if dtype == self.dtype:
            return self.dtype.is_floating_point
        return self.compressed and dtype.is_floating_point and dtype.itemsize > self.dtype.itemsize

    def is_on_device_of(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is on the buffers' device (CPU tensors compared without building
        torch.device objects: a decoded token pays this per layer)."""
        keys = self._keys_t
        if keys.is_cpu:
            return tensor.is_cpu
        return keys.device == tensor.device

    @property
    def records_grad(self) -> bool:
        """True when the buffers hold tensors autograd records (written under autograd)."""
        return self._keys_t.requires_grad or self._values_t.requires_grad

    @property
    def locked_by_inference_mode(self) -> bool:
        """True when the buffers were made under torch.inference_mode() and the caller is
        outside it, where they cannot be written (never while torch.compile traces: dynamo
        can trace neither is_inference nor the inference mode that makes such tensors)."""
        if torch.compiler.is_compiling():
            return False
        return self._keys_t.is_inference() and not torch.is_inference_mode_enabled()

    def native_slots(self, start: int, window: int | None) -> tuple[int, int, int]:
        """For one token at position `start` attending to at most `window` keys: the slot it
        is written to, then the first slot and the number of slots it attends to (the keys
        of masks.visible_keys; a rolling cache holds exactly its window's, from slot 0)."""
        if self.rolling:
            keys = masks.visible_keys(start, self.capacity)
            return start % self.capacity, 0, len(keys)
        keys = masks.visible_keys(start, window)  # slot = position
        return start, keys.start, len(keys)

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
        """Bytes of the key and value buffers, 2 x b x hkv x capacity x hd x itemsize, and of
        an int8 cache's scales, 2 x b x hkv x capacity x 4."""
        scales = 0 if self._key_scales is None else 2 * self._key_scales.nbytes
        return self._keys_t.nbytes + self._values_t.nbytes + scales

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
        num_tokens = check_size("num_tokens", num_tokens, minimum=0)
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
        """Raise unless `num_new` more tokens fit (a rolling cache always has room).

        Args:
            num_new: tokens to append, an int >= 1.

        Raises:
            ValueError: they do not fit, or num_new is not an int >= 1 (TypeError for a
                non-integer).
        """
        num_new = check_size("num_new", num_new)
        if not self.rolling and self.position + num_new > self.capacity:
            raise ValueError(
                f"the cache holds {self.position} of at most max_tokens ({self.max_tokens}) "
                f"tokens and cannot take {num_new} more; reset() it or make a larger one"
            )

    def update(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append the next n tokens' keys and values.

        Args:
            k: keys (b, hkv, n, hd), in the cache's dtype, or for a narrower store (bf16,
                f16, int8) any wider floating-point dtype.
            v: values, like k.

        Returns:
            The keys and values those tokens attend to (b, hkv, tk, hd), in k's dtype (as
            stored: rounded by a narrower store), and the absolute position of each key
            (tk,), or None when they are positions 0 .. tk - 1 in order.

        Raises:
            ValueError: k or v does not fit the cache, the cache has no room, or an int8
                cache is given keys that require grad.
            TypeError: k or v has a dtype or device the cache cannot store.
        """
        self._check_new(k, v)
        if (
            self.dtype == torch.int8
            and torch.is_grad_enabled()
            and (k.requires_grad or v.requires_grad)
        ):
            raise ValueError(
                "an int8 cache stores rounded keys and values, through which no gradient "
                "flows: update it under torch.no_grad(), or use a floating-point cache"
            )
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
            if start + n > self.capacity:  # a caller that did not check: refused, not wrapped
                self.check_room(n)
            self._write(k, v)
            self.position = start + n
            return self._held(start + n, k.dtype)
        if n == 1:  # the window's slots then hold exactly the keys this token may see
            self._write_rolling(k, v, start)
            return (*self._held(self.num_tokens, k.dtype)[:2], self.slot_positions())
        # A chunk's first tokens need keys its last tokens will overwrite: attend to a copy.
        held_keys, held_values, _ = self._held(self.num_tokens, k.dtype)
        new_keys, new_values = self._as_stored(k), self._as_stored(v)
        keys = torch.cat([held_keys, new_keys], dim=2)  # (b, hkv, held + n, hd)
        values = torch.cat([held_values, new_values], dim=2)
        new_positions = torch.arange(start, start + n, device=self.device)
        positions = torch.cat([self.slot_positions(), new_positions])
        self._write_rolling(k, v, start)
        return keys, values, positions

    def _held(self, num: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The first `num` slots' keys and values, (b, hkv, num, hd) in `dtype`, positions
        None (views of the buffers when they fit in one block and are stored in `dtype`)."""
        keys = self._read(self._keys_t, self._key_layout, self._key_scales, num, dtype)
        values = self._read(self._values_t, self._value_layout, self._value_scales, num, dtype)
        return keys, values, None

    def _read(self, buffer, layout, scales, num: int, dtype: torch.dtype) -> torch.Tensor:
        held = layout.tokens(buffer, num)  # (b, hkv, num, hd)
        if scales is not None:
            held = held.to(torch.float32) * scales.narrow(2, 0, num).unsqueeze(3)
        return held.to(dtype)

    def _as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, hkv, n, hd) as the cache will give it back: rounded by a narrower store."""
        if not self.compressed:
            return x
        if self.dtype != torch.int8:
            return x.to(self.dtype).to(x.dtype)
        quantized, scales = quantize(x)
        return (quantized.to(torch.float32) * scales.unsqueeze(-1)).to(x.dtype)

    def slot_positions(self) -> torch.Tensor:
        """The absolute position of the token in each held slot, (num_tokens,)."""
        slots = torch.arange(self.num_tokens, device=self.device)
        last = self.position - 1
        return last - torch.remainder(last - slots, self.capacity)

    def _write_rolling(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        keep = min(k.shape[2], self.capacity)  # older tokens of the chunk would be overwritten
        first = (start + k.shape[2] - keep) % self.capacity
        self._write(k[:, :, -keep:], v[:, :, -keep:], first=first)
        self.position = start + k.shape[2]

    def _slots(self, start: int, num: int) -> torch.Tensor:
        """The slots tokens start .. start + num - 1 are written to (the last `capacity`)."""
        end = start + num
        keep = min(num, self.capacity)
        return torch.arange(end - keep, end, device=self.device) % self.capacity

    def _write(self, k: torch.Tensor, v: torch.Tensor, *, first: int | None = None) -> None:
        """Store k, v (b, hkv, n, hd) in the n slots from `first` on, wrapping past the
        capacity (None: from the current position on; the position is the caller's to
        move). Out of place under autograd, so that saved tensors stay as autograd saw them."""
        n = k.shape[2]
        first = self.position if first is None else first
        grad = self._records_grad(k, v)
        slots = None  # the slots written
        if grad or self._key_scales is not None:
            slots = torch.arange(first, first + n, device=k.device) % self.capacity
        for name, x, layout in (("keys", k, self._key_layout), ("values", v, self._value_layout)):
            stored, scales = self._encode(x, layout)  # (b, hkv, hd, n) or rows, scales or None
            check_storable(name, x, self.dtype)
            buffer_name, scales_name = f"_{name}_t", f"_{name[:-1]}_scales"
            buffer = getattr(self, buffer_name)
            if grad:
                columns = layout.columns(slots).flatten()  # in the order of stored's last axes
                flat = stored.reshape(*stored.shape[:2], -1)  # (b, hkv, hd * n), as columns
                setattr(self, buffer_name, buffer.index_copy(2, columns, flat))
            else:
                layout.copy_in(buffer, first, stored)
            if scales is not None:
                old = getattr(self, scales_name)
                put = old.index_copy if grad else old.index_copy_
                setattr(self, scales_name, put(2, slots, scales))

    def _encode(self, x: torch.Tensor, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (b, hkv, n, hd) in `layout` and the stored dtype ((b, hkv, hd, n) tokens last, as
        given for rows), and an int8 store's scales (b, hkv, n)."""
        scales = None
        if self.dtype == torch.int8:
            x, scales = quantize(x)
        x = x.to(self.dtype)
        return (x.transpose(-2, -1) if layout.tokens_last else x), scales

    def _records_grad(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the write must be out of place: autograd records it, or the buffers are
        part of a recorded graph (a prefill under grad saved them, whatever the mode now)."""
        if self._keys_t.requires_grad or self._values_t.requires_grad:
            return True
        return torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)

    @contextlib.contextmanager
    def transaction(self, num_new: int) -> Iterator[None]:
        """All or nothing: if the body raises after writing `num_new` tokens, the cache is
        put back as it was (position, buffers, scales and every held token), then the error
        goes on.

        Args:
            num_new: how many tokens the body appends.

        Yields:
            None, once the state to restore is saved.
        """
        position = self.position
        tensors = self._tensors()
        indices, saved = (), ()
        if self.rolling:  # its writes overwrite held tokens: keep a copy of those slots
            slots = self._slots(position, num_new)
            key_columns = self._key_layout.columns(slots).flatten()
            value_columns = self._value_layout.columns(slots).flatten()
            indices = (key_columns, value_columns, slots, slots)[: len(tensors)]  # then scales
            saved = tuple(t.index_select(2, i) for t, i in zip(tensors, indices, strict=True))
        try:
            yield
        except BaseException:
            written_in_place = self._keys_t is tensors[0]
            self.position = position
            self._keys_t, self._values_t = tensors[:2]
            if len(tensors) == 4:
                self._key_scales, self._value_scales = tensors[2:]
            if indices and written_in_place:
                for t, index, kept in zip(tensors, indices, saved, strict=True):
                    t.index_copy_(2, index, kept)
            raise

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        """The buffers, then an int8 cache's scales."""
        if self._key_scales is None:
            return self._keys_t, self._values_t
        return self._keys_t, self._values_t, self._key_scales, self._value_scales

    def _check_new(self, k: torch.Tensor, v: torch.Tensor) -> None:
        expected = (self.batch_size, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        fits = k.dim() == 4 and k.shape == v.shape and k.dtype == v.dtype and self.accepts(k.dtype)
        same_place = k.device == v.device == self.device
        if fits and (k.shape[0], k.shape[1], k.shape[3]) == expected and same_place:
            return  # the per-token case, checked in one pass
        for name, t in (("k", k), ("v", v)):
            got = (t.shape[0], t.shape[1], t.shape[3]) if t.dim() == 4 else None
            if got != expected:
                raise ValueError(
                    f"{name} of shape {tuple(t.shape)} does not fit the cache made for "
                    f"(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                    f"tokens, head_dim={self.head_dim})"
                )
            if not self.accepts(t.dtype) or t.device != self.device:
                raise TypeError(
                    f"{name} is {t.dtype} on {t.device} but the cache is {self.dtype} on "
                    f"{self.device}"
                )
        if k.shape[2] != v.shape[2] or k.dtype != v.dtype:
            raise ValueError(
                f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must have the "
                f"same number of tokens and dtype"
            )


class _Layout:
    """How one of a KVCache's buffers (b, hkv, hd * capacity) holds each head's tokens: in
    blocks of `block` tokens (the last may hold fewer), a block of n tokens stored (hd, n)
    row-major (tokens_last) or (n, hd); a cache of rows is one block of the capacity."""

    def __init__(self, tokens_last: bool, block: int, capacity: int, head_dim: int) -> None:
        self.tokens_last, self.block = tokens_last, block
        self.capacity, self.head_dim = capacity, head_dim
        self.token_dim = 3 if tokens_last else 2  # of a block's view (b, hkv, ., .)

    def columns(self, slots: torch.Tensor) -> torch.Tensor:
        """Where slots (n,) live in a buffer's last axis: (hd, n) element offsets, row d of
        slot t at (t's block's first slot) * hd + d * (the block's tokens) + t's place in it;
        (n, hd) offsets slot * hd + d for a buffer of rows."""
        if not self.tokens_last:
            features = torch.arange(self.head_dim, device=slots.device)
            return slots.unsqueeze(1) * self.head_dim + features  # (n, hd)
        start = torch.div(slots, self.block, rounding_mode="floor") * self.block
        length = (self.capacity - start).clamp(max=self.block)  # tokens in each slot's block
        rows = torch.arange(self.head_dim, device=slots.device).unsqueeze(1)  # (hd, 1)
        return start * self.head_dim + rows * length + (slots - start)  # (hd, n)

    def tokens(self, buffer: torch.Tensor, num: int) -> torch.Tensor:
        """The first `num` slots of the buffer as (b, hkv, num, hd), as stored (a view
        within one block, else a copy)."""
        pieces = self.pieces(buffer, 0, num)  # (b, hkv, hd, m) each, or (b, hkv, m, hd)
        held = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.token_dim)
        return held.transpose(-2, -1) if self.tokens_last else held  # (b, hkv, num, hd)

    def pieces(self, buffer: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
        """Views (b, hkv, hd, m) of the consecutive slots start .. stop - 1, block by block
        (0 <= start <= stop <= capacity); (b, hkv, m, hd) for a buffer of rows."""
        if not 0 <= start <= stop <= self.capacity:
            raise ValueError(f"slots {start}..{stop - 1} are not within the {self.capacity} held")
        batch, heads, hd = *buffer.shape[:2], self.head_dim
        pieces, slot = [], start
        while slot < stop or not pieces:
            first = slot // self.block * self.block
            length = min(self.block, self.capacity - first)
            block = buffer.narrow(2, first * hd, hd * length)  # (b, hkv, hd * length)
            if self.tokens_last:
                block = block.view(batch, heads, hd, length)  # (b, hkv, hd, length)
            else:
                block = block.view(batch, heads, length, hd)  # (b, hkv, length, hd)
            end = min(stop, first + length)
            pieces.append(block.narrow(self.token_dim, slot - first, end - slot))
            slot = end
        return pieces

    def copy_in(self, buffer: torch.Tensor, first: int, stored: torch.Tensor) -> None:
        """stored (b, hkv, hd, n) (or rows (b, hkv, n, hd)) copied in place into the n slots
        from `first` on (wrapping past the capacity: at most two runs of consecutive slots)."""
        axis = self.token_dim
        n, done = stored.shape[axis], 0
        while done < n:
            start = (first + done) % self.capacity
            stop = min(self.capacity, start + n - done)
            for piece in self.pieces(buffer, start, stop):
                piece.copy_(stored.narrow(axis, done, piece.shape[axis]))
                done += piece.shape[axis]


_EMPTY = torch.empty(0)

# the fast paths read a KVCache's fields as its methods would: they stand for this file's code
_AS_DEFINED = _own_code.as_defined(KVCache)


def code_as_written() -> bool:
    """True when KVCache's methods and properties are the ones this file defines (no class
    patch)."""
    return _AS_DEFINED(KVCache)


def check_storable(name: str, x: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise a ValueError if x (b, hkv, n, hd), finite, cannot be stored in a cache of
    `dtype`: a float16 cache holds at most 65504 (a key stored as inf weighed 0, silently);
    an int8 cache keeps one float32 scale per token and head, max |x| / 127, which a float64
    x's token may put past float32's range (inf) or below its smallest normal value (the
    token stored as zeros). Only where that range is narrower than x's, and where
    attnlab.debug lets a check read values (the CPU by default)."""
    range_dtype = torch.float32 if dtype == torch.int8 else dtype
    if torch.finfo(range_dtype).max >= torch.finfo(x.dtype).max:
        return
    if not debug.reads_values(x) or not x.numel():
        return
    if dtype == torch.int8:
        _check_scales(name, x)
        return
    largest = largest_magnitude(x)
    if largest <= torch.finfo(dtype).max or not math.isfinite(largest):
        return
    raise ValueError(
        f"the new tokens' {name} hold {largest:g}, past the {dtype} cache's largest value "
        f"({torch.finfo(dtype).max:g}): make the cache in a wider dtype (bfloat16 or float32)"
    )


def _check_scales(name: str, x: torch.Tensor) -> None:
    """check_storable for an int8 cache, which quantizes in float32: each token's largest
    magnitude over hd is 0 or within float32's range, and its scale (that / 127) within
    float32's normal range."""
    largest = torch.linalg.vector_norm(x.detach(), ord=float("inf"), dim=-1)  # (b, hkv, n)
    f32 = torch.finfo(torch.float32)
    bad = (largest > f32.max) | ((largest > 0) & (largest / 127 < f32.tiny))
    if bool(bad.any()):
        raise ValueError(
            f"the new tokens' {name} hold a token of largest magnitude "
            f"{float(largest[bad].flatten()[0]):g}: an int8 cache quantizes in float32 with "
            f"float32 scales (largest / 127), so it holds tokens of largest magnitude 0 or "
            f"from {127 * f32.tiny:g} to {f32.max:g}; use a float32 or float64 cache"
        )


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per token and head: x (b, hkv, n, hd) -> (int8 (b, hkv, n, hd), float32
    scales (b, hkv, n)), x ~= q * scale with scale = max |x| / 127 over hd (0 for zeros)."""
    x32 = x.detach().to(torch.float32)
    scales = x32.abs().amax(-1) / 127  # (b, hkv, n)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    quantized = torch.round(x32 / divisor).clamp_(-127, 127).to(torch.int8)
    return quantized, scales


def check_storage_dtype(dtype: object) -> torch.dtype | None:
    """`dtype` if it is None (torch's default), a floating-point dtype, or int8 (quantized).

    Raises:
        TypeError: anything else.
    """
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    if not (dtype.is_floating_point or dtype == torch.int8) or dtype.is_complex:
        raise TypeError(f"dtype must be a floating-point dtype or torch.int8, got {dtype}")
    return dtype
