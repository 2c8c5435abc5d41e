"""Cached generation through the recipes' models against the originals' recomputing
generation: milliseconds per new token at three prompt lengths, for the book's GPT,
nanoGPT and the from-scratch Llama (examples/), each at the same mid-sized configuration
(d_model 256, 8 heads, 4 layers; the Llama with 2 key/value heads). Greedy ids are checked
identical before anything is timed.

Usage: python scripts/recipe_speedups.py [PROMPT,PROMPT,PROMPT] [NEW_TOKENS]
       (default 128,512,1024 and 32)
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.examples.test_recipes import load  # examples/ as modules

WIDTH, HEADS, LAYERS, CONTEXT = 256, 8, 4, 2048


def families():
    """(name, original model, swapped model, recompute(model, idx, new)) per recipe."""
    book, nano, llama = load("book_gpt"), load("nanogpt"), load("llama")
    torch.manual_seed(0)
    cfg = {**book.GPT_CONFIG_TINY, "emb_dim": WIDTH, "n_heads": HEADS, "n_layers": LAYERS}
    cfg["context_length"] = CONTEXT
    original = book.GPTModel(cfg).eval()
    yield (
        "book GPT",
        original,
        book.swapped_copy(original, cfg).eval(),
        (lambda m, idx, new: book.generate_text_simple(m, idx, new, CONTEXT)),
    )
    config = replace(nano.GPTConfig(), n_embd=WIDTH, n_head=HEADS, n_layer=LAYERS)
    config = replace(config, block_size=CONTEXT)
    original = nano.GPT(config).eval()
    yield (
        "nanoGPT",
        original,
        nano.swapped_copy(original).eval(),
        (lambda m, idx, new: m.generate(idx, new)),
    )
    cfg = {**llama.LLAMA_CONFIG_TINY, "emb_dim": WIDTH, "n_heads": HEADS, "n_layers": LAYERS}
    cfg.update(hidden_dim=4 * WIDTH, context_length=CONTEXT)
    original = llama.Llama(cfg).eval()
    yield (
        "Llama",
        original,
        llama.swapped_copy(original, cfg).eval(),
        (lambda m, idx, new: llama.generate(m, idx, new, CONTEXT)),
    )


def per_token(generate, model, idx: torch.Tensor, new: int) -> float:
    """Seconds per new token of generate(model, idx, new)."""
    start = time.perf_counter()
    generate(model, idx, new)
    return (time.perf_counter() - start) / new


def main(prompts: list[int], new: int) -> None:
    print(f"ms per new token, {new} new tokens, batch 1, {torch.get_num_threads()} threads")
    print("| model | prompt | recompute (original) | cached (attnlab) | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name, original, swapped, recompute in families():
        example = sys.modules[type(swapped).__module__]
        for prompt in prompts:
            idx = torch.randint(0, 96, (1, prompt), generator=torch.Generator().manual_seed(1))
            want = recompute(original, idx, new)
            if not torch.equal(example.generate_cached(swapped, idx, new), want):
                raise SystemExit(f"{name}: cached ids differ from recomputed at {prompt}")
            slow = per_token(recompute, original, idx, new)
            fast = per_token(example.generate_cached, swapped, idx, new)
            print(
                f"| {name} | {prompt} | {slow * 1e3:.2f} | {fast * 1e3:.2f} | {slow / fast:.1f}x |"
            )


if __name__ == "__main__":
    lengths = [int(n) for n in sys.argv[1].split(",")] if len(sys.argv) > 1 else [128, 512, 1024]
    main(lengths, int(sys.argv[2]) if len(sys.argv) > 2 else 32)
