"""Size and opening time of `attnlab explore` pages at the size the issue names: 12 layers
x 12 heads x 256 tokens, in headless Chromium.

    PYTHONPATH=src .venv/bin/python scripts/explore_figures.py [--runs 5] [--out DIR]
        [--screenshot docs/images/explore-large.png]

Three pages: a GPT-2-small-shaped model with random weights (transformers, built from its
configuration: no download) at 8 bits ("auto" at this size), the same at 16 bits, and a
worst case for the storage: every cell a different random weight (softmax of normal scores,
causal), at 8 bits. Each page is opened `--runs` times in a fresh page of one browser; the
time is the page's own clock (performance.now()) from navigation start to every thumbnail,
the first head view and heatmap drawn (the page sets data-ready-ms then). Needs Debian's
chromium (/usr/bin/chromium) and the playwright package (pip; no `playwright install`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnlab.explore import Capture, Exploration, Group, explore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.explore.conftest import ARGS, CHROMIUM  # the tests' browser, as they launch it

LAYERS, HEADS, TOKENS = 12, 12, 256


def gpt2_page(precision: int) -> tuple[Exploration, float]:
    """A GPT-2-small-shaped model (random weights) on 256 token ids, and seconds taken."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_layer=LAYERS, n_head=HEADS, n_embd=768, n_positions=TOKENS)
    model = GPT2Model(config)
    ids = torch.randint(0, config.vocab_size, (TOKENS,))
    start = time.perf_counter()
    result = explore(model, ids, precision=precision)
    result.html()
    return result, time.perf_counter() - start


def worst_page() -> tuple[Exploration, float]:
    """Every cell a different random causal weight: what deflate cannot shrink."""
    torch.manual_seed(0)
    causal = torch.ones(TOKENS, TOKENS, dtype=torch.bool).tril()  # (t, t)
    scores = torch.randn(LAYERS, HEADS, TOKENS, TOKENS) * 2  # (l, h, t, t)
    weights = torch.softmax(scores.masked_fill(~causal, -torch.inf), dim=-1)
    labels = tuple(f"t{i}" for i in range(TOKENS))
    layers = tuple(f"layer {i}" for i in range(LAYERS))
    group = Group("random weights", weights, causal, labels, labels, layers)
    start = time.perf_counter()
    result = Exploration(Capture("worst case: random weights", (group,)), precision=8)
    result.html()
    return result, time.perf_counter() - start


def open_times(paths: list[Path], runs: int, screenshot: Path | None) -> list[list[float]]:
    """Milliseconds from navigation start to the page drawn, `runs` times per file; with
    `screenshot`, the first page with layer 5 head 7 open and query 100 hovered."""
    from playwright.sync_api import sync_playwright

    times = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        if screenshot is not None:
            _screenshot(browser, paths[0], screenshot)
        for path in paths:
            found = []
            for _ in range(runs):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(path.resolve().as_uri())
                page.wait_for_selector(".axp[data-ready='1']", timeout=60_000)
                found.append(float(page.get_attribute(".axp", "data-ready-ms")))
                page.close()
            times.append(found)
        browser.close()
    return times


def _screenshot(browser, path: Path, out: Path) -> None:
    page = browser.new_page(viewport={"width": 1300, "height": 1150})
    page.goto(path.resolve().as_uri())
    page.wait_for_selector(".axp[data-ready='1']", timeout=60_000)
    page.click("canvas.axp-thumb[data-layer='5'][data-head='7']")
    page.hover(".axp-detail[data-panel='0'] .axp-q[data-q='100']")
    page.screenshot(path=str(out), full_page=True)
    page.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="folder for the pages")
    parser.add_argument(
        "--screenshot", type=Path, default=None, help="PNG of the first page, a head open"
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="attnlab-explore-"))
    pages = {
        "GPT-2 small shape, random weights, 8 bits": gpt2_page(8),
        "GPT-2 small shape, random weights, 16 bits": gpt2_page(16),
        "worst case, every cell random, 8 bits": worst_page(),
    }
    paths = []
    for index, (result, _) in enumerate(pages.values()):
        paths.append(result.save(out / f"explore-{index}.html"))
    times = open_times(paths, args.runs, args.screenshot)
    print(f"{LAYERS} layers x {HEADS} heads x {TOKENS} tokens; Chromium, {args.runs} opens each")
    python = sys.version.split()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; Python {python}")
    print(f"{'page':45} {'file MB':>8} {'write s':>8} {'open ms (median, max)':>22}")
    for (name, (_, seconds)), path, found in zip(pages.items(), paths, times, strict=True):
        size = path.stat().st_size / 1e6
        median, worst = statistics.median(found), max(found)
        print(f"{name:45} {size:8.2f} {seconds:8.2f} {median:14.0f} ({worst:.0f})")
    print(f"files in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
