"""Building attnlab's C++ extensions (csrc/) once per environment, shared by every kernel.

torch.utils.cpp_extension builds into TORCH_EXTENSIONS_DIR/<name>/ and rebuilds whenever
the build's inputs differ from the last build under that name, so two virtual environments
sharing one name rebuild each other's kernel at every switch. Here the name carries a hash
of everything that changes the binary: the torch build, the Python ABI, the machine, the
compiler, the flags and the source. Each environment keeps its own build, loaded directly
on later runs; a build says so in one line on stderr with its duration; a failure is one
line saying what is missing and how to turn the extensions off (ATTNLAB_NO_EXTENSION=1).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from attnlab import fake_ops

# sysconfig reads its variables on the first call, and two threads making that call at once
# can get None for SOABI (then two build keys, two builds): read them once, here.
sysconfig.get_config_vars()

try:  # an OS lock on the build folder, released when its process ends however it ends
    import fcntl
except ImportError:  # Windows: the age of cpp_extension's lock file instead (_wait_for_lock)
    fcntl = None

OFF_VARIABLE = "ATTNLAB_NO_EXTENSION"
VECTORS_VARIABLE = "ATTNLAB_VECTORS"
_HOW_TO_SKIP = f"{OFF_VARIABLE}=1 skips the build"
_MACOS = "not built on macOS (Apple's clang has no OpenMP and Accelerate may not export sgemm_)"


def vectorised() -> bool:
    """True where the build gets ATen's AVX2 vectors: x86-64 with PyTorch's capability AVX2
    or AVX-512. Elsewhere the build is ATen's portable one (CPU_CAPABILITY=DEFAULT: scalar
    on x86, NEON on aarch64)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return platform.machine() in ("x86_64", "AMD64") and capability in ("AVX2", "AVX512")


AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
BF16_FLAG = "-mavx512bf16"  # bfloat16 dot products (vdpbf16ps), where the CPU has them


def bfloat16_products() -> bool:
    """Whether an AVX-512 build also gets AVX512_BF16's dot products (the decode step's
    int8 and bfloat16 caches multiply with them): where this CPU has them and the compiler
    takes -mavx512bf16 (GCC 10 and clang 9 on), unless ATTNLAB_VECTORS=avx512 asks for the
    AVX-512 build without them (to test it)."""
    if os.environ.get(VECTORS_VARIABLE) == "avx512":
        return False
    has_them = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return has_them and compiler_takes(BF16_FLAG, cxx())


def cxx() -> str:
    """The C++ compiler torch's extension builder calls: $CXX, else c++."""
    return os.environ.get("CXX", "c++")


