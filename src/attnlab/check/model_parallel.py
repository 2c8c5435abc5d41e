"""Model-parallel layers on one process: what `attnlab check` sets up before building a
module whose file imported fairscale's model parallelism (Meta's Llama reference builds
`ColumnParallelLinear`/`RowParallelLinear` and divides its heads by
`fs_init.get_model_parallel_world_size()`, which asserts that a group exists).

The audit runs in its own child process, so the group it makes (a one-process gloo group
on an in-memory store: no port, no network) is gone with the child. With a world of one,
the parallel layers compute what a plain Linear of their weights computes.
"""

from __future__ import annotations

import contextlib
import os
import sys

_FAIRSCALE = "fairscale.nn.model_parallel.initialize"


def prepare() -> str | None:
    """Make a one-process model-parallel group when the imported file needs one.

    Returns:
        What was set up, in words, or None when nothing was needed (fairscale not
        imported by the file, or its group already initialised).
    """
    initialize = sys.modules.get(_FAIRSCALE)
    if initialize is None or initialize.model_parallel_is_initialized():
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        initialize.initialize_model_parallel(1)  # prints its sizes: not the audit's output
    return "fairscale's model-parallel group made on this one process (world size 1)"
