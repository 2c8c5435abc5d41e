"""Running the audit's steps on someone's code, guarded: anything the module raises
(SystemExit and KeyboardInterrupt included) becomes that step's finding, and an error in
attnlab's own code is reported as attnlab's, never as the module's.

A step is (name, title, run): run() returns the step's PropertyResult. Calls into the
audited code are wrapped in `user_code()`, which marks whatever they raise; a gradient's
backward is recognised from torch's autograd frames in the traceback.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from attnlab.check.report import PropertyResult, error, failed

Step = tuple[str, str, Callable[[], PropertyResult]]

_MARK = "_attnlab_check_from_module"
_ATTNLAB = Path(__file__).resolve().parents[1]
_AUTOGRAD = ("torch/autograd/", "torch\\autograd\\")


@contextlib.contextmanager
def user_code() -> Iterator[None]:
    """Marks anything raised inside as raised by the audited code, then lets it through."""
    try:
        yield
    except BaseException as raised:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(raised, _MARK, True)
        raise


def from_module(raised: BaseException, user_files: Iterable[str] = ()) -> bool:
    """True when `raised` came out of the audited code (marked, or raised in one of its
    files or in torch's autograd, which runs the module's backward)."""
    if getattr(raised, _MARK, False):
        return True
    files = {str(Path(f).resolve()) for f in user_files}
    for frame, _ in traceback.walk_tb(raised.__traceback__):
        name = frame.f_code.co_filename
        backward = frame.f_code.co_name == "backward" and name.endswith("_tensor.py")
        if backward or any(part in name for part in _AUTOGRAD):
            return True
        with contextlib.suppress(OSError, ValueError):
            if str(Path(name).resolve()) in files:
                return True
    return False


def run_step(step: Step, user_files: Iterable[str] = ()) -> PropertyResult:
    """The step's result; what it raises becomes a failed result (the module's doing) or
    an error result (attnlab's own bug). A KeyboardInterrupt or SystemExit that did not
    come from the module (someone pressed Ctrl-C) goes through."""
    name, title, run = step
    try:
        return run()
    except BaseException as raised:
        if from_module(raised, user_files):
            return module_raised(name, title, raised)
        if not isinstance(raised, Exception):
            raise
        return attnlab_bug(name, title, raised)


def module_raised(name: str, title: str, raised: BaseException) -> PropertyResult:
    """The finding for an exception (or SystemExit, KeyboardInterrupt) from the module."""
    observed = f"the module raised {describe(raised)}{_where(raised)}"
    causes = ["the forward (or its backward) fails on a valid input of this property"]
    if isinstance(raised, SystemExit | KeyboardInterrupt):
        causes = [f"the module's code raises {type(raised).__name__}: a module must never exit"]
    return failed(name, title, observed, causes)


def attnlab_bug(name: str, title: str, raised: BaseException) -> PropertyResult:
    """The result for an error in attnlab's own code: the audit could not run `name`."""
    frames = traceback.extract_tb(raised.__traceback__)
    mine = [f for f in frames if f.filename.startswith(str(_ATTNLAB))]
    where = f" at {Path(mine[-1].filename).name}:{mine[-1].lineno}" if mine else ""
    return error(name, title, f"attnlab's own bug{where}: {describe(raised)} (please report it)")


def describe(raised: BaseException) -> str:
    """'ValueError: first line of the message' (SystemExit shows its code)."""
    if isinstance(raised, SystemExit):
        return f"SystemExit({raised.code!r})"
    text = str(raised).strip()
    message = text.splitlines()[0][:200] if text else ""
    return f"{type(raised).__name__}: {message}" if message else type(raised).__name__


def _where(raised: BaseException) -> str:
    """' (file.py:12)': the innermost frame outside attnlab and torch, when there is one."""
    frames = [
        f
        for f in traceback.extract_tb(raised.__traceback__)
        if not f.filename.startswith(str(_ATTNLAB)) and "torch" not in Path(f.filename).parts
    ]
    return f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
