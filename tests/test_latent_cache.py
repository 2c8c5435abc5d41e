"""LatentCache: rows of [latent, rotary key] per token and sequence, nothing per head; its
bytes, its views, its errors (each leaving it as it was), writes in place or, under
autograd, out of place; narrower storage read back wider."""

import pytest
import torch

from attnlab import KVCache
from attnlab.latent_cache import LatentCache


def _parts(b=2, n=3, r=6, dr=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, r, generator=g, dtype=dtype), torch.randn(
        b, n, dr, generator=g, dtype=dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("r", "dr", "b"), [(512, 64, 1), (6, 4, 3), (8, 0, 2)])
def test_bytes_per_token_is_latent_plus_rotary_key_times_itemsize_times_batch(r, dr, b, dtype):
    cache = LatentCache(b, 100, r, dr, dtype=dtype)
    assert cache.bytes_per_token == (r + dr) * dtype.itemsize * b
    assert cache.nbytes == cache.bytes_per_token * 100 == cache.rows.nbytes
    assert cache.rows.shape == (b, 100, r + dr) and cache.width == r + dr


def test_deepseek_v3_holds_576_values_a_token_against_32768_for_its_heads():
    latent = LatentCache(1, 10, 512, 64, dtype=torch.bfloat16)
    per_head = KVCache(1, 10, 128, 128, dtype=torch.bfloat16)  # keys and values, 128 heads
    assert latent.bytes_per_token == 576 * 2
    assert per_head.nbytes // latent.nbytes == 2 * 128 * 128 // 576  # 56.9x smaller


def test_update_appends_and_returns_every_held_row_in_order():
    cache = LatentCache(2, 10, 6, 4)
    first, second = _parts(n=3, seed=1), _parts(n=2, seed=2)
    cache.update(*first)
    held = cache.update(*second)
    assert cache.position == cache.num_tokens == 5
    torch.testing.assert_close(held[..., :6], torch.cat([first[0], second[0]], 1), rtol=0, atol=0)
    torch.testing.assert_close(held[..., 6:], torch.cat([first[1], second[1]], 1), rtol=0, atol=0)
    torch.testing.assert_close(cache.latents, held[..., :6], rtol=0, atol=0)
    torch.testing.assert_close(cache.rotary_keys, held[..., 6:], rtol=0, atol=0)


def test_writes_are_in_place_without_autograd():
    cache = LatentCache(1, 8, 6, 4)
    pointer = cache.rows.data_ptr()
    for seed in range(4):
        held = cache.update(*_parts(b=1, n=2, seed=seed))
    assert cache.rows.data_ptr() == pointer == held.data_ptr()


def test_under_autograd_a_write_makes_a_new_buffer_and_gradients_flow():
    cache = LatentCache(1, 8, 6, 4)
    first = [t.requires_grad_() for t in _parts(b=1, n=2, seed=3)]
    saved = cache.update(*first)
    pointer = cache.rows.data_ptr()
    second = [t.requires_grad_() for t in _parts(b=1, n=2, seed=4)]
    held = cache.update(*second)
    assert cache.rows.data_ptr() != pointer and cache.records_grad
    (held.sum() + saved.sum()).backward()  # the first rows were saved: unchanged
    assert first[0].grad.eq(2).all() and second[1].grad.eq(1).all()


def test_a_narrower_store_rounds_and_reads_back_in_the_given_dtype():
    cache = LatentCache(2, 4, 6, 4, dtype=torch.bfloat16)
    latent, key = _parts(n=2, seed=5)
    held = cache.update(latent, key)
    assert held.dtype == torch.float32 and cache.dtype == torch.bfloat16
    torch.testing.assert_close(held[..., :6], latent.bfloat16().float(), rtol=0, atol=0)
    assert not torch.equal(held[..., :6], latent)
    assert cache.accepts(torch.float32) and not cache.accepts(torch.float16)
    assert not LatentCache(1, 1, 1, 0).accepts(torch.float64)


