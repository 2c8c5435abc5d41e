"""attnlab._build: the kernels' build is keyed by everything that changes the binary (one
folder per key, so two environments never rebuild each other's), says in one stderr line
that it builds and how long it took, loads a finished build directly, and fails in one line
naming ATTNLAB_NO_EXTENSION=1."""

import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from attnlab import _build

FLAGS, LDFLAGS = ["-O3", "-DCPU_CAPABILITY=DEFAULT"], ["-fopenmp"]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "kernel.cpp"
    path.write_text("// a kernel\n")
    return path


def _name(source, flags=FLAGS, ldflags=LDFLAGS):
    return _build.extension_name("attnlab_test", source, flags, ldflags)


def _soabi(value):
    real = sysconfig.get_config_var
    return lambda name: value if name == "SOABI" else real(name)


CHANGES = {
    "torch version": lambda mp, src: mp.setattr(torch, "__version__", "1.0.0+other"),
    "python version": lambda mp, src: mp.setattr(sys.implementation, "cache_tag", "cpython-99"),
    "python abi": lambda mp, src: mp.setattr(sysconfig, "get_config_var", _soabi("other-abi")),
    "machine": lambda mp, src: mp.setattr(platform, "machine", lambda: "other-machine"),
    "compiler": lambda mp, src: mp.setenv("CXX", "attnlab-other-compiler"),
    "source": lambda mp, src: src.write_text("// another kernel\n"),
    "builders' lock": lambda mp, src: mp.setattr(_build, "BUILDER_LOCK", "another.lock"),
}


@pytest.mark.parametrize("component", CHANGES)
def test_the_name_changes_with_each_component_of_the_environment(component, source, monkeypatch):
    before = _name(source)
    CHANGES[component](monkeypatch, source)
    assert _name(source) != before


def test_the_name_changes_with_the_flags(source):
    assert _name(source, flags=["-O2"]) != _name(source)
    assert _name(source, ldflags=[]) != _name(source)


def test_the_same_environment_gives_the_same_name(source):
    assert _name(source) == _name(source)
    assert _name(source).startswith("attnlab_test_")


