"""Seconds per `attnlab check` run, child start-up included, on the modern families and
forms the tests audit (tests/check/modern.py, forms.py, forms_hf.py): each target once,
then the median and the slowest.

Usage: python scripts/check_timings.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHECK = Path(__file__).resolve().parents[1] / "tests" / "check"
LLAMA = {
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 64,
    "max_position_embeddings": 16,
}  # fmt: skip
MINGPT = {"n_embd": 32, "n_head": 4, "block_size": 16, "attn_pdrop": 0.0, "resid_pdrop": 0.0}
TARGETS = [
    ("modern.py:MHAPyTorchClass", {}),
    ("modern.py:MHAPyTorchClass", {"qkv_bias": True}),
    ("modern.py:LlamaStyleAttention", {}),
    ("modern.py:LlamaStyleAttention", {"scale_bug": True}),
    ("modern.py:LlamaStyleAttention", {"rotate_bug": True}),
    ("modern.py:NeoXStyleAttention", {}),
    ("modern.py:NeoXStyleAttention", {"mask_bug": True}),
    ("modern.py:GPTJStyleAttention", {}),
    ("modern.py:GPTJStyleAttention", {"scale_bug": True}),
    ("modern.py:MetaLlamaStyleAttention", {}),
    ("modern.py:MetaLlamaStyleAttention", {"merge_bug": True}),
    ("forms.py:MetaAttention", {}),
    ("forms.py:MetaAttention", {"scale_bug": True}),
    ("forms.py:FastAttention", {}),
    ("forms.py:FastAttention", {"merge_bug": True}),
    ("forms.py:MinGPTSelfAttention", MINGPT),
    ("forms_hf.py:LlamaAttention", LLAMA),
    ("forms_hf.py:GPT2Attention", {"n_embd": 32, "n_head": 4, "n_positions": 16}),
    ("forms_hf.py:Gemma2Attention", {**LLAMA, "head_dim": 8}),
    ("forms_parallel.py:ParallelAttention", {}),
]


def main() -> None:
    seconds = []
    print("| target | --init | exit | seconds |")
    print("|---|---|---:|---:|")
    for target, init in TARGETS:
        command = [sys.executable, "-m", "attnlab", "check", f"{CHECK / target}"]
        command += ["--init", json.dumps(init), "--json"]
        start = time.perf_counter()
        code = subprocess.run(command, capture_output=True).returncode
        seconds.append(time.perf_counter() - start)
        print(f"| {target} | `{json.dumps(init)}` | {code} | {seconds[-1]:.1f} |")
    print(f"median {statistics.median(seconds):.1f} s, slowest {max(seconds):.1f} s")


if __name__ == "__main__":
    main()
