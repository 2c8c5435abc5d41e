"""The README's commands and examples are the ones that work."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def fenced(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_two_setup_commands_and_ci_runs_the_test_one():
    setup = README.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = [block.strip() for block in re.findall(r"```bash\n(.*?)```", setup, re.DOTALL)]
    assert len(commands) == 2
    demo_command, test_command = commands
    assert demo_command.endswith("attnlab demo")
    assert test_command.endswith("python -m pytest")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


OPTIONAL = {"transformers", "onnx", "onnxscript", "onnxruntime"}  # the hf and onnx extras


@pytest.mark.parametrize("block", fenced("python"), ids=lambda b: b.splitlines()[0][:40])
def test_python_examples_run(block):
    try:
        exec(compile(block, "README.md", "exec"), {})
    except ModuleNotFoundError as error:
        if error.name not in OPTIONAL:
            raise
        pytest.skip(f"needs the optional extra that provides {error.name}")
