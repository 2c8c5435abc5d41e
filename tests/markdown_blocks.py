"""The code blocks, list items and snippet includes of a Markdown page (the README, the docs
site), and how the tests run the code."""

import re

import pytest

# modules the optional extras provide: hf (transformers), onnx (onnx, onnxscript, onnxruntime)
OPTIONAL = {"transformers", "onnx", "onnxscript", "onnxruntime"}


def fenced(text: str, language: str) -> list[str]:
    """The bodies of the ```language blocks of `text`, in order."""
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def block_id(block: str) -> str:
    """A short test id: the block's first line."""
    return block.splitlines()[0][:40]


def run_python(block: str, filename: str) -> None:
    """Run `block` in a fresh namespace; skip, naming the extra, when it imports a module
    that only an optional extra installs and that is missing."""
    try:
        exec(compile(block, filename, "exec"), {})
    except ModuleNotFoundError as error:
        if error.name not in OPTIONAL:
            raise
        pytest.skip(f"needs the optional extra that provides {error.name}")


def _outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number from 1, line) for each line of `text` that is not in a fenced block
    (the fence lines themselves left out)."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
        else:
            lines.append((number, line))
    return lines


LIST_ITEM = re.compile(r"(?:[-*]|\d+\.) ")


def list_items(text: str) -> list[int]:
    """The line numbers of the list items that start at the left margin (a top-level list's
    items), outside code fences: each should become an <li> on the site."""
    return [number for number, line in _outside_fences(text) if LIST_ITEM.match(line)]


def snippets(text: str) -> list[tuple[str, str]]:
    """(path, section) of each pymdownx.snippets include `--8<-- "path:section"` of `text`
    (section "" when the whole file is included)."""
    found = re.findall(r'^\s*--8<-- "([^":]+)(?::(\w+))?"\s*$', text, flags=re.MULTILINE)
    return [(path, section) for path, section in found]


def section(source: str, name: str) -> str:
    """The lines of `source` between its `# --8<-- [start:name]` and `# --8<-- [end:name]`
    lines, as pymdownx.snippets includes them."""
    found = re.search(
        rf"^[^\n]*# --8<-- \[start:{name}\][^\n]*\n(.*?)^[^\n]*# --8<-- \[end:{name}\]",
        source,
        flags=re.MULTILINE | re.DOTALL,
    )
    if found is None:
        raise ValueError(f"no section {name!r} (no start and end markers)")
    return found.group(1)
