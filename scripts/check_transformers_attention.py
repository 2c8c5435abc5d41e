"""`attnlab check` on the attention classes of the installed transformers, as a user runs it:
`attnlab check .../modeling_X.py:XAttention --init CONFIG` with no adapter. Each class is
built from a small config of its model type; the table (exit code, the reference property,
seconds per audit, child start-up included) feeds docs/guide/check.md.

Usage: python scripts/check_transformers_attention.py [MODEL_TYPE ...]
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import time

SMALL = {
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 64,
    "max_position_embeddings": 16,
}  # fmt: skip
# (model type, attention class, extra config, extra check options)
CLASSES = [
    ("llama", "LlamaAttention", {}, []),
    ("mistral", "MistralAttention", {}, []),
    ("mixtral", "MixtralAttention", {}, []),
    ("qwen2", "Qwen2Attention", {}, []),
    ("qwen3", "Qwen3Attention", {}, []),
    ("gemma", "GemmaAttention", {"head_dim": 8}, []),
    ("gemma2", "Gemma2Attention", {"head_dim": 8}, []),
    ("granite", "GraniteAttention", {}, []),
    ("phi3", "Phi3Attention", {}, []),
    ("phi", "PhiAttention", {}, []),
    ("olmo", "OlmoAttention", {}, []),
    ("olmo2", "Olmo2Attention", {}, []),
    ("glm", "GlmAttention", {"head_dim": 8}, []),
    ("stablelm", "StableLmAttention", {}, []),
    ("starcoder2", "Starcoder2Attention", {}, []),
    ("cohere", "CohereAttention", {}, []),
    ("gpt_neox", "GPTNeoXAttention", {}, []),
    ("gptj", "GPTJAttention", {"rotary_dim": 4}, []),
    ("gpt2", "GPT2Attention", {}, []),
    ("opt", "OPTAttention", {"ffn_dim": 64}, []),
    ("falcon", "FalconAttention", {}, []),
    ("bert", "BertSelfAttention", {}, ["--no-causal"]),
]


def audit(model_type: str, name: str, extra: dict, options: list[str]) -> str:
    """One markdown row: the class, exit code, the reference's status and words, seconds."""
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    target = f"{inspect.getfile(modeling)}:{name}"
    command = [sys.executable, "-m", "attnlab", "check", target, "--json"]
    command += ["--init", json.dumps({**SMALL, **extra}), *options]
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    try:
        results = {r["name"]: r for r in json.loads(run.stdout)["results"]}
        reference = results["reference"]
        said = f"{reference['status']}: {reference['observed']}"
        failing = [
            f"{n} ({r['status']})"
            for n, r in results.items()
            if r["status"] not in ("passed", "skipped")
        ]
    except (json.JSONDecodeError, KeyError):
        said, failing = (run.stderr.strip().splitlines() or ["no output"])[-1], ["?"]
    failing_words = ", ".join(failing) or "none"
    return f"| {name} | {run.returncode} | {failing_words} | {said} | {seconds:.1f} |"


def main() -> None:
    import transformers

    chosen = set(sys.argv[1:])
    print(f"transformers {transformers.__version__}\n")
    print("| class | exit | not passed | reference | seconds |")
    print("|---|---:|---|---|---:|")
    for model_type, name, extra, options in CLASSES:
        if not chosen or model_type in chosen:
            print(audit(model_type, name, extra, options), flush=True)


if __name__ == "__main__":
    main()
