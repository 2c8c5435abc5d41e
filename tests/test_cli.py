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


def test_out_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    existing = tmp_path / "file.txt"
    existing.write_text("x")
    try:
        cli.main(["demo", "--out", str(existing)])
    except SystemExit as stop:
        assert stop.code == 2
    else:
        raise AssertionError("expected a usage error")
    assert "exists and is not a folder" in capsys.readouterr().err
