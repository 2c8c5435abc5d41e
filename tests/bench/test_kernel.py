"""attnlab bench --kernel: the candidates compute the same attention, and the command writes
a row per length, head layout and mode."""

import json

import torch

from attnlab.bench import kernel
from attnlab.cli import main


def test_the_candidates_compute_the_same_attention():
    for kv_heads in kernel.KERNEL_KV_HEADS:
        q, k, v = kernel._qkv(40, kv_heads)
        outs = [kernel._attend(name, kv_heads)(q, k, v) for name in kernel.CANDIDATES]
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)


def test_the_command_writes_every_row(tmp_path, capsys):
    path = tmp_path / "kernel.json"
    assert main(["bench", "--kernel", "--quick", "--json", str(path)]) == 0
    figures = json.loads(path.read_text())
    shapes = {(row["tokens"], row["kv_heads"], row["mode"]) for row in figures["rows"]}
    lengths = kernel.QUICK_KERNEL["lengths"]
    modes = (kernel.FORWARD, kernel.BACKWARD)
    assert shapes == {(t, h, m) for t in lengths for h in kernel.KERNEL_KV_HEADS for m in modes}
    assert all(row["speedup"] > 0 and row["auto_over_best"] > 0 for row in figures["rows"])
    assert "causal kernel against SDPA" in capsys.readouterr().out
