"""How far a narrower KV cache (bfloat16, int8) moves decoding from the float32 cache: the
attention output's absolute error over random and realistic inputs, and the greedy tokens of
a small random-init language model.

Run: python -m attnlab.bench.cache_error (about a minute on 2 cores).

"Realistic" inputs are what a layer of a trained model tends to see: a smooth sequence
(neighbouring tokens alike), layer-normed, with a few outlier channels 20x larger than the
rest (the massive activations of LLMs), which set each token's int8 scale.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from attnlab.attention import MultiHeadAttention

DTYPES = (torch.bfloat16, torch.int8)


def inputs(kind: str, batch: int, tokens: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """(batch, tokens, d) inputs: "random" N(0, 1), or "realistic" (module docstring)."""
    x = torch.randn(batch, tokens, d, generator=generator)
    if kind == "random":
        return x
    smooth = torch.cumsum(x, dim=1) / torch.arange(1, tokens + 1).sqrt()[:, None]  # (b, t, d)
    normed = nn.functional.layer_norm(smooth + 0.5 * x, (d,))
    outliers = torch.randperm(d, generator=generator)[:4]
    normed[..., outliers] *= 20.0
    return normed


def attention_errors(
    *, d_model: int = 768, num_heads: int = 12, context: int = 1024, steps: int = 64
) -> list[dict]:
    """Per head layout, input kind and cache dtype: max and mean absolute error of `steps`
    decoded outputs after a prompt of context - steps tokens, against the float32 cache, and
    the mean absolute output for scale."""
    rows = []
    for num_kv_heads in (num_heads, num_heads // 3, 1):
        torch.manual_seed(0)
        module = MultiHeadAttention(
            d_model, d_model, context, 0.0, num_heads, num_kv_heads=num_kv_heads, rope=True
        ).eval()
        for kind in ("random", "realistic"):
            x = inputs(kind, 1, context, d_model, torch.Generator().manual_seed(1))
            reference = _decode(module, x, torch.float32, steps)
            for dtype in DTYPES:
                error = (_decode(module, x, dtype, steps) - reference).abs()
                rows.append(
                    {
                        "num_kv_heads": num_kv_heads,
                        "inputs": kind,
                        "cache_dtype": str(dtype).removeprefix("torch."),
                        "max_abs_error": error.max().item(),
                        "mean_abs_error": error.mean().item(),
                        "mean_abs_output": reference.abs().mean().item(),
                    }
                )
    return rows


def _decode(module: MultiHeadAttention, x: torch.Tensor, dtype: torch.dtype, steps: int):
    """The last `steps` tokens decoded one by one after a prefill of the others."""
    cache = module.make_cache(x.shape[0], dtype=dtype)
    prompt = x.shape[1] - steps
    with torch.no_grad():
        module(x[:, :prompt], cache=cache)
        outputs = [module(x[:, t : t + 1], cache=cache) for t in range(prompt, x.shape[1])]
    return torch.cat(outputs, dim=1)  # (b, steps, d)


class TinyLM(nn.Module):
    """A random-init pre-norm transformer: embeddings, `layers` blocks of rotary grouped-query
    attention and an MLP, a tied vocabulary head."""

    def __init__(self, vocab: int = 512, d: int = 256, layers: int = 4, heads: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(2 * layers))
        self.attn = nn.ModuleList(
            MultiHeadAttention(d, d, 256, 0.0, heads, num_kv_heads=heads // 4, rope=True)
            for _ in range(layers)
        )
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            for _ in range(layers)
        )

    def forward(self, ids: torch.Tensor, caches: list) -> torch.Tensor:
        h = self.embed(ids)  # (b, t, d)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp, strict=True)):
            h = h + attn(self.norms[2 * i](h), cache=caches[i])
            h = h + mlp(self.norms[2 * i + 1](h))
        return h @ self.embed.weight.T  # (b, t, vocab)


def greedy_agreement(*, prompts: int = 8, prompt_tokens: int = 16, steps: int = 64) -> list[dict]:
    """Greedy generation of `steps` tokens from `prompts` random prompts with each cache
    dtype: how many prompts generate exactly the float32 cache's tokens, and the tokens
    that differ (from the first divergence on, the sequences differ as a whole)."""
    torch.manual_seed(0)
    model = TinyLM().eval()
    ids = torch.randint(
        0, 512, (prompts, prompt_tokens), generator=torch.Generator().manual_seed(2)
    )
    reference = _generate(model, ids, torch.float32, steps)
    rows = []
    for dtype in DTYPES:
        tokens = _generate(model, ids, dtype, steps)
        same = (tokens == reference).all(dim=1)
        first = [
            int((row != ref).nonzero()[0])
            for row, ref, s in zip(tokens, reference, same, strict=True)
            if not s
        ]
        rows.append(
            {
                "cache_dtype": str(dtype).removeprefix("torch."),
                "prompts": prompts,
                "steps": steps,
                "identical_prompts": int(same.sum()),
                "tokens_differing": int((tokens != reference).sum()),
                "first_divergence": first,
            }
        )
    return rows


def _generate(model: TinyLM, ids: torch.Tensor, dtype: torch.dtype, steps: int) -> torch.Tensor:
    caches = [attn.make_cache(ids.shape[0], dtype=dtype) for attn in model.attn]
    out = []
    with torch.no_grad():
        logits = model(ids, caches)
        for _ in range(steps):
            next_id = logits[:, -1:].argmax(-1)  # (b, 1)
            out.append(next_id)
            logits = model(next_id, caches)
    return torch.cat(out, dim=1)  # (b, steps)


def main(argv: list[str] | None = None) -> None:
    """Print both tables (markdown). Takes no arguments but --help (argv: sys.argv[1:] by
    default); any other is refused before anything runs."""
    argparse.ArgumentParser(
        prog="python -m attnlab.bench.cache_error",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    print("| kv heads | inputs | cache | max abs error | mean abs error | mean abs output |")
    print("|---:|---|---|---:|---:|---:|")
    for r in attention_errors():
        print(
            f"| {r['num_kv_heads']} | {r['inputs']} | {r['cache_dtype']} | "
            f"{r['max_abs_error']:.2e} | {r['mean_abs_error']:.2e} | {r['mean_abs_output']:.2e} |"
        )
    print("\n| cache | prompts identical over 64 steps | tokens differing | first divergence |")
    print("|---|---:|---:|---|")
    for r in greedy_agreement():
        print(
            f"| {r['cache_dtype']} | {r['identical_prompts']} / {r['prompts']} | "
            f"{r['tokens_differing']} / {r['prompts'] * r['steps']} | {r['first_divergence']} |"
        )


if __name__ == "__main__":
    main()
