"""StaticKVCache: a key/value cache of fixed shapes whose position lives on the device, so
that a decode step reads no value and has the same shapes at every position: a model's
decode loop compiles once (torch.compile(mode="reduce-overhead", fullgraph=True)) and
replays as one CUDA graph, as with transformers' StaticCache and gpt-fast.

Each step writes its keys and values at slots position .. position + n - 1 (index_copy_
with a device index), attends over the whole capacity with a mask that lets each query see
the slots at or before its own position (and within the module's window), then moves the
position on, on the device. A step that raises before its end leaves the position where it
was, and slots past the position are masked: nothing to roll back by copying.

Layout: keys and values (b, hkv, capacity, hd), each token a row of contiguous features (what
SDPA's kernels read without a copy). Storage may be narrower than the module's dtype:
bfloat16/float16, or int8 with symmetric per-token, per-head float32 scales (b, hkv,
capacity), read back in the module's dtype.

Checks: the host keeps a count of the tokens written by eager calls (`tokens`), against
which MultiHeadAttention checks room and context_length without reading the device
position. Under torch.compile the count is not read (a Python int the graph would guard
on, recompiling at every position): there the caller owns the bound, as with transformers'
StaticCache (a step past the capacity overwrites the last slot; it never writes out of
range). The cache is for inference: autograd does not flow through its buffers, so
MultiHeadAttention refuses it where the call would record a graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from attnlab import debug, kv_cache
from attnlab._validate import check_device, check_product, check_size


class StaticKVCache:
    """Fixed-capacity key/value buffers for `batch_size` sequences of up to `max_tokens`
    tokens, written at a position held on the device.

    MultiHeadAttention.make_cache(..., static=True) builds one for a module; pass it as
    `cache=` like a KVCache. With a sliding-window module the cache still holds every
    position (the window is a mask), so max_tokens bounds the sequence.

    Args:
        batch_size: sequences held (an int >= 1).
        max_tokens: positions each sequence may reach: the capacity every step attends over.
        num_kv_heads: key/value heads.
        head_dim: features per head.
        dtype: the storage dtype: the module's, or narrower (bfloat16/float16, or int8 with
            per-token, per-head scales); default torch's.
        device: where the buffers and the position go.

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
    ) -> None:
        self.batch_size = check_size("batch_size", batch_size)
        self.max_tokens = check_size("max_tokens", max_tokens)
        self.num_kv_heads = check_size("num_kv_heads", num_kv_heads)
        self.head_dim = check_size("head_dim", head_dim)
        check_product(
            "batch_size x num_kv_heads x max_tokens x head_dim",
            *(self.batch_size, self.num_kv_heads, self.max_tokens, self.head_dim),
        )
        dtype = kv_cache.check_storage_dtype(dtype)
        device = check_device("device", device)
        shape = (batch_size, num_kv_heads, max_tokens, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (b, hkv, capacity, hd)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.key_scales = self.value_scales = None
        if self.keys.dtype == torch.int8:  # (b, hkv, capacity) float32
            self.key_scales = torch.zeros(shape[:3], device=device)
            self.value_scales = torch.zeros(shape[:3], device=device)
        self.slots = torch.arange(max_tokens, device=device)  # (capacity,): each key's position
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # the next token's
        self.tokens = 0  # tokens written by eager calls: the host's count, for checks
        self._device_ahead = False  # compiled steps moved the position past `tokens`
        from torch import _dynamo  # here, not at import: 1.4 s only a static cache needs

        for tensor in self._tensors():  # fixed addresses: a CUDA graph replays on them
            _dynamo.mark_static_address(tensor)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a step reads or writes in place."""
        scales = () if self.key_scales is None else (self.key_scales, self.value_scales)
        return (self.keys, self.values, *scales, self.slots, self.position)

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype."""
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        """Where the buffers live."""
        return self.keys.device

    @property
    def capacity(self) -> int:
        """Slots per sequence: max_tokens."""
        return self.max_tokens

    @property
    def window(self) -> None:
        """None: a static cache never drops a token (a window is the module's mask)."""
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers, and of an int8 cache's scales."""
        scales = 0 if self.key_scales is None else 2 * self.key_scales.nbytes
        return self.keys.nbytes + self.values.nbytes + scales

    def __repr__(self) -> str:
        return (
            f"StaticKVCache(batch_size={self.batch_size}, max_tokens={self.max_tokens}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"tokens={self.tokens}, dtype={self.dtype})"
        )

    def accepts(self, dtype: torch.dtype) -> bool:
        """Whether keys and values of `dtype` can be stored (as KVCache.accepts)."""
        if dtype == self.dtype:
            return self.dtype.is_floating_point
        narrower = self.dtype in kv_cache.COMPRESSED
        return narrower and dtype.is_floating_point and dtype.itemsize > self.dtype.itemsize

    def is_on_device_of(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is on the buffers' device."""
        return self.keys.device == tensor.device

    def reset(self) -> None:
        """Forget every token: the position goes back to 0 on the device (buffers kept)."""
        self.position.zero_()
        self.tokens = 0
        self._device_ahead = False

    def crop(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (a draft's rejected tokens dropped).

        Args:
            num_tokens: an int in [0, tokens].

        Raises:
            ValueError: more than the cache holds, or negative (TypeError: not an int).
        """
        num_tokens = check_size("num_tokens", num_tokens, minimum=0)
        self.sync_tokens()
        if num_tokens > self.tokens:
            raise ValueError(
                f"num_tokens ({num_tokens}) is more than the cache holds ({self.tokens})"
            )
        self.position.fill_(num_tokens)
        self.tokens = num_tokens

    def check_room(self, num_new: int) -> None:
        """Raise unless `num_new` more tokens fit, by the host's count (no device read
        unless compiled steps moved the position: sync_tokens).

        Raises:
            ValueError: they do not fit, or num_new is not an int >= 1 (TypeError for a
                non-integer).
        """
        num_new = check_size("num_new", num_new)
        self.sync_tokens()
        if self.tokens + num_new > self.max_tokens:
            raise ValueError(
                f"the cache holds {self.tokens} of at most max_tokens ({self.max_tokens}) "
                f"tokens and cannot take {num_new} more; reset() it or make a larger one"
            )

    def _positions(self, num_new: int) -> torch.Tensor:
        """The positions of the next `num_new` tokens, (num_new,) on the device. Under
        torch.compile, where the host's count is not checked, a position past the capacity
        is the last slot's (a wrong answer the caller's bound prevents, never an
        out-of-range read of the rotary tables or write of the buffers)."""
        positions = self.position  # (1,): no op for a decode step
        if num_new != 1:
            positions = self.position + torch.arange(num_new, device=self.position.device)
        if torch.compiler.is_compiling():
            positions = positions.clamp(max=self.max_tokens - 1)
        return positions

    def _write(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (b, hkv, n, hd) at `positions` (n,) and return every slot's keys and
        values (b, hkv, capacity, hd) in k's dtype (as stored: rounded by a narrower store).
        The position does not move: `_advance` moves it once the step has succeeded."""
        self._store(self.keys, self.key_scales, k, positions, "keys")
        self._store(self.values, self.value_scales, v, positions, "values")
        keys = self._read(self.keys, self.key_scales, k.dtype)
        return keys, self._read(self.values, self.value_scales, k.dtype)

    @contextlib.contextmanager
    def _kept_if_raised(self, positions: torch.Tensor) -> Iterator[None]:
        """Around a step that writes `positions` (n,): if it raises, those slots get back
        what they held (a slot past the tokens is masked, but a weight of 0 times an
        infinity written there by a step that overflowed is NaN for every later step).
        Only where the step's value checks run (attnlab.debug: the CPU by default), the one
        place such a step raises: a GPU step, compiled or not, copies nothing (no op more
        per step)."""
        if not debug.reads_values(positions):
            yield
            return
        every = (self.keys, self.values, self.key_scales, self.value_scales)
        tensors = [t for t in every if t is not None]
        held = [t.index_select(2, positions) for t in tensors]  # each (b, hkv, n[, hd])
        try:
            yield
        except BaseException:
            for t, kept in zip(tensors, held, strict=True):
                t.index_copy_(2, positions, kept)
            raise

    def _advance(self, num_new: int) -> None:
        """Move the position on by `num_new` tokens: on the device, and the host's count
        outside torch.compile (inside, the cache notes that the device is ahead: the next
        eager use reads the position back once, sync_tokens)."""
        self.position.add_(num_new)
        if torch.compiler.is_compiling():
            self._device_ahead = True  # a store, no read: no guard, no recompile
        else:
            self.tokens += num_new

    def sync_tokens(self) -> None:
        """Set the host's count from the device's position if compiled steps moved it (one
        read of the position, a host-device sync on a GPU, once after compiled steps)."""
        if torch.compiler.is_compiling() or not self._device_ahead:  # first: no guard on it
            return
        self.tokens = int(self.position)  # (1,) -> int
        self._device_ahead = False

    @property
    def locked_by_inference_mode(self) -> bool:
        """True when the buffers were made under torch.inference_mode() and the caller is
        outside it, where they cannot be written (never while torch.compile traces)."""
        if torch.compiler.is_compiling():
            return False
        return self.keys.is_inference() and not torch.is_inference_mode_enabled()

    def _visible(self, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """(n, capacity) bool: slot s is visible to the query at position p when s <= p
        (and p - s < window): attnlab's causal rule (masks.position_mask) on the slots."""
        query = positions.view(-1, 1)  # (n, 1)
        allowed = self.slots <= query  # (n, capacity)
        if window is not None:
            allowed = allowed & (self.slots > query - window)
        return allowed

    @staticmethod
    def _store(buffer, scales, x: torch.Tensor, positions: torch.Tensor, name: str) -> None:
        kv_cache.check_storable(name, x, buffer.dtype)  # float16's 65504, int8's float32 scales
        if scales is None:
            buffer.index_copy_(2, positions, x.to(buffer.dtype))
            return
        quantized, new_scales = kv_cache.quantize(x)  # (b, hkv, n, hd), (b, hkv, n)
        buffer.index_copy_(2, positions, quantized)
        scales.index_copy_(2, positions, new_scales)

    @staticmethod
    def _read(buffer, scales, dtype: torch.dtype) -> torch.Tensor:
        if scales is None:
            return buffer.to(dtype)
        return (buffer.to(torch.float32) * scales.unsqueeze(3)).to(dtype)  # (b, hkv, cap, hd)
