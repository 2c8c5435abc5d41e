"""What a test reads of a subprocess's stderr, less torch's own log lines.

torch itself prints on stderr in some builds and places, whatever attnlab does: the CUDA
wheels (PyPI's default, also on a machine without a GPU) log "No CUDA runtime is found,
using CUDA_HOME=..." when torch.utils.cpp_extension is imported (attnlab's build machinery).
A test that asserts a subprocess printed nothing, or exactly one line, reads its stderr
through `without_torch_logs`.
"""

from __future__ import annotations

import re

# one pattern per line torch prints on its own, anchored at the line's start: a record of
# torch's own loggers, which torch formats as "W1126 08:05:38.917000 14272
# torch/utils/cpp_extension.py:183] No CUDA runtime is found, ..." (2.14), the file's path
# relative to the working directory when torch lives under it (CI's
# ".venv-newest/lib/python3.11/site-packages/torch/utils/..."), and the plain line older
# releases print
TORCH_LOG_LINES = (
    re.compile(r"[DIWEC]\d{4} \d{2}:\d{2}:\d{2}\.\d+\s+\d+\s+(?:\S*/)?torch/\S+:\d+\] "),
    re.compile(r"No CUDA runtime is found, using CUDA_HOME="),
)


def without_torch_logs(text: str) -> str:
    """`text` without the lines torch prints on its own (TORCH_LOG_LINES)."""
    kept = [
        line
        for line in text.splitlines(keepends=True)
        if not any(pattern.match(line) for pattern in TORCH_LOG_LINES)
    ]
    return "".join(kept)
