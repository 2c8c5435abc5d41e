"""Running ranks on one machine: a free loopback port for a process group's rendezvous,
and a clean exit for a spawned rank. Used by `attnlab bench --parallel`, the examples and
the tests alike."""

from __future__ import annotations

import os
import socket
import sys
from typing import NoReturn

import torch.distributed as dist


def exit_rank() -> NoReturn:
    """End a spawned rank whose work is done: destroy its process group, then exit without
    the interpreter's shutdown.

    A gloo worker thread may still drop the last reference to a Python-owned tensor while
    the interpreter finalises, which aborts the process ("terminate called without an
    active exception"; seen in about 1 run of 30 after PyTorch's functional collectives,
    never after exiting this way).
    """
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous.

    Returns:
        The port number.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
