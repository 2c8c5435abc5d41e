"""The README's commands and examples are the ones that work."""

import re
from pathlib import Path

import pytest

from tests.markdown_blocks import block_id, fenced, run_python

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_two_setup_commands_and_ci_runs_the_test_one():
    setup = README.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = [block.strip() for block in re.findall(r"```bash\n(.*?)```", setup, re.DOTALL)]
    assert len(commands) == 2
    demo_command, test_command = commands
    assert demo_command.endswith("attnlab demo")
    assert test_command.endswith("python -m pytest")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


@pytest.mark.parametrize("block", fenced(README, "python"), ids=block_id)
def test_python_examples_run(block):
    run_python(block, "README.md")
