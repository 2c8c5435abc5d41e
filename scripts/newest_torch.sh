#!/usr/bin/env bash
# The test suite against the newest torch pip installs here, beside CI's pinned one.
#
# A separate virtual environment (ATTNLAB_NEWEST_VENV, default /tmp/attnlab-newest) gets
# `pip install --upgrade torch` (or TORCH_SPEC, e.g. TORCH_SPEC='torch==2.15.0'), then attnlab
# itself with its extras, then runs pytest with the arguments given (none: the whole suite).
# pip resolves as it is set up on this machine: a constraints file in pip's configuration may
# cap torch (`pip config list` shows it). PyPI's default Linux wheel is the CUDA build, a
# few GB with its nvidia-* dependencies, which also runs (on the CPU) without a GPU.
#
# Usage: scripts/newest_torch.sh [pytest arguments...]
#   e.g. scripts/newest_torch.sh tests/test_flash_cpu.py -q -x
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${ATTNLAB_NEWEST_VENV:-/tmp/attnlab-newest}
spec=${TORCH_SPEC:-torch}

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# no copy of the multi-GB wheels in pip's cache
"$venv/bin/pip" install --quiet --no-cache-dir --upgrade "$spec"
# torch is installed first, so attnlab's requirement (torch>=2.13) keeps it
"$venv/bin/pip" install --quiet -e '.[test,hf,onnx,docs]'
version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
echo "newest_torch: testing with torch $version in $venv" >&2
exec "$venv/bin/python" -m pytest "$@"
