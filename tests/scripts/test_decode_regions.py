"""scripts/decode_regions.py inserts its clock at named places in csrc/decode_step.cpp's
text: each place must be there exactly once, or the script would stop (or, worse, time
something else). Checked here so that a change to the kernel that moves a place fails the
suite, not a later measurement. Nothing is built."""

from __future__ import annotations

import importlib

import pytest
import torch

from attnlab import MultiHeadAttention
from tests.scripts import script


@pytest.fixture(scope="module")
def regions():
    with script("decode_regions") as module:  # decode_regions imports decode_gqa beside it
        yield module


def test_every_place_of_the_clock_is_in_the_kernel_once(regions):
    text = regions.SOURCE.read_text()
    counts = {anchor: text.count(anchor) for anchor, _ in regions.PLACES}
    assert counts == {anchor: 1 for anchor in counts}


def test_the_clocked_text_has_each_insertion_and_its_own_library_name(regions):
    text = regions.clocked_text(regions.SOURCE.read_text(), "attnlab_decode_regions_test")
    for _, replacement in regions.PLACES:
        assert replacement in text
    assert "TORCH_LIBRARY(attnlab_decode," not in text
    assert "TORCH_LIBRARY(attnlab_decode_regions_test," in text
    assert "TORCH_LIBRARY_FRAGMENT(attnlab_decode_regions_test, m)" in text


def test_a_place_that_is_gone_stops_the_script(regions):
    anchor = regions.PLACES[1][0]  # the projection's parallel region
    text = regions.SOURCE.read_text().replace(anchor, "")
    with pytest.raises(SystemExit, match="no longer has this place once"):
        regions.clocked_text(text, "attnlab_decode_regions_test")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_the_attentions_bytes_are_what_the_layers_caches_hold(regions, cache_dtype):
    """The attention region's bytes per step, against the bytes of the caches the stack's
    layers hold (KVCache.nbytes, keys, values and an int8 cache's scales)."""
    kv, batch, context = 4, 3, 40
    module = MultiHeadAttention(
        regions.D_MODEL, regions.D_MODEL, 8, 0.0, regions.HEADS, num_kv_heads=kv
    )
    held = module.make_cache(batch, context, dtype=cache_dtype).nbytes
    _, (cache_bytes, _), _ = regions.region_loads(kv, batch, context, cache_dtype)
    assert cache_bytes == regions.LAYERS * held


def test_cold_steps_flush_before_each_step_and_leave_the_flush_out_of_the_time(regions):
    """--cold: every step follows a flush, and only the step is timed (a clock that reads
    the calls made so far: each step's call counts 1, each flush's 10)."""
    events: list[str] = []

    def clock():
        return sum(1 if event == "step" else 10 for event in events)

    seconds = regions.timed_steps(
        lambda: events.append("step"), 3, lambda: events.append("flush"), clock
    )
    assert events == ["flush", "step"] * 3
    assert seconds == 1
    events.clear()
    regions.timed_steps(lambda: events.append("step"), 2, clock=clock)  # back to back
    assert events == ["step", "step"]


def test_decode_gqa_cold_medians_flush_before_each_timed_call(regions):
    """decode_gqa.py --cold: the bench's cold timing (interleaved_medians), a flush before
    every timed call of every step, three calls per step and round, one median per step."""
    gqa = importlib.import_module("decode_gqa")
    events: list[str] = []

    def step(name):
        return lambda: events.append(name)

    medians = gqa.median_cold_seconds([step("a"), step("b")], 2, lambda: events.append("flush"))
    timed = ["flush", "a"] * 3 + ["flush", "b"] * 3
    assert events == ["a", "b"] + timed * 2  # one warm-up call each, then the rounds
    assert len(medians) == 2 and all(0 <= m < 1 for m in medians)
