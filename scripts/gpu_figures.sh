#!/usr/bin/env bash
# The bench's CUDA figures on one GPU, bfloat16, in at most about 8.5 minutes: the module
# and core comparison, --decode (its tables, and the static-cache peers eager and compiled)
# and --hf (eager and compiled). --compile runs the eager rows too, beside the compiled
# ones. Each mode writes OUT/NAME.json and OUT/NAME.txt, and has a time limit: the JSON is
# rewritten as tables (--decode) and rows (--hf) finish, so a mode cut short keeps what it
# measured. OUT/machine.txt holds torch's version and the card's name.
# Usage: scripts/gpu_figures.sh [OUT]   (default gpu-figures/; run from the repository root
# with attnlab installed in .venv)
# Where attnlab is not installed but the card's python3 holds torch (as on this project's
# lent machines, 2026-11-27), with transformers' wheel carried in .whl/:
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/src
#   python3 scripts/gpu_checks.py > OUT/checks.txt 2>&1; PYTHON=python3 scripts/gpu_figures.sh OUT
# (about 9.5 minutes in all; the two together fill the 8 files such a machine sends back).
set -euo pipefail
out=${1:-gpu-figures}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
"$python" -c 'import sys, torch
print("torch", torch.__version__, "CUDA", torch.version.cuda)
torch.cuda.is_available() or sys.exit("gpu_figures.sh: no CUDA device is available to this torch")
print("card", torch.cuda.get_device_name())' | tee "$out/machine.txt"

run() {  # run NAME LIMIT_S OPTIONS...: one mode, its table to NAME.txt, figures to NAME.json
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== attnlab bench $* --device cuda --dtype bfloat16 (at most ${limit} s)" | tee "$out/$name.txt"
  COLUMNS=200 timeout "$limit" "$python" -m attnlab bench "$@" --device cuda --dtype bfloat16 \
    --json "$out/$name.json" 2>&1 | tee -a "$out/$name.txt" || echo "== $name failed or timed out"
  echo "== $name: $((SECONDS - start)) s" | tee -a "$out/$name.txt"
}

run compare 60
run decode 210 --decode --compile
run hf 240 --hf --compile
echo "figures under $out/ ($SECONDS s)"
