"""The `attnlab` command line."""

import subprocess
import sys

from attnlab import __version__, cli


def test_demo_command_writes_into_out(tmp_path, capsys):
    assert cli.main(["demo", "--out", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("*.png"))) == 6
    assert "Wrote 6 heatmaps" in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_python_dash_m_and_version():
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == f"attnlab {__version__}"