@functools.cache
def compiler_takes(flag: str, compiler: str) -> bool:
    """Whether `compiler` compiles an empty C++ file with `flag` (an older one refuses a
    flag it does not know; the build then goes without it). False where it is missing."""
    try:
        run = subprocess.run(
            [compiler, flag, "-x", "c++", "-fsyntax-only", "-"],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return run.returncode == 0


def vector_flags(wide: bool = False) -> list[str]:
    """Compiler flags for ATen's vector types on this CPU (see `vectorised`): AVX2, or with
    `wide` AVX-512 where PyTorch runs its own AVX-512 kernels on this CPU, with its bfloat16
    dot products where `bfloat16_products`."""
    if not vectorised():
        return ["-DCPU_CAPABILITY=DEFAULT"]
    if wide and torch.backends.cpu.get_cpu_capability() == "AVX512":
        products = [BF16_FLAG] if bfloat16_products() else []
        return [*AVX512_FLAGS, *products, "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    return ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]


def cflags(wide: bool = False) -> list[str]:
    """The compiler flags an attnlab extension is built with (`wide`: see vector_flags)."""
    return ["-O3", "-fopenmp", *vector_flags(wide)]


# A tuple: cpp_extension.load appends torch's own flags to the list it is given, in place,
# so a list shared between builds would change every later build's key (another name, a
# build again); each build gets a copy (_build_and_load).
LDFLAGS = ("-fopenmp",)


def build_key(source: Path, flags: Sequence[str], ldflags: Sequence[str]) -> dict[str, str]:
    """Everything that changes the binary built from `source` with these flags, and how
    builds share its folder: the OS lock they hold there (BUILDER_LOCK), so that an older
    attnlab, which only waits for cpp_extension's lock file, never builds in a folder where
    a lock file with no OS lock held beside it is taken for a killed build's."""
    compiler = cxx()
    found = shutil.which(compiler)
    return {
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "python": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('SOABI')}",
        "machine": platform.machine(),
        "compiler": os.path.realpath(found) if found else compiler,
        "cflags": " ".join(flags),
        "ldflags": " ".join(ldflags),
        "source": hashlib.sha256(_source_text(source)).hexdigest(),
        "builders": f"flock {BUILDER_LOCK}",
    }


def _source_text(source: Path) -> bytes:
    """`source` and, after it, each header of its folder it includes ("name.h"): the text a
    build compiles."""
    text = source.read_bytes()
    headers = re.findall(rb'^#include "([\w.]+)"', text, flags=re.MULTILINE)
    return b"".join([text, *(source.with_name(h.decode()).read_bytes() for h in headers)])


def extension_name(base: str, source: Path, flags: Sequence[str], ldflags: Sequence[str]) -> str:
    """`base` and a 12-digit hash of the build key: one name, one folder, per binary."""
    key = json.dumps(build_key(source, flags, ldflags), sort_keys=True)
    return f"{base}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    """The folder cpp_extension builds extension `name` in (TORCH_EXTENSIONS_DIR/name)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


def load(base: str, source: Path, what: str, fallback: str, *, wide: bool = False) -> str | None:
    """Build (once per build key) and load the extension of `source` (its operators
    register themselves with torch.ops).

    Args:
        base: the extension's name before the key's hash, e.g. "attnlab_causal_flash".
        source: its C++ file.
        what: what it is, for the messages ("attnlab's causal kernel").
        fallback: what runs instead when it is unavailable ("PyTorch's SDPA").
        wide: build with AVX-512 vectors where this CPU has them (vector_flags); the
            variable ATTNLAB_VECTORS=avx2 keeps the AVX2 build (to test it).

    Returns:
        None once it is loaded, else the one-line reason it is not; a failure is also
        warned (RuntimeWarning) in one line naming ATTNLAB_NO_EXTENSION=1.
    """
    if os.environ.get(OFF_VARIABLE) == "1":
        return f"turned off by {OFF_VARIABLE}=1"
    reason = _missing() or _build_and_load(base, source, what, _wide(wide))
    if reason is None:
        fake_ops.register()  # its ops' fake kernels, for torch.compile and export
    else:
        warnings.warn(
            f"{what} is unavailable: {reason}; using {fallback} ({_HOW_TO_SKIP})",
            RuntimeWarning,
            stacklevel=4,
        )
    return reason


def _wide(wide: bool) -> bool:
    """Whether a build asked for `wide` gets it: not when ATTNLAB_VECTORS=avx2."""
    return wide and os.environ.get(VECTORS_VARIABLE) != "avx2"


def name_for(base: str, source: Path, *, wide: bool = False) -> str:
    """The name `load` builds and loads the extension `base` of `source` under (`wide` as
    load's): the same in every process of one environment, builds before it included."""
    return extension_name(base, source, cflags(_wide(wide)), LDFLAGS)


def _missing() -> str | None:
    """What the build needs and this machine lacks, before torch is asked to build."""
    if platform.system() == "Darwin":
        return _MACOS
    compiler = cxx()
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; install g++ or set CXX)"
    put_ninja_on_path()
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja)"
    return None


# base name -> the shared library loaded for it (python_module imports its Python face)
_LOADED: dict[str, Path] = {}


def is_loaded(base: str) -> bool:
    """Whether `load` has loaded the extension `base` in this process (never builds)."""
    return base in _LOADED


def python_module(base: str) -> ModuleType:
    """The Python module of the loaded extension `base` (its PYBIND11_MODULE: functions
    bound directly, without torch.ops' schema parsing), imported from the library `load`
    loaded; `load` must have succeeded first."""
    path = _LOADED[base]
    name = path.stem
    module = sys.modules.get(name)
    if module is None:
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        sys.modules[name] = module
    return module


def _build_and_load(base: str, source: Path, what: str, wide: bool) -> str | None:
    flags = cflags(wide)
    name = extension_name(base, source, flags, LDFLAGS)
    try:
        folder = build_directory(name)
    except OSError as error:  # TORCH_EXTENSIONS_DIR cannot hold a folder for it
        return f"its build folder cannot be made: {error}"
    built = folder / f"{name}.so"
    if _finished(built) and _load_library(built):
        _LOADED[base] = built
        return None
    print(f"attnlab: building {what} for this environment (once) ...", end="", file=sys.stderr)
    sys.stderr.flush()
    start = time.perf_counter()
    with _only_builder(folder):
        by_another = _finished(built) and _load_library(built)  # built while this one waited
        reason = None if by_another else _compile(name, source, flags)
        if reason is None and not by_another:
            _mark_finished(built)
    if reason is not None:
        print(" failed", file=sys.stderr)
        return reason
    took = f"{time.perf_counter() - start:.1f} s"
    print(f" built by another process ({took})" if by_another else f" {took}", file=sys.stderr)
    _LOADED[base] = built
    return None


# Beside a library that a build finished and loaded: its size and modification time. A build
# killed while it links can leave a library that loads wrongly or crashes the process when it
# is mapped; one that does not match this record is built again, never loaded.
FINISHED = "attnlab-finished"


def _stamp(library: Path) -> str:
    status = library.stat()
    return f"{status.st_size} {status.st_mtime_ns}"


def _finished(library: Path) -> bool:
    """Whether `library` is the one a build finished (FINISHED beside it records it)."""
    try:
        return (library.parent / FINISHED).read_text() == _stamp(library)
    except OSError:
        return False


def _mark_finished(library: Path) -> None:
    """Record `library` as finished (a folder that cannot take the record: built again)."""
    with contextlib.suppress(OSError):
        (library.parent / FINISHED).write_text(_stamp(library))


