"""The documentation site's examples run, and its install commands are the README's."""

import re
from pathlib import Path

import pytest

from tests.markdown_blocks import fenced, run_python

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
BLOCKS = [
    pytest.param(block, page, id=f"{page.relative_to(DOCS)}:{i}")
    for page in PAGES
    for i, block in enumerate(fenced(page.read_text(), "python"))
]


def test_there_are_pages_with_examples():
    assert len(PAGES) >= 10 and len(BLOCKS) >= 15


@pytest.mark.parametrize(("block", "page"), BLOCKS)
def test_python_examples_run(block, page):
    run_python(block, str(page.relative_to(ROOT)))


def test_getting_started_gives_the_readmes_two_commands():
    def bash(text: str) -> list[str]:
        return [b.strip() for b in fenced(text, "bash") if "pip install" in b]

    readme = bash((ROOT / "README.md").read_text())
    assert readme and bash((DOCS / "getting-started.md").read_text()) == readme


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r"([\w/.-]+\.md)", config))
    assert {str(p.relative_to(DOCS)) for p in PAGES} <= listed
