"""The documentation site's examples run, and its install commands are the README's."""

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import attnlab
from tests.markdown_blocks import OPTIONAL, fenced, run_python

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


def _public_modules() -> list[str]:
    """attnlab's public modules (no part of the name private): the API reference renders
    their docstrings, so their examples run here."""
    every = ["attnlab"] + [m.name for m in pkgutil.walk_packages(attnlab.__path__, "attnlab.")]
    return [m for m in every if not any(part.startswith("_") for part in m.split("."))]


@pytest.mark.parametrize("name", _public_modules())
def test_docstring_examples_run(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name not in OPTIONAL:
            raise
        pytest.skip(f"needs the optional extra that provides {error.name}")
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    for test in doctest.DocTestFinder().find(module, name):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_getting_started_gives_the_readmes_two_commands():
    def bash(text: str) -> list[str]:
        return [b.strip() for b in fenced(text, "bash") if "pip install" in b]

    readme = bash((ROOT / "README.md").read_text())
    assert readme and bash((DOCS / "getting-started.md").read_text()) == readme


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r"([\w/.-]+\.md)", config))
    assert {str(p.relative_to(DOCS)) for p in PAGES} <= listed