def test_reset_and_crop():
    cache = LatentCache(1, 8, 6, 4)
    cache.update(*_parts(b=1, n=5))
    cache.crop(2)
    assert cache.position == 2 and cache.latents.shape == (1, 2, 6)
    with pytest.raises(ValueError, match=r"num_tokens \(3\) is more than the cache holds \(2\)"):
        cache.crop(3)
    cache.reset()
    assert cache.position == 0 and cache.rotary_keys.shape == (1, 0, 4)


def test_transaction_puts_the_position_and_buffer_back():
    cache = LatentCache(1, 8, 6, 4)
    cache.update(*_parts(b=1, n=2, seed=6))
    before = cache.latents.clone()
    rows = cache.rows
    with pytest.raises(RuntimeError, match="boom"), cache.transaction():
        cache.update(*[t.requires_grad_() for t in _parts(b=1, n=3, seed=7)])
        assert cache.position == 5 and cache.rows is not rows
        raise RuntimeError("boom")
    assert cache.position == 2 and cache.rows is rows
    torch.testing.assert_close(cache.latents, before, rtol=0, atol=0)


BAD_UPDATES = {
    "not a tensor": (lambda lat, key: ([1.0], key), TypeError, "latent must be a torch.Tensor"),
    "batch": (lambda lat, key: (lat[:1], key[:1]), ValueError, r"latent of shape \(1, 3, 6\)"),
    "width": (lambda lat, key: (lat, key[..., :2]), ValueError, r"rotary_key of shape \(2, 3, 2\)"),
    "tokens differ": (lambda lat, key: (lat, key[:, :2]), ValueError, "same number of tokens"),
    "dtype": (lambda lat, key: (lat.double(), key.double()), TypeError, "float64 on cpu"),
    "integers": (lambda lat, key: (lat.long(), key), TypeError, "torch.int64"),
    "full": (lambda lat, key: (torch.cat([lat] * 3, 1), torch.cat([key] * 3, 1)), ValueError,
             r"holds 2 of at most max_tokens \(10\) tokens and cannot take 9 more"),
    "empty": (lambda lat, key: (lat[:, :0], key[:, :0]), ValueError, "no tokens"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_UPDATES.values(), ids=BAD_UPDATES.keys())
def test_a_bad_update_is_refused_by_name_and_changes_nothing(case):
    make, error, message = case
    cache = LatentCache(2, 10, 6, 4)
    cache.update(*_parts(n=2, seed=8))
    before = cache.rows.clone()
    with pytest.raises(error, match=message):
        cache.update(*make(*_parts(seed=9)))
    assert cache.position == 2
    torch.testing.assert_close(cache.rows, before, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ((0, 4, 6, 4), ValueError, "batch_size must be >= 1, got 0"),
        ((1, True, 6, 4), TypeError, "max_tokens must be an int, got bool"),
        ((1, 4, 0, 4), ValueError, "kv_lora_rank must be >= 1"),
        ((1, 4, 6, -2), ValueError, "qk_rope_head_dim must be >= 0"),
        ((2**21, 2**20, 6, 4), ValueError, r"batch_size x max_tokens x \(kv_lora_rank"),
    ],
)
def test_bad_sizes_are_named(arguments, error, message):
    with pytest.raises(error, match=message):
        LatentCache(*arguments)


@pytest.mark.parametrize(
    ("dtype", "message"),
    [(torch.int8, "floating-point dtype, got torch.int8"), ("float32", "torch.dtype or None")],
)
def test_a_dtype_that_is_not_floating_point_is_refused(dtype, message):
    with pytest.raises(TypeError, match=message):
        LatentCache(1, 4, 6, 4, dtype=dtype)


def test_a_cache_made_under_inference_mode_knows_it_is_locked_outside():
    with torch.inference_mode():
        cache = LatentCache(1, 4, 6, 4)
        assert not cache.locked_by_inference_mode
    assert cache.locked_by_inference_mode


def test_repr_names_the_sizes_and_position():
    cache = LatentCache(2, 16, 6, 4)
    cache.update(*_parts(n=3))
    assert repr(cache) == (
        "LatentCache(batch_size=2, max_tokens=16, kv_lora_rank=6, qk_rope_head_dim=4, "
        "position=3, dtype=torch.float32)"
    )
