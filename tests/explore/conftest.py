"""The explorer's browser: one headless Chromium per test session (Debian's chromium
package driven by the playwright Python package), and pages opened through a route that
serves the page itself and refuses, and records, every other request.

Where there is no browser the browser tests are skipped with a message saying how to get
one; with ATTNLAB_REQUIRE_BROWSER=1 (CI sets it) they fail instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("ATTNLAB_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
URL = "http://attnlab.invalid/explore.html"
HOW_TO_INSTALL = (
    "the explorer's browser tests need headless Chromium: `apt-get install -y chromium` "
    "(Debian's package, /usr/bin/chromium, or set ATTNLAB_CHROMIUM) and "
    "`pip install playwright` (the Python package only; `playwright install` is not needed)"
)


def _missing(why: str):
    if os.environ.get("ATTNLAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"ATTNLAB_REQUIRE_BROWSER=1 but {why}: {HOW_TO_INSTALL}")
    pytest.skip(f"{why}: {HOW_TO_INSTALL}")


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session (skipped, saying how to install it, if absent)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed")
    if not Path(CHROMIUM).is_file():
        _missing(f"no browser at {CHROMIUM}")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


@dataclass
class Opened:
    """A page opened from an HTML text, with what it logged and requested."""

    page: object
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


@pytest.fixture
def open_html(browser):
    """open_html(html) -> Opened: the page served at URL (every other request refused and
    recorded), waited for until every explorer in it has drawn."""
    pages = []

    def opener(html: str, width: int = 1300) -> Opened:
        page = browser.new_page(viewport={"width": width, "height": 900})
        pages.append(page)
        opened = Opened(page)
        page.on(
            "console", lambda m: m.type in ("error", "warning") and opened.errors.append(m.text)
        )
        page.on("pageerror", lambda e: opened.errors.append(str(e)))
        page.on("request", lambda r: opened.requests.append(r.url))

        def route(r):
            if r.request.url == URL:
                r.fulfill(status=200, content_type="text/html; charset=utf-8", body=html)
            else:
                r.abort()

        page.route("**/*", route)
        page.goto(URL)
        page.wait_for_function(
            "[...document.querySelectorAll('.axp')].every(e => e.dataset.ready)", timeout=20_000
        )
        return opened

    yield opener
    for page in pages:
        page.close()


@pytest.fixture
def screenshots(tmp_path):
    """Where screenshots go: ATTNLAB_SCREENSHOTS (docs/images to refresh the docs' ones),
    else the test's temporary folder."""
    folder = Path(os.environ.get("ATTNLAB_SCREENSHOTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder
