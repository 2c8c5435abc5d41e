"""The explorer in a real browser (headless Chromium): it loads offline with no error, shows
the head clicked, and every value it shows is the tensor's, to the stored precision; masked
cells are marked apart from zeros. Screenshots for the docs are taken here (conftest's
`screenshots`: ATTNLAB_SCREENSHOTS=docs/images refreshes the docs' ones)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import book
from attnlab.explore import combine
from attnlab.explore.chapter import CAUSAL
from tests.explore import models
from tests.explore.conftest import URL
from tests.explore.pages import (
    assert_row_equal,
    panel,
    pixel,
    shown_cell,
    shown_row,
    tolerance,
)

TEXT = "Your journey starts with one step"


def _gpt2_page(layers=2, heads=3):
    model = models.tiny_gpt2(layers, heads)
    tokenizer = models.tokenizer()
    result = attnlab.explore(model, TEXT, tokenizer=tokenizer)
    reference = models.eager_attentions(model, **tokenizer(TEXT, return_tensors="pt"))
    return result, reference.attentions


def test_chapter_page_loads_offline_with_no_error(open_html, screenshots):
    result = attnlab.explore()
    opened = open_html(result.html())
    assert opened.errors == []
    assert opened.requests == [URL]  # the page itself, nothing else
    page = opened.page
    assert page.get_attribute(".axp", "data-ready") == "1"
    assert page.title() == result.capture.title
    assert page.locator(".axp-tabs button").count() == 3
    page.click(".axp-tabs button[data-group='1']")  # the weights: softmax, dropout
    page.click("canvas.axp-thumb[data-layer='1'][data-head='0']")
    page.hover(f"{panel(0)} .axp-q[data-q='3']")
    page.screenshot(path=str(screenshots / "explore-chapter.png"), full_page=True)


def test_clicking_a_head_shows_that_head(open_html):
    result, attentions = _gpt2_page()
    opened = open_html(result.html())
    page = opened.page
    for layer, head in [(1, 2), (0, 1)]:
        page.click(f"canvas.axp-thumb[data-layer='{layer}'][data-head='{head}']")
        shown = page.locator(panel(0))
        assert (shown.get_attribute("data-layer"), shown.get_attribute("data-head")) == (
            str(layer),
            str(head),
        )
        assert f"layer {layer} \u00b7 head {head}" in page.inner_text(f"{panel(0)} h3")
        assert page.locator("canvas.axp-thumb.axp-a").count() == 1
        tol = tolerance(result.data, 0, layer, head)
        causal = CAUSAL  # GPT-2 is causal: above the diagonal is masked
        assert_row_equal(shown_row(page, 4), attentions[layer][0, head, 4], causal[4], tol)
    assert opened.errors == []


def test_every_hovered_row_equals_the_models_row(open_html, screenshots):
    result, attentions = _gpt2_page()
    opened = open_html(result.html())
    page = opened.page
    layer, head = 1, 1
    page.click(f"canvas.axp-thumb[data-layer='{layer}'][data-head='{head}']")
    tol = tolerance(result.data, 0, layer, head)
    for query in range(6):
        shown = shown_row(page, query)
        assert_row_equal(shown, attentions[layer][0, head, query], CAUSAL[query], tol)
    page.screenshot(path=str(screenshots / "explore-gpt2.png"), full_page=True)
    assert opened.errors == []


def test_heatmap_hover_shows_the_exact_value_and_masked_cells(open_html):
    result, attentions = _gpt2_page()
    page = open_html(result.html()).page
    page.click("canvas.axp-thumb[data-layer='0'][data-head='2']")
    tol = tolerance(result.data, 0, 0, 2)
    for query, key in [(0, 0), (3, 1), (5, 5), (5, 2)]:
        shown = shown_cell(page, query, key)
        assert abs(float(shown) - attentions[0][0, 2, query, key].item()) <= tol
    for query, key in [(0, 1), (2, 5)]:
        assert shown_cell(page, query, key) == "masked"


def test_masked_cells_are_drawn_apart_from_zero_weights(open_html):
    """The chapter's dropout stage: a dropped weight is 0 and drawn in the colour scale's
    lowest shade; a masked cell (above the diagonal) is grey, with no value."""
    page = open_html(attnlab.explore().html()).page
    page.click(".axp-tabs button[data-group='1']")
    page.click("canvas.axp-thumb[data-layer='1'][data-head='0']")  # dropout p=0.5
    dropped = attnlab.explore().capture.groups[1].weights[1, 0]  # (6, 6)
    zero = next((q, k) for q in range(6) for k in range(q + 1) if dropped[q, k] == 0)
    masked = (0, 5)
    r, g, b = pixel(page, *masked)
    assert r == g == b  # grey, hatched
    assert len(set(pixel(page, *zero))) == 3  # a colour of the weights' scale, not grey
    row = shown_row(page, zero[0])
    assert float(row[zero[1]]) == 0.0
    assert row[masked[1]] == "masked"
    keys = page.locator(f"{panel(0)} .axp-k.axp-masked")
    assert keys.count() == 5 - zero[0]  # the masked keys are struck through in the head view


def test_a_pinned_row_stays_while_hovering_elsewhere(open_html):
    page = open_html(attnlab.explore().html()).page
    page.click(".axp-tabs button[data-group='2']")
    page.click(f"{panel(0)} .axp-q[data-q='2']")
    page.hover(f"{panel(0)} .axp-q[data-q='5']")
    assert page.get_attribute(f"{panel(0)} .axp-row", "data-query") == "2"
    assert page.locator(f"{panel(0)} .axp-q.axp-pinned").get_attribute("data-q") == "2"
    page.click(f"{panel(0)} .axp-q[data-q='2']")  # unpinned
    page.hover(f"{panel(0)} .axp-q[data-q='5']")
    assert page.get_attribute(f"{panel(0)} .axp-row", "data-query") == "5"


def test_two_models_side_by_side(open_html, screenshots):
    first, first_attn = _gpt2_page()
    model = models.tiny_gpt2(2, 3, seed=1)
    tokenizer = models.tokenizer()
    second = attnlab.explore(model, TEXT, tokenizer=tokenizer)
    second_attn = models.eager_attentions(model, **tokenizer(TEXT, return_tensors="pt")).attentions
    both = combine(first, second, names=("seed 0", "seed 1"))
    page = open_html(both.html()).page
    page.click("canvas.axp-thumb[data-layer='1'][data-head='0']")
    page.select_option("select.axp-compare", "1/1/0")  # the second model, same head
    assert page.locator(panel(1)).is_visible()
    assert "seed 1" in page.inner_text(f"{panel(1)} h3")
    for query in (3, 5):
        shown = shown_row(page, query, panel_index=1)
        tol = tolerance(both.data, 1, 1, 0)
        assert_row_equal(shown, second_attn[1][0, 0, query], CAUSAL[query], tol)
        shown = shown_row(page, query, panel_index=0)
        tol = tolerance(both.data, 0, 1, 0)
        assert_row_equal(shown, first_attn[1][0, 0, query], CAUSAL[query], tol)
    page.screenshot(path=str(screenshots / "explore-compare.png"), full_page=True)


def test_encoder_decoder_cross_attention(open_html):
    model, tokenizer = models.tiny_t5(), models.tokenizer()
    result = attnlab.explore(model, TEXT, tokenizer=tokenizer, decoder_inputs="the journey")
    enc = tokenizer(TEXT, return_tensors="pt")
    dec = tokenizer("the journey", return_tensors="pt")["input_ids"]
    reference = models.eager_attentions(model, **enc, decoder_input_ids=dec)
    page = open_html(result.html()).page
    page.click(".axp-tabs button[data-group='2']")  # decoder cross-attention
    page.click("canvas.axp-thumb[data-layer='1'][data-head='1']")
    assert page.locator(f"{panel(0)} .axp-k").all_inner_texts() == TEXT.split()
    tol = tolerance(result.data, 2, 1, 1)
    every = torch.ones(6, dtype=torch.bool)
    assert_row_equal(shown_row(page, 1), reference.cross_attentions[1][0, 1, 1], every, tol)


def test_two_outputs_in_one_notebook_page_do_not_clash(open_html):
    chapter, module = attnlab.explore(), attnlab.explore(book.CausalAttention(3, 2, 6, 0.0))
    body = chapter._repr_html_() + module._repr_html_()
    opened = open_html(f"<!DOCTYPE html><html><body>{body}</body></html>")
    page = opened.page
    roots = page.locator(".axp")
    assert roots.count() == 2
    assert roots.nth(0).get_attribute("id") != roots.nth(1).get_attribute("id")
    second = roots.nth(1)
    second.locator(f"{panel(0)} .axp-q[data-q='3']").click()  # pinned in the second only
    assert second.locator(f"{panel(0)} .axp-row").get_attribute("data-query") == "3"
    assert roots.nth(0).locator(f"{panel(0)} .axp-row").get_attribute("data-query") == ""
    assert opened.errors == []


def test_a_cut_input_says_what_was_cut(open_html):
    text = " ".join(["the journey"] * 10)  # 20 tokens
    result = attnlab.explore(book.CausalAttention(3, 2, 64, 0.0), text, max_tokens=8)
    page = open_html(result.html()).page
    note = page.inner_text(".axp-notes li.axp-cut")
    assert "20 tokens, cut to the first 8" in note
    assert page.locator(f"{panel(0)} .axp-q").count() == 8


@pytest.mark.parametrize("bits", [8, 16])
def test_stated_precision_holds_at_8_and_16_bits(open_html, bits):
    module = attnlab.MultiHeadAttention(8, 8, 32, 0.0, num_heads=2)
    x = torch.randn(1, 12, 8, generator=torch.Generator().manual_seed(1))
    result = attnlab.explore(module, x, precision=bits)
    with torch.no_grad():
        _, weights = module(x, need_weights=True)
    page = open_html(result.html()).page
    page.click("canvas.axp-thumb[data-layer='0'][data-head='1']")
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    tol = tolerance(result.data, 0, 0, 1)
    assert tol < (2.5e-3 if bits == 8 else 1e-5)  # half a step, half the last decimal
    for query in range(12):
        assert_row_equal(shown_row(page, query), weights[0, 1, query], causal[query], tol)
    for query, key in [(0, 0), (11, 4), (7, 7)]:
        assert abs(float(shown_cell(page, query, key)) - weights[0, 1, query, key].item()) <= tol


def test_a_huge_token_is_drawn_short_with_its_text_in_the_tooltip(open_html):
    huge = "journey" * 1_000_000  # 7 million characters
    result = attnlab.explore(book.CausalAttention(3, 2, 8, 0.0), ["Your", huge, "starts"])
    opened = open_html(result.html())
    page = opened.page
    query = page.locator(f"{panel(0)} .axp-q[data-q='1']")
    assert query.inner_text() == ("journey" * 4)[:23] + "\u2026"
    title = query.get_attribute("title")
    assert title.startswith("query 1: \u201cjourneyjourney") and "7,000,000 characters" in title
    assert len(title) < 600
    key = page.locator(f"{panel(0)} .axp-k[data-k='1']")
    assert key.get_attribute("title").startswith("key 1: \u201cjourney")
    assert page.locator(f"{panel(0)} .axp-q[data-q='0']").get_attribute("title") == "query 0"
    assert opened.errors == []


def test_a_page_cut_to_max_cells_draws_the_kept_maps(open_html):
    module = attnlab.MultiHeadAttention(8, 8, 64, 0.0, num_heads=2)
    x = torch.randn(1, 40, 8, generator=torch.Generator().manual_seed(2))
    result = attnlab.explore(module, x, max_tokens=40, max_cells=20 * 20)
    opened = open_html(result.html())
    page = opened.page
    assert page.locator(f"{panel(0)} .axp-q").count() == 20
    assert page.locator("canvas.axp-thumb").count() == 1
    notes = page.inner_text(".axp-notes")
    assert "heads 1 to 1 cut" in notes and "each map cut to its first 20 queries and 20" in notes
    with torch.no_grad():
        _, weights = module(x, need_weights=True)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    tol = tolerance(result.data, 0, 0, 0)
    for query in (0, 7, 19):
        assert_row_equal(shown_row(page, query), weights[0, 0, query, :20], causal[query], tol)
    assert opened.errors == []
