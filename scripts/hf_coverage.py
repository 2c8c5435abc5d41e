"""Regenerate docs/hf-coverage.md: every architecture of the installed transformers with a
text LM, speech-to-text, image classification or image-text head, built small with random
weights, attnlab against eager (attnlab.interop.coverage).

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

attnlab as `attn_implementation="attnlab"` against transformers' `"eager"`, for every
architecture of the installed transformers {version} (torch {torch}) with one of these heads
(from transformers' auto mappings; an architecture with several is compared with the first in
this order whose small model builds):

- **speech** (AutoModelForSpeechSeq2Seq: Whisper): `input_features` {batch} x {mel} mel bins x
  {frames} frames with decoder ids {batch} x {decoder}: logits; a left-padded decoder batch (real
  positions); encoder, decoder and cross `output_attentions`; greedy generation of {new}
  tokens with the cache.
- **image-text** (AutoModelForZeroShotImageClassification: CLIP, SigLIP): `input_ids` {batch} x
  {tokens} and `pixel_values` {batch} x 3 x {image} x {image}: `logits_per_image` with
  `text_embeds` and `image_embeds`; the same for a left-padded text batch; each tower's
  `output_attentions`.
- **seq2seq** (AutoModelForSeq2SeqLM: T5, BART): `input_ids` {batch} x {tokens}, decoder ids
  {batch} x {decoder}: logits; a left-padded encoder batch; encoder, decoder and cross
  `output_attentions`; greedy generation of {new} tokens with the cache.
- **masked** (AutoModelForMaskedLM, the encoder-only models: BERT, RoBERTa, ModernBERT):
  `input_ids` {batch} x {tokens}: logits; a left-padded batch (real positions);
  `output_attentions`.
- **causal** (AutoModelForCausalLM: GPT-2, Llama): `input_ids` {batch} x {tokens}: logits; a
  left-padded batch (real positions); greedy generation of {new} tokens with the cache from
  that batch; `output_attentions`.
- **image** (AutoModelForImageClassification: ViT, DINOv2): `pixel_values` {batch} x 3 x
  {image} x {image} (the config's size where it names one): logits; every layer's hidden
  states; `output_attentions`.

Each is built from its default config (a composite one, image-text's, has each sub-config)
shrunk to {layers} layers, width {hidden}, {heads} heads ({kv} key/value heads), vocabulary
{vocab}, patches of at most {patch} pixels, with random weights (the same in both, each model
from its own copy of the config, and each checked to run the implementation asked for).
Generated tokens must be equal, scores are compared; attention weights on real query rows.

Status: **equal** (every comparison within {tol:g}); **not called** (outputs equal, but
attnlab was never called: no attention on transformers' interface, a convolutional network
say); **refused** (attnlab raises its own ValueError, at build time or the first forward, with
the reason shown); **differs** (out of tolerance, or the model built with attnlab runs another
implementation); **error** (attnlab raised something else, or the reference does not run
eager); **cannot build** (the small config, its inputs or the eager model itself fail: not
attnlab's to judge).

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
    parser.add_argument("model_types", nargs="*", help="default: every architecture")
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
            f"{model_type} [{row.kind}]: {row.status} {row.detail} "
            f"({time.perf_counter() - began:.1f}s)",
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
        decoder=coverage.DECODER_TOKENS,
        mel=coverage.MEL_BINS,
        frames=2 * coverage.SOURCE_POSITIONS,
        image=coverage.IMAGE,
        patch=coverage.PATCH,
        tol=coverage.TOLERANCE,
        seconds=time.perf_counter() - start,
        summary=summary,
    )
    args.out.write_text(header + coverage.table(rows))
    print(summary, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