def test_two_keys_build_in_two_folders(source, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    first = _build.build_directory(_name(source))
    monkeypatch.setattr(torch, "__version__", "1.0.0+other")
    second = _build.build_directory(_name(source))
    assert first != second and first.parent == second.parent == tmp_path / "cache"


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """cpp_extension.load recorded instead of run, in an empty extensions folder."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_build, "_missing", lambda: None)
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    return calls


def test_a_build_says_so_in_one_line_with_its_duration(fake_build, source, capsys):
    assert _build.load("attnlab_test", source, "the test kernel", "Python") is None
    assert len(fake_build) == 1 and fake_build[0]["name"].startswith("attnlab_test_")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("attnlab: building the test kernel") and lines[0].endswith(" s")


@pytest.fixture
def no_polling(monkeypatch):
    """With an OS lock, a load never polls cpp_extension's lock file (which waits for a killed
    build's lock for STALE_LOCK_SECONDS): polling fails the test at once."""

    def polled(lock):
        raise AssertionError(f"polled {lock}")

    if _build.fcntl is not None:
        monkeypatch.setattr(_build, "_wait_for_lock", polled)


def test_a_lock_a_killed_build_left_is_removed_at_once_and_the_build_goes_on(
    fake_build, source, capsys, no_polling
):
    """cpp_extension waits for its lock file as long as it exists; a build killed while it
    held it leaves it behind. Holding the builder's OS lock, which no running build holds
    then, a load removes it however recent, says so in the build's line, and builds."""
    lock = _build.build_directory(_name(source, _build.cflags(), _build.LDFLAGS)) / "lock"
    lock.write_bytes(b"")
    assert _build.load("attnlab_test", source, "the test kernel", "Python") is None
    assert not lock.exists() and len(fake_build) == 1
    assert "removed the lock of a build that was stopped" in capsys.readouterr().err


# Another process's build, as far as the lock goes: it takes the builder lock, writes
# cpp_extension's lock file, says so, then sleeps until killed or, told "finish" on stdin,
# writes the library and the record that it finished, removes its lock file and ends.
OTHER_BUILD = """
import fcntl, pathlib, sys, time
folder, builder_lock, library, finished = pathlib.Path(sys.argv[1]), *sys.argv[2:5]
handle = open(folder / builder_lock, "a")
fcntl.flock(handle, fcntl.LOCK_EX)
(folder / "lock").write_bytes(b"")
print("building", flush=True)
sys.stdin.readline()
(folder / library).write_bytes(b"")
status = (folder / library).stat()
(folder / finished).write_text(f"{status.st_size} {status.st_mtime_ns}")
(folder / "lock").unlink()
"""


@pytest.fixture
def other_build(fake_build, source):
    """A started OTHER_BUILD in the test kernel's build folder, holding its locks."""
    name = _name(source, _build.cflags(), _build.LDFLAGS)
    folder = _build.build_directory(name)
    args = [sys.executable, "-c", OTHER_BUILD, str(folder), _build.BUILDER_LOCK, f"{name}.so"]
    args.append(_build.FINISHED)
    process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "building\n"
    yield process
    process.kill()
    process.wait()


def _load_in_a_thread(source):
    """_build.load of the test kernel started in a thread; (thread, its result list)."""
    result = []
    thread = threading.Thread(
        target=lambda: result.append(_build.load("attnlab_test", source, "the kernel", "Python")),
        daemon=True,  # a load that never returns fails its test instead of hanging pytest
    )
    thread.start()
    return thread, result


@pytest.mark.skipif(_build.fcntl is None, reason="no OS lock here (fcntl): see the next tests")
def test_a_load_waits_for_a_running_build_and_goes_on_when_it_is_killed(
    other_build, fake_build, source, capsys, no_polling
):
    thread, result = _load_in_a_thread(source)
    thread.join(0.5)
    assert thread.is_alive() and fake_build == []  # waiting, however old the lock file gets
    other_build.kill()  # SIGKILL: nothing of the build's own cleanup runs
    thread.join(30)
    assert not thread.is_alive() and result == [None] and len(fake_build) == 1
    lock = _build.build_directory(fake_build[0]["name"]) / "lock"
    err = capsys.readouterr().err
    assert "waiting for another process's build" in err and not lock.exists()
    assert "removed the lock of a build that was stopped" in err


@pytest.mark.skipif(_build.fcntl is None, reason="no OS lock here (fcntl): see the next tests")
def test_a_load_that_waited_loads_what_the_other_build_built(
    other_build, fake_build, source, capsys, monkeypatch, no_polling
):
    loaded = []
    monkeypatch.setattr(_build, "_load_library", lambda path: loaded.append(path) or True)
    thread, result = _load_in_a_thread(source)
    thread.join(0.5)
    assert thread.is_alive() and loaded == []
    other_build.communicate("finish\n", timeout=30)
    thread.join(30)
    assert result == [None] and fake_build == [] and len(loaded) == 1
    assert "built by another process" in capsys.readouterr().err


def test_without_an_os_lock_a_lock_older_than_a_build_is_removed(
    fake_build, source, capsys, monkeypatch
):
    """Where there is no fcntl (Windows), a lock file older than a build can take
    (STALE_LOCK_SECONDS) is a killed build's: removed, said, and built."""
    monkeypatch.setattr(_build, "fcntl", None)
    lock = _build.build_directory(_name(source, _build.cflags(), _build.LDFLAGS)) / "lock"
    lock.write_bytes(b"")
    old = time.time() - _build.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    assert _build.load("attnlab_test", source, "the test kernel", "Python") is None
    assert not lock.exists() and len(fake_build) == 1
    assert "removed a stale lock" in capsys.readouterr().err


def test_without_an_os_lock_a_build_in_progress_is_waited_for(fake_build, source, monkeypatch):
    monkeypatch.setattr(_build, "fcntl", None)
    lock = _build.build_directory(_name(source, _build.cflags(), _build.LDFLAGS)) / "lock"
    lock.write_bytes(b"")
    slept = []

    def sleep(seconds):  # the other build ends after two waits
        slept.append(seconds)
        if len(slept) == 2:
            lock.unlink()

    monkeypatch.setattr(_build.time, "sleep", sleep)
    assert _build.load("attnlab_test", source, "the test kernel", "Python") is None
    assert len(slept) == 2 and len(fake_build) == 1


def test_a_finished_build_is_loaded_without_building(fake_build, source, capsys, monkeypatch):
    name = _name(source, _build.cflags(), _build.LDFLAGS)
    folder = _build.build_directory(name)
    (folder / f"{name}.so").write_bytes(b"")
    _build._mark_finished(folder / f"{name}.so")
    loaded = []
    monkeypatch.setattr(_build, "_load_library", lambda path: loaded.append(path) or True)
    assert _build.load("attnlab_test", source, "the test kernel", "Python") is None
    assert fake_build == [] and loaded == [folder / f"{name}.so"]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("record", ["none", "another library's"])
def test_a_library_no_build_finished_is_built_again_never_loaded(
    fake_build, source, monkeypatch, record
):
    """A build killed while it links can leave a library that crashes the process when it
    is mapped: one without the record of a finished build (or with a record of another
    size or time) is built again, not loaded."""
    name = _name(source, _build.cflags(), _build.LDFLAGS)
    library = _build.build_directory(name) / f"{name}.so"
    library.write_bytes(b"\x7fELF half a library")
    if record != "none":
        (library.parent / _build.FINISHED).write_text("12 34")
    loaded = []
    monkeypatch.setattr(_build, "_load_library", lambda path: loaded.append(path) or True)
    assert _build.load("attnlab_test", source, "the test kernel", "Python") is None
    assert loaded == [] and len(fake_build) == 1
    assert _build._finished(library)  # the build's own library, recorded


@pytest.mark.skipif(_build.fcntl is None, reason="no OS lock here (fcntl)")
def test_the_os_lock_is_held_while_cpp_extension_builds(fake_build, source, monkeypatch):
    held = []

    def load(*, name, **kwargs):  # another open of the lock file cannot take it meanwhile
        with open(_build.build_directory(name) / _build.BUILDER_LOCK, "a") as other:
            held.append(not _build._try_lock(other))
        (_build.build_directory(name) / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", load)
    assert _build.load("attnlab_test", source, "the test kernel", "Python") is None
    assert held == [True]


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="no /proc to see processes in")
def test_a_stopped_builds_compiler_still_working_in_the_folder_is_waited_for(
    fake_build, source, capsys, monkeypatch, no_polling
):
    """Python killed alone leaves its ninja and compiler running in the build folder (their
    working directory): the lock file is removed, and the build starts, only once they have
    ended."""
    folder = _build.build_directory(_name(source, _build.cflags(), _build.LDFLAGS))
    lock = folder / "lock"
    lock.write_bytes(b"")
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"], cwd=folder)
    seen_at_build = []  # (compiler ended, lock file there) when the build starts

    def load(**kwargs):
        seen_at_build.append((compiler.poll() is not None, lock.exists()))

    monkeypatch.setattr(cpp_extension, "load", load)
    assert _build.load("attnlab_test", source, "the test kernel", "Python") is None
    compiler.wait()
    err = capsys.readouterr().err
    assert f"waiting for processes [{compiler.pid}]" in err
    assert "removed the lock of a build that was stopped" in err
    assert seen_at_build == [(True, False)]


def test_an_extensions_folder_that_cannot_hold_a_build_is_one_line(source, monkeypatch, tmp_path):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(blocked / "cache"))
    monkeypatch.setattr(_build, "_missing", lambda: None)
    with pytest.warns(RuntimeWarning, match="its build folder cannot be made") as caught:
        assert _build.load("attnlab_test", source, "the test kernel", "Python") is not None
    assert len(caught) == 1 and "\n" not in str(caught[0].message)


