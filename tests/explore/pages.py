"""Reading the explorer's page back: what it shows for a row, a cell, a pixel; and the
comparison of shown values with the tensor at the stored precision."""

from __future__ import annotations

import torch

from attnlab.explore.encoding import half_steps, shown_precision


def panel(index: int) -> str:
    return f".axp-detail[data-panel='{index}']"


def shown_row(page, query: int, panel_index: int = 0, hover: bool = True) -> list[str]:
    """Hover query token `query` in a panel's head view; the row's values as shown."""
    if hover:
        page.hover(f"{panel(panel_index)} .axp-q[data-q='{query}']")
    return page.eval_on_selector_all(
        f"{panel(panel_index)} .axp-row .axp-cell", "cells => cells.map(c => c.dataset.value)"
    )


def shown_cell(page, query: int, key: int, panel_index: int = 0) -> str:
    """Hover heatmap cell (query, key); the value its tooltip shows."""
    canvas = page.locator(f"{panel(panel_index)} canvas.axp-heat")
    box = canvas.bounding_box()
    keys, queries = _shape(page, panel_index)
    x = box["x"] + (key + 0.5) * box["width"] / keys
    y = box["y"] + (query + 0.5) * box["height"] / queries
    page.mouse.move(x, y)
    tip = page.locator(f"{panel(panel_index)} .axp-tip")
    assert (tip.get_attribute("data-q"), tip.get_attribute("data-k")) == (str(query), str(key))
    return tip.get_attribute("data-value")


def pixel(page, query: int, key: int, panel_index: int = 0) -> tuple[int, int, int]:
    """The heatmap's colour at the centre of cell (query, key)."""
    return tuple(
        page.eval_on_selector(
            f"{panel(panel_index)} canvas.axp-heat",
            """(c, [q, k, nq, nk]) => {
                const x = Math.floor((k + 0.5) * c.width / nk);
                const y = Math.floor((q + 0.5) * c.height / nq);
                return [...c.getContext('2d').getImageData(x, y, 1, 1).data].slice(0, 3);
            }""",
            [query, key, *reversed(_shape(page, panel_index))],
        )
    )


def _shape(page, panel_index: int) -> tuple[int, int]:
    """(keys, queries) of the map shown in a panel."""
    queries = page.locator(f"{panel(panel_index)} .axp-q").count()
    keys = page.locator(f"{panel(panel_index)} .axp-k").count()
    return keys, queries


def tolerance(data: dict, group: int, layer: int, head: int) -> float:
    """How far a shown value may be from the tensor's: the precision the page states (half a
    stored step, plus half the last printed decimal)."""
    stored = data["groups"][group]
    index = layer * stored["heads"] + head
    return shown_precision(half_steps(stored)[index]) + 1e-12


def assert_row_equal(
    shown: list[str], weights: torch.Tensor, allowed: torch.Tensor, tol: float
) -> None:
    """Each shown value equals the tensor's row within tol; masked exactly where not allowed."""
    assert len(shown) == weights.shape[0]
    for key, (text, value, ok) in enumerate(
        zip(shown, weights.tolist(), allowed.tolist(), strict=True)
    ):
        if not ok:
            assert text == "masked", f"key {key}: shown {text}, expected masked"
        else:
            assert text != "masked", f"key {key}: shown masked, expected {value}"
            assert abs(float(text) - value) <= tol, f"key {key}: shown {text}, tensor {value}"
