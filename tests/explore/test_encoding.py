"""The maps stored in the page decode back to the tensors, within the stated precision, on
the Python side (the page's own arithmetic, without a browser)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnlab
from attnlab.explore import Capture, Exploration, Group
from attnlab.explore.encoding import (
    AUTO_16_BITS_UP_TO,
    choose_bits,
    decode_group,
    encode_group,
    half_steps,
)
from attnlab.explore.page import read_payload


def _group(layers, heads, queries, keys, seed, scores=False):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(layers, heads, queries, keys, generator=generator) * 3  # (l, h, q, k)
    allowed = torch.rand(layers, heads, queries, keys, generator=generator) > 0.3
    if not scores:
        values = torch.softmax(values.masked_fill(~allowed, -torch.inf), dim=-1).nan_to_num(0.0)
    labels_q = tuple(f"q{i}" for i in range(queries))
    labels_k = tuple(f"k{j}" for j in range(keys))
    names = tuple(f"layer {i}" for i in range(layers))
    return Group("g", values, allowed, labels_q, labels_k, names, scores=scores)


@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    queries=st.integers(1, 9),
    keys=st.integers(1, 9),
    seed=st.integers(0, 2**31),
    bits=st.sampled_from([8, 16]),
    scores=st.booleans(),
)
def test_stored_maps_decode_within_half_a_step(layers, heads, queries, keys, seed, bits, scores):
    group = _group(layers, heads, queries, keys, seed, scores)
    stored = encode_group(group, bits)
    values, allowed = decode_group(stored, group.shape)
    assert torch.equal(allowed, group.full_mask())
    half = torch.tensor(half_steps(stored), dtype=torch.float64).reshape(layers, heads, 1, 1)
    error = (values - group.weights.double()).abs()
    assert bool((error[allowed] <= half.expand_as(error)[allowed] + 1e-12).all())
    assert bool(values[~allowed].isnan().all())


def test_a_zero_weight_is_stored_exactly_and_apart_from_a_masked_cell():
    weights = torch.tensor([[[[0.0, 0.25, 0.75], [0.5, 0.5, 0.0]]]])  # (1, 1, 2, 3)
    allowed = torch.tensor([[True, True, True], [True, True, False]])
    group = Group("g", weights, allowed, ("a", "b"), ("a", "b", "c"), ("l",))
    values, decoded_allowed = decode_group(encode_group(group, 8), group.shape)
    assert values[0, 0, 0, 0].item() == 0.0 and decoded_allowed[0, 0, 0, 0]
    assert not decoded_allowed[0, 0, 1, 2]
    assert values[0, 0, 0, 2].item() == 0.75  # the highest value is stored exactly


def test_the_saved_file_decodes_back_to_the_chapters_tensors(tmp_path):
    result = attnlab.explore()
    path = result.save(tmp_path / "chapter.html")
    (data,) = read_payload(path.read_text(encoding="utf-8"))
    assert data["title"] == result.capture.title
    for stored, group in zip(data["groups"], result.capture.groups, strict=True):
        values, allowed = decode_group(stored, group.shape)
        assert torch.equal(allowed, group.full_mask())
        half = max(half_steps(stored))
        torch.testing.assert_close(
            values[allowed], group.weights.double()[allowed], atol=half, rtol=0
        )
        assert stored["queries"] == list(group.query_tokens)


def test_the_page_is_self_contained_and_its_data_cannot_close_the_script():
    weights = torch.tensor([[[[1.0]]]])
    group = Group("</script><b>", weights, torch.tensor(True), ("</script>",), ("x",), ("l",))
    html = Exploration(Capture("t</script>", (group,))).html()
    assert html.count("</script>") == 2  # the data's and the page script's, no other
    assert "http://" not in html and "https://" not in html  # no CDN, no link out
    (data,) = read_payload(html)
    assert data["groups"][0]["queries"] == ["</script>"]


def test_auto_precision_is_16_bits_for_small_pages_and_8_past_the_threshold():
    assert choose_bits("auto", AUTO_16_BITS_UP_TO) == 16
    assert choose_bits("auto", AUTO_16_BITS_UP_TO + 1) == 8
    assert choose_bits(8, 10) == 8


def test_a_non_finite_unmasked_value_is_refused_by_name():
    weights = torch.tensor([[[[0.5, float("nan")]]]])
    group = Group("mine", weights, torch.tensor(True), ("a",), ("a", "b"), ("l0",))
    with pytest.raises(ValueError, match=r"group 'mine': layer 'l0' head 0 holds nan"):
        encode_group(group, 8)


def test_notebook_outputs_are_fragments_with_their_own_ids():
    result = attnlab.explore()
    first, second = result._repr_html_(), result._repr_html_()
    assert "<html" not in first and "<!DOCTYPE" not in first
    ids = [re.search(r'<div class="axp" id="([\w-]+)">', text).group(1) for text in (first, second)]
    assert ids[0] != ids[1]
    assert f'}})("{ids[0]}");' in first  # the script draws its own div only