def test_threads_computing_the_build_key_at_once_get_one_key(tmp_path):
    """sysconfig's first read of its variables is not thread-safe (SOABI came back None in
    one of two racing threads): a fresh process's threads all get the same key."""
    source = tmp_path / "kernel.cpp"
    source.write_text("// a kernel\n")
    code = (
        "import sys, threading; from pathlib import Path; from attnlab import _build;"
        "names = [];"
        "run = lambda: names.append(_build.name_for('attnlab_test', Path(sys.argv[1])));"
        "threads = [threading.Thread(target=run) for _ in range(8)];"
        "[t.start() for t in threads]; [t.join() for t in threads];"
        "print(len(set(names)), len(names))"
    )
    for _ in range(3):
        result = subprocess.run(
            [sys.executable, "-c", code, str(source)], capture_output=True, text=True, check=True
        )
        assert result.stdout.split() == ["1", "8"]


COMPILER_OUTPUT = (
    "Error building extension 'attnlab_test_0123': [1/2] c++ -MMD -MF kernel.o.d -O3 "
    "-c kernel.cpp -o kernel.o\nFAILED: kernel.o\nIn file included from kernel.cpp:1:\n"
    "kernel.cpp:3:10: fatal error: Python.h: No such file or directory\n"
    "compilation terminated.\nninja: build stopped: subcommand failed.\n"
)


