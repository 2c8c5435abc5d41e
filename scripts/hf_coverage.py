"""Regenerate docs/hf-coverage.md: every text architecture of the installed transformers,
built small with random weights, attnlab against eager (attnlab.interop.coverage).

    nice .venv/bin/python scripts/hf_coverage.py [--out docs/hf-coverage.md] [model_type ...]

Takes minutes (hundreds of architectures); progress goes to stderr, one line each.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

from attnlab.interop import coverage

HEADER = """# Hugging Face coverage

attnlab as `attn_implementation="attnlab"` against transformers' `"eager"`, for every text
architecture (causal, seq2seq or masked LM head) of the installed transformers
{version} (torch {torch}). Each is built from its default config shrunk to {layers} layers,
width {hidden}, {heads} heads ({kv} key/value heads), vocabulary {vocab}, with random
weights (the same in both), and compared on: logits; a left-padded batch of {batch} x
{tokens} tokens (real positions); greedy generation of {new} tokens with the cache from that
batch (tokens must be equal; scores compared); and `output_attentions` (real query rows).

Status: **equal** (every comparison within {tol:g}); **refused** (attnlab raises its own
ValueError, at build time or the first forward, with the reason shown); **differs** (out of
tolerance, or attnlab never called); **error** (attnlab raised something else);
**cannot build** (the small config or the eager model itself fails: not attnlab's to judge).

Regenerate with `nice .venv/bin/python scripts/hf_coverage.py` ({seconds:.0f} s for this run).

Attention sinks have two conventions for the weights `output_attentions` returns. gpt-oss's
and DeepSeek-V4's eager return the weights the output is computed with (each row's sink share
removed, so rows sum to less than 1); GraniteSWA's eager returns the softmax before it scales
the output by the sink (rows sum to 1, and weights @ values is not the output). attnlab
returns the first kind for every model, so where the second kind is used, the attentions
row differs while logits, padding and generation are equal.

Summary: {summary}.

"""


def main(argv: list[str] | None = None) -> int:
    """Compare the architectures and write the markdown table; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="default: every text architecture")
    parser.add_argument("--out", type=Path, default=Path("docs/hf-coverage.md"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = []
    for model_type in args.model_types or coverage.architectures():
        began = time.perf_counter()
        rows.append(coverage.compare(model_type))
        row = rows[-1]
        print(
            f"{model_type}: {row.status} {row.detail} ({time.perf_counter() - began:.1f}s)",
            file=sys.stderr,
            flush=True,
        )
    counts = collections.Counter(row.status for row in rows)
    summary = ", ".join(f"{n} {status}" for status, n in counts.most_common())
    header = HEADER.format(
        version=transformers.__version__,
        torch=torch.__version__,
        layers=coverage.LAYERS,
        hidden=coverage.HIDDEN,
        heads=coverage.HEADS,
        kv=coverage.KV_HEADS,
        vocab=coverage.VOCAB,
        batch=coverage.BATCH,
        tokens=coverage.TOKENS,
        new=coverage.NEW_TOKENS,
        tol=coverage.TOLERANCE,
        seconds=time.perf_counter() - start,
        summary=summary,
    )
    args.out.write_text(header + coverage.table(rows))
    print(summary, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
