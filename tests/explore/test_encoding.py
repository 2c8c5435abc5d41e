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


# --- what the page holds is bounded: cells cut before encoding, labels shortened ---------


@pytest.fixture
def encoded(monkeypatch):
    """(function, cells) for every group the page encodes or summarises."""
    from attnlab.explore import page

    seen = []
    for name in ("encode_group", "head_stats"):
        original = getattr(page, name)

        def spy(group, *args, _original=original, _name=name):
            seen.append((_name, group.weights.numel()))
            return _original(group, *args)

        monkeypatch.setattr(page, name, spy)
    return seen


@pytest.mark.parametrize(
    ("max_cells", "shape", "said"),
    [
        (2 * 300 * 300, (1, 2, 300, 300), ["heads 2 to 3 cut (2 of 4 heads kept"]),
        (
            10_000,
            (1, 1, 100, 100),
            [
                "heads 1 to 3 cut (1 of 4 heads kept",
                "each map cut to its first 100 queries and 100",
            ],
        ),
    ],
    ids=["heads", "heads-and-tokens"],
)
def test_one_layer_past_max_cells_is_cut_before_encoding_and_statistics(
    encoded, max_cells, shape, said
):
    """A single layer past max_cells was kept whole (a 10,000-token page took 120 s, most
    of it encoding and summarising maps): now no more than max_cells cells are encoded."""
    torch.manual_seed(0)
    module = attnlab.MultiHeadAttention(8, 8, 512, 0.0, num_heads=4)
    x = torch.randn(1, 300, 8, generator=torch.Generator().manual_seed(1))
    result = attnlab.explore(module, x, max_tokens=300, max_cells=max_cells)
    result.html()
    (group,) = result.capture.groups
    assert group.shape == shape
    assert sorted(name for name, _ in encoded) == ["encode_group", "head_stats"]
    assert all(cells <= max_cells for _, cells in encoded), encoded
    assert [next(c for c in result.capture.cuts if s in c) for s in said]
    with torch.no_grad():
        _, weights = module(x, need_weights=True)  # (1, h, t, t)
    _, heads, queries, keys = shape
    expected = weights[0, :heads, :queries, :keys]  # the top-left block of the first heads
    torch.testing.assert_close(group.weights[0], expected, rtol=0, atol=0)
    stored, _ = decode_group(result.data["groups"][0], shape)
    assert stored.shape == shape


def test_a_huge_token_makes_no_huge_page():
    """A 10-million-character token made a 20 MB page (its label, twice): labels are
    shortened for display, the text kept for the tooltip up to a bound."""
    from attnlab.explore.page import LABEL_SHOWN, LABEL_TIP

    module = attnlab.book.CausalAttention(3, 2, 8, 0.0)
    huge = "x" * 10_000_000
    result = attnlab.explore(module, [huge, "journey", "y" * 30])
    plain = attnlab.explore(module, ["a", "journey", "b"])
    grown = len(result.html().encode()) - len(plain.html().encode())
    assert grown < 4 * (LABEL_SHOWN + LABEL_TIP + 64), grown  # queries and keys, each
    assert result.capture.groups[0].query_tokens[0] == huge  # the capture keeps the text
    data = result.data["groups"][0]
    assert data["queries"] == data["keys"] == ["x" * 23 + "\u2026", "journey", "y" * 23 + "\u2026"]
    tips = {"0": "x" * 499 + "\u2026 (10,000,000 characters)", "2": "y" * 30}
    assert data["query_tips"] == data["key_tips"] == tips
    assert plain.data["groups"][0]["query_tips"] == {}