def _fail(**kwargs):
    raise RuntimeError(COMPILER_OUTPUT)


def test_a_failed_build_is_one_line_naming_the_switch(fake_build, source, monkeypatch, capsys):
    monkeypatch.setattr(cpp_extension, "load", _fail)
    with pytest.warns(RuntimeWarning) as record:
        reason = _build.load("attnlab_test", source, "the test kernel", "Python")
    assert (
        reason == "RuntimeError: kernel.cpp:3:10: fatal error: Python.h: No such file or directory"
    )
    (warning,) = record
    message = str(warning.message)
    assert "\n" not in message and "ninja: build stopped" not in message
    assert "Python.h" in message and "ATTNLAB_NO_EXTENSION=1" in message
    assert capsys.readouterr().err.endswith(" failed\n")


def test_no_compiler_is_said_before_torch_is_asked(source, monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setenv("CXX", "attnlab-no-such-compiler")
    monkeypatch.setattr(cpp_extension, "load", _fail)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler.*ATTNLAB_NO_EXTENSION=1"):
        reason = _build.load("attnlab_test", source, "the test kernel", "Python")
    assert "'attnlab-no-such-compiler' is not on PATH" in reason


def test_macos_is_not_built(source, monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(cpp_extension, "load", _fail)
    with pytest.warns(RuntimeWarning, match="macOS"):
        reason = _build.load("attnlab_test", source, "the test kernel", "Python")
    assert "OpenMP" in reason and "sgemm_" in reason


def test_turned_off_it_neither_builds_nor_warns(source, monkeypatch):
    monkeypatch.setenv("ATTNLAB_NO_EXTENSION", "1")
    monkeypatch.setattr(cpp_extension, "load", _fail)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            _build.load("attnlab_test", source, "x", "y") == "turned off by ATTNLAB_NO_EXTENSION=1"
        )


@pytest.mark.parametrize(
    ("machine", "capability", "vectorised"),
    [
        ("x86_64", "AVX512", True),
        ("x86_64", "AVX2", True),
        ("x86_64", "DEFAULT", False),
        ("aarch64", "DEFAULT", False),
    ],
)
def test_the_vectorised_build_is_x86_avx2(machine, capability, vectorised, monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert _build.vectorised() is vectorised
    assert ("-DCPU_CAPABILITY=AVX2" in _build.vector_flags()) is vectorised
    wide = _build.vector_flags(wide=True)  # AVX-512 exactly where PyTorch runs its own
    assert ("-DCPU_CAPABILITY=AVX512" in wide) is (vectorised and capability == "AVX512")
    assert ("-DCPU_CAPABILITY=AVX2" in wide) is (vectorised and capability == "AVX2")


@pytest.mark.parametrize("has_them", [True, False])
@pytest.mark.parametrize("takes", [True, False])
@pytest.mark.parametrize("vectors", [None, "avx512", "avx2"])
def test_bfloat16_products_are_built_where_the_cpu_has_them(has_them, takes, vectors, monkeypatch):
    """-mavx512bf16 joins the AVX-512 flags exactly where torch reports AVX512_BF16 and the
    compiler takes the flag, unless ATTNLAB_VECTORS=avx512 (or avx2) asks for a build
    without them."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: has_them)
    monkeypatch.setattr(_build, "compiler_takes", lambda flag, compiler: takes)
    if vectors is None:
        monkeypatch.delenv(_build.VECTORS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(_build.VECTORS_VARIABLE, vectors)
    flags = _build.cflags(_build._wide(True))
    assert (_build.BF16_FLAG in flags) is (has_them and takes and vectors is None)
    assert ("-DCPU_CAPABILITY=AVX512" in flags) is (vectors != "avx2")
    assert _build.BF16_FLAG not in _build.cflags(False)


def test_a_compiler_check_tells_a_known_flag_from_an_unknown_one_and_a_missing_compiler():
    compiler = _build.cxx()
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) here")
    assert _build.compiler_takes("-O2", compiler)
    assert not _build.compiler_takes("-mno-such-flag-attnlab", compiler)
    assert not _build.compiler_takes("-O2", "/nonexistent/attnlab-c++")


def test_attnlab_vectors_avx2_keeps_the_avx2_build(fake_build, source, monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv(_build.VECTORS_VARIABLE, "avx2")
    assert _build.load("attnlab_test", source, "the test kernel", "Python", wide=True) is None
    assert "-DCPU_CAPABILITY=AVX2" in fake_build[0]["extra_cflags"]


# ---------------------------------------------------------------------------------------------
# one name per environment: builds in one process never change the next build's name


def _names_in_a_fresh_process(*specs: tuple[str, str, bool]) -> list[str]:
    """_build.name_for of each (base, source, wide), computed by a new interpreter."""
    code = (
        "import sys, json; from pathlib import Path; from attnlab import _build;"
        "specs = json.loads(sys.argv[1]);"
        "print(json.dumps([_build.name_for(b, Path(s), wide=w) for b, s, w in specs]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(specs)], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout)


def _torch_like_load(calls):
    """cpp_extension.load as torch's behaves towards its arguments: it appends torch's own
    linker flags to the extra_ldflags list it is given, in place (cpp_extension's
    _prepare_ldflags), and leaves the library in the build folder; recorded in `calls`."""

    def load(*, name, extra_ldflags, **kwargs):
        extra_ldflags += ["-L/torch/lib", "-lc10", "-ltorch_cpu"]
        (_build.build_directory(name) / f"{name}.so").write_bytes(b"")
        calls.append(name)

    return load


def test_a_second_build_in_one_process_gets_the_name_every_process_computes(
    fake_build, tmp_path, monkeypatch
):
    """Two extensions built one after the other in one process get the names a fresh
    process computes for them (the first build's flags never leak into the second's key),
    and asking for the second again loads it without building."""
    calls = []
    monkeypatch.setattr(cpp_extension, "load", _torch_like_load(calls))
    monkeypatch.setattr(_build, "_load_library", lambda path: True)
    sources = [tmp_path / "first.cpp", tmp_path / "second.cpp"]
    for index, path in enumerate(sources):
        path.write_text(f"// kernel {index}\n")
    specs = [("attnlab_first", str(sources[0]), False), ("attnlab_second", str(sources[1]), True)]
    for base, path, wide in specs:
        assert _build.load(base, Path(path), "a kernel", "Python", wide=wide) is None
    assert calls == _names_in_a_fresh_process(*specs)
    assert _build.LDFLAGS == ("-fopenmp",)
    assert _build.load("attnlab_second", sources[1], "a kernel", "Python", wide=True) is None
    assert len(calls) == 2  # found built under the same name: loaded, not built again


def test_two_processes_compute_the_same_names_for_attnlab_s_extensions():
    """Each extension's name (the folder it is built in) is the same in every process of
    this environment, and it is the name the loaded library has here."""
    from attnlab import prebuild

    code = (
        "import importlib; from attnlab import prebuild;"
        "print(*[importlib.import_module(m).build_name() for m, _ in prebuild.EXTENSIONS])"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
        for _ in range(2)
    ]
    modules = [importlib.import_module(name) for name, _ in prebuild.EXTENSIONS]
    assert runs[0] == runs[1] == [module.build_name() for module in modules]
    for module, name in zip(modules, runs[0], strict=True):
        if module.available():
            assert _build._LOADED[module._NAME].stem == name


def test_the_test_command_builds_the_extensions_before_the_tests_uncaptured(tmp_path):
    """tests/conftest.py loads (building where needed) every extension at the session's
    start with pytest's capture suspended: the build's line, or here its failure's one
    warning line, reaches the terminal before any test runs."""
    env = os.environ | {"CXX": "attnlab-no-such-compiler", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop("ATTNLAB_NO_EXTENSION", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/test_build.py::test_the_same_environment_gives_the_same_name"],
        env=env, capture_output=True, text=True, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    said = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if "is unavailable: no C++ compiler" in line
    ]
    assert len(said) == 2, result.stdout + result.stderr  # one per extension
