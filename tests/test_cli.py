"""The `attnlab` command line."""

import os
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


def test_demo_help_has_a_description(capsys):
    try:
        cli.main(["demo", "--help"])
    except SystemExit as stop:
        assert stop.code == 0
    out = capsys.readouterr().out
    assert "six-token example" in out.split("options:")[0].split("\n", 2)[2]


def test_build_builds_every_extension_ahead_of_time(monkeypatch, capsys):
    from attnlab import decode_cpu, flash_cpu

    monkeypatch.setattr(flash_cpu, "load_error", lambda: None)
    monkeypatch.setattr(decode_cpu, "load_error", lambda: "no C++ compiler")
    assert cli.main(["build"]) == 1
    captured = capsys.readouterr()
    assert "attnlab.flash_cpu: ready" in captured.out
    assert "attnlab.decode_cpu: unavailable: no C++ compiler" in captured.err


def test_build_turned_off_says_so():
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "build"],
        env={**os.environ, "ATTNLAB_NO_EXTENSION": "1"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert result.stderr.count("turned off by ATTNLAB_NO_EXTENSION=1") == 2


def test_a_check_usage_error_prints_the_check_usage(capsys):
    try:
        cli.main(["check", "--no-such-option"])
    except SystemExit as stop:
        assert stop.code == 2
    else:
        raise AssertionError("expected a usage error")
    assert "usage: attnlab check" in capsys.readouterr().err


def test_bench_quick_says_its_figures_are_not_representative(monkeypatch, capsys):
    from attnlab.bench import cli as bench_cli

    monkeypatch.setattr(bench_cli, "_run_mode", lambda args, mode: 0)
    assert cli.main(["bench", "--quick"]) == 0
    assert "not representative" in capsys.readouterr().out
    assert cli.main(["bench", "--decode"]) == 0
    assert "not representative" not in capsys.readouterr().out


def _imports_cpp_extension(code: str) -> bool:
    """Whether a fresh interpreter running `code` ends with torch.utils.cpp_extension
    imported (it prints torch's "No CUDA runtime is found" on the CUDA wheels)."""
    probe = f"{code}\nimport sys\nprint('torch.utils.cpp_extension' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    return result.stdout.split()[-1] == "True"


def test_importing_the_cli_and_its_help_leave_the_build_machinery_unimported():
    """Importing attnlab.cli and `attnlab --help` leave torch.utils.cpp_extension (which
    prints "No CUDA runtime is found" at import on the CUDA wheels) unimported."""
    assert not _imports_cpp_extension("import attnlab.cli")
    help_run = (
        "from attnlab import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass"
    )
    assert not _imports_cpp_extension(help_run)


def test_attnlab_build_imports_the_build_machinery():
    """`attnlab build` builds or loads the kernels through torch.utils.cpp_extension."""
    assert _imports_cpp_extension("from attnlab import cli\ncli.main(['build'])")
