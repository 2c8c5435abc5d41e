"""The code blocks of a Markdown page (the README, the docs site), and how the tests run them."""

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