def _compile(name: str, source: Path, flags: Sequence[str]) -> str | None:
    """cpp_extension's build and load of `source` as `name`: None, or the one-line reason
    it failed (a compile, link or load error)."""
    from torch.utils import cpp_extension

    try:
        with warnings.catch_warnings():  # torch's compiler checks: the error says enough
            warnings.simplefilter("ignore")
            cpp_extension.load(  # copies: load appends to the lists it is given
                name=name,
                sources=[str(source)],
                extra_cflags=list(flags),
                extra_ldflags=list(LDFLAGS),
                is_python_module=False,
            )
    except Exception as error:
        return first_error(error)
    return None


# The file each build holds an OS lock on (flock) in its build folder, beside cpp_extension's
# own `lock`. cpp_extension's lock is a file that exists while a build runs, and a build that
# is killed (SIGTERM, SIGKILL, a time limit) leaves it behind: every later process waits for it
# forever. The OS lock goes with its process, so a process that holds it knows that no attnlab
# process is building there. Only the ninja and compiler a killed build started may still run
# (they outlive a Python process killed alone); they work in the folder, and are waited for.
BUILDER_LOCK = "attnlab-builder.lock"


@contextlib.contextmanager
def _only_builder(folder: Path):
    """Hold the build folder's OS lock for the block, waiting (and saying so) while another
    process holds it, and clear what a killed build left (_clear_stopped_build). Where there
    is no OS lock (no fcntl, as on Windows; a lock file this process cannot open; a file
    system without locks): _wait_for_lock, and cpp_extension says what else is wrong."""
    handle = _locked(folder / BUILDER_LOCK)
    if handle is None:
        _wait_for_lock(folder / "lock")
        yield
        return
    with handle:  # closing the file releases its lock
        _clear_stopped_build(folder)
        yield


def _locked(path: Path):
    """`path` opened and locked (flock, exclusive), after waiting for whoever holds it; None
    where it cannot be."""
    if fcntl is None:
        return None
    try:  # (build_directory made the folder)
        handle = open(path, "a")  # noqa: SIM115 (held by the caller's block)
    except OSError:
        return None
    try:
        if not _try_lock(handle):
            print(" (waiting for another process's build)", end="", file=sys.stderr)
            sys.stderr.flush()
            fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError:
        handle.close()
        return None
    except BaseException:  # interrupted while waiting (Ctrl-C): end the build's line
        handle.close()
        print(file=sys.stderr)
        raise
    return handle


def _try_lock(handle) -> bool:
    """flock(handle) without waiting: whether it is now held."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _clear_stopped_build(folder: Path) -> None:
    """With the builder lock held: wait while a killed build's ninja or compiler still works
    in `folder` (at most STALE_LOCK_SECONDS), then remove cpp_extension's lock file, which
    no running build holds, saying both in the build's line."""
    lock = folder / "lock"
    if not lock.exists():
        return
    deadline = time.time() + STALE_LOCK_SECONDS
    working = _working_in(folder)
    if working:
        print(f" (waiting for processes {working} in {folder})", end="", file=sys.stderr)
        sys.stderr.flush()
    while working and time.time() < deadline:
        time.sleep(0.5)
        working = _working_in(folder)
    print(f" (removed the lock of a build that was stopped, {lock})", end="", file=sys.stderr)
    lock.unlink(missing_ok=True)


def _working_in(folder: Path) -> list[int]:
    """The processes other than this one whose working directory is `folder` (as ninja's
    and its compilers' are in a build folder): Linux's /proc; elsewhere none are known."""
    target = os.path.realpath(folder)
    working = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        pid = int(cwd.parent.name)
        with contextlib.suppress(OSError):  # gone, or another user's
            if pid != os.getpid() and os.readlink(cwd) == target:
                working.append(pid)
    return working


# where there is no OS lock: a build takes 1 to 2 minutes on a 2-core machine, so a lock
# older than this is a killed build's (torch's FileBaton would wait for it forever)
STALE_LOCK_SECONDS = 600.0


def _wait_for_lock(lock: Path) -> None:
    """Where there is no OS lock (_only_builder): wait while another process builds into
    this folder (its lock file), and remove a lock older than STALE_LOCK_SECONDS, which a
    killed build left behind."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS:
            print(f" (removed a stale lock of {age:.0f} s, {lock})", end="", file=sys.stderr)
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


def _load_library(path: Path) -> bool:
    """Load a finished build (_finished) directly (no compiler check, no ninja); False if
    it fails."""
    try:
        torch.ops.load_library(str(path))
    except OSError:  # a library of another torch, say: let cpp_extension build it again
        return False
    return True


def first_error(error: Exception) -> str:
    """The one line of a failed build that says what went wrong: the compiler's or the
    linker's first error, else the last line of the message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        lowered = line.lower()
        if "error:" in lowered or "undefined symbol" in lowered or "undefined reference" in lowered:
            return f"{type(error).__name__}: {line[:300]}"
    last = lines[-1] if lines else "no message"
    return f"{type(error).__name__}: {last[:300]}"


def put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the ninja package (a dependency) installs it
    beside the interpreter, which is not on PATH when a venv is used without activation."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
