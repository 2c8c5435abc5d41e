"""examples/scale_out.py, the README's multi-process example, runs under torchrun on two
gloo processes and every rank matches single-process attention."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "scale_out.py"


def test_scale_out_example_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLE)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    # the two ranks share stdout, so their reports may land on one line: match them anywhere
    reports = re.findall(r"rank (\d)/2: ring ([0-9.e+-]+), heads 4: ([0-9.e+-]+)", done.stdout)
    assert sorted(rank for rank, _, _ in reports) == ["0", "1"], done.stdout
    assert all(float(ring) < 1e-4 and float(heads) < 1e-4 for _, ring, heads in reports)
