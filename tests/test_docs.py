"""The documentation site's examples run, its install commands are the README's, its pages
render as written (every list a list, on the built site) and read on GitHub too, and the
commands it gives answer --help."""

import doctest
import html
import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import attnlab
from tests.markdown_blocks import OPTIONAL, fenced, list_items, run_python, section, snippets

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


# the built site


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `mkdocs build --strict` builds it (once for this module, ~5-60 s)."""
    for package in ("mkdocs", "material", "mkdocstrings"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (the docs extra: pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    return out


def built_page(site: Path, page: Path) -> Path:
    """Where the site holds `page` (directory URLs: guide/recipes.md -> guide/recipes/)."""
    relative = page.relative_to(DOCS).with_suffix("")
    if relative.name != "index":
        relative = relative / "index"
    return site / relative.with_suffix(".html")


VOID = {"area", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}


class Article(HTMLParser):
    """A built page's own content (its <article>, without the navigation): how many <li> it
    holds; the text of each paragraph and list item (an item's own text, not its nested
    lists'), code blocks left out; the text of each code block; and its links' targets, each
    with whether an element around it is hidden."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.items = 0
        self.blocks: list[tuple[str, str]] = []
        self.code: list[str] = []
        self.links: list[tuple[str, bool]] = []
        self._open: list[tuple[str, bool]] = []  # the elements open inside the article
        self._text: list[tuple[str, list[str]]] = []  # the paragraphs and items open
        self._inside = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        if tag == "article":
            self._inside = True
        if not self._inside or tag in VOID:
            return
        attributes = dict(attrs)
        hidden = "hidden" in attributes or any(h for _, h in self._open)
        self._open.append((tag, hidden))
        if tag == "li":
            self.items += 1
        if tag in ("p", "li"):
            self._text.append((tag, []))
        if tag == "pre":
            self.code.append("")
        if tag == "a" and "href" in attributes:
            self.links.append((attributes["href"], hidden))

    def handle_endtag(self, tag):
        if not self._inside or tag in VOID:
            return
        if tag == "article":
            self._inside = False
        if all(open_tag != tag for open_tag, _ in self._open):
            return  # a stray end tag closes nothing
        while self._open:  # close what the end tag closes (an unclosed <p> included)
            closed, _ = self._open.pop()
            if closed in ("p", "li") and self._text:
                kind, parts = self._text.pop()
                self.blocks.append((kind, "".join(parts)))
            if closed == tag:
                break

    def handle_data(self, data):
        if not self._inside:
            return
        if any(tag == "pre" for tag, _ in self._open):
            self.code[-1] += data
        elif self._text:
            self._text[-1][1].append(data)


def article(site: Path, page: Path) -> Article:
    return Article(built_page(site, page).read_text())


def page_id(page: Path) -> str:
    return str(page.relative_to(DOCS))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_each_list_item_of_the_source_becomes_an_li_on_the_site(site, page):
    """Python-Markdown reads a list right under a paragraph line (no blank line between)
    as more of the paragraph: the site then shows one paragraph with literal " - " and
    " 1. ", and mkdocs build --strict says nothing. Each top-level item must be an <li>."""
    items = list_items(page.read_text())
    built = article(site, page).items
    assert built >= len(items), (
        f"{page.relative_to(ROOT)}: {len(items)} list items in the source (lines {items}), "
        f"{built} <li> on the site: a list right under a paragraph line needs a blank line "
        "before it"
    )


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_paragraph_on_the_site_holds_a_list_as_text(site, page):
    unrendered = [
        f"<{kind}>: {line.strip()[:60]!r}"
        for kind, text in article(site, page).blocks
        for line in text.splitlines()[1:]  # a line after the first that starts like an item
        if re.match(r"\s*(?:[-*]|\d+\.) ", line)
    ]
    assert not unrendered, (
        f"{page.relative_to(ROOT)}: a list rendered as text (a blank line before it, or "
        f"nested items indented 4 spaces): {unrendered}"
    )


def test_no_visible_link_on_the_site_is_broken(site):
    """Relative links of every built page lead to a file of the site, unless hidden (the
    GitHub-only links beside the snippet includes: the site shows the code itself)."""
    broken = []
    for page in PAGES:
        path = built_page(site, page)
        for href, hidden in article(site, page).links:
            target = html.unescape(href).split("#")[0].split("?")[0]
            if hidden or not target or re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            resolved = (path.parent / target).resolve()
            if target.endswith("/"):
                resolved = resolved / "index.html"
            if not (resolved.is_relative_to(site.resolve()) and resolved.exists()):
                broken.append(f"{page.relative_to(DOCS)}: {href}")
    assert not broken, broken


INCLUDING = [p for p in PAGES if snippets(p.read_text())]


def test_there_are_pages_with_snippets():
    assert DOCS / "guide" / "recipes.md" in INCLUDING


@pytest.mark.parametrize("page", INCLUDING, ids=page_id)
def test_a_page_that_includes_files_links_to_them_for_github(page):
    """GitHub shows a snippet include as its `--8<--` line, not the code: the page links to
    each included file (relative to the page, as GitHub resolves it), in a paragraph the
    site hides (there, the code itself stands in its place)."""
    text = page.read_text()
    hidden = "".join(re.findall(r"<p hidden>(.*?)</p>", text, flags=re.DOTALL))
    for path in sorted({path for path, _ in snippets(text)}):
        assert (ROOT / path).is_file(), path
        link = os.path.relpath(ROOT / path, page.parent)
        assert f'href="{link}"' in hidden, (
            f"{page.relative_to(ROOT)} includes {path} but has no hidden-on-site link "
            f'<p hidden>... <a href="{link}">...</a></p> for GitHub readers'
        )


@pytest.mark.parametrize("page", INCLUDING, ids=page_id)
def test_the_site_shows_each_included_section_in_place(site, page):
    shown = article(site, page).code
    included = snippets(page.read_text())
    assert not any("--8<--" in block for block in shown)
    for path, name in included:
        source = (ROOT / path).read_text()
        code = section(source, name) if name else source
        assert code.strip("\n") in [block.strip("\n") for block in shown], (path, name)


# the commands the docs give


def test_cache_error_answers_help_without_running():
    """`python -m attnlab.bench.cache_error --help` once ignored --help and started the
    measurement (minutes long)."""
    ran = subprocess.run(
        [sys.executable, "-m", "attnlab.bench.cache_error", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("usage:") and "cache_error" in ran.stdout


def test_cache_error_refuses_an_unknown_argument(capsys):
    from attnlab.bench import cache_error

    with pytest.raises(SystemExit) as refused:
        cache_error.main(["--steps", "4"])
    assert refused.value.code == 2
    assert "unrecognized arguments: --steps 4" in capsys.readouterr().err
