"""transformers models through attn_implementation="attnlab" against "sdpa", side by side:
GPT-2 small's shape (12 layers, d_model 768, 12 heads) and a Llama of the same size with 4
key/value heads, random weights, at (batch, tokens) = (1, 512) by default. Forward under
no_grad and forward + backward, median ms of interleaved rounds (the two implementations
alternate, so a neighbour's load falls on both), after one warm-up each; the outputs are
checked equal before anything is timed.

Usage: python scripts/hf_speed.py [BATCH TOKENS ROUNDS]   (default 1 512 7)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def models() -> dict[str, object]:
    """Configs by name: GPT-2 small and a Llama of its size (grouped heads)."""
    from transformers import GPT2Config, LlamaConfig

    return {
        "GPT-2 small": GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
        "Llama, 768 wide, 12 layers, 12/4 heads": LlamaConfig(
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=1024,
        ),
    }


def timed(model, ids: torch.Tensor, backward: bool) -> float:
    """Seconds of one call (forward, or forward + backward of the logits' sum)."""
    start = time.perf_counter()
    if backward:
        model(ids).logits.sum().backward()
    else:
        with torch.no_grad():
            model(ids)
    return time.perf_counter() - start


def compare(name: str, config, batch: int, tokens: int, rounds: int) -> None:
    from transformers import AutoModelForCausalLM

    import attnlab.interop.hf as hf

    hf.register()
    torch.manual_seed(0)
    built = {}
    for implementation in ("sdpa", "attnlab"):
        torch.manual_seed(0)
        built[implementation] = AutoModelForCausalLM.from_config(
            config, attn_implementation=implementation
        ).train(False)
    ids = torch.randint(0, config.vocab_size, (batch, tokens))  # (b, t)
    with torch.no_grad():
        expected = built["sdpa"](ids).logits
        torch.testing.assert_close(built["attnlab"](ids).logits, expected, atol=2e-4, rtol=2e-4)
    for backward in (False, True):
        times = {implementation: [] for implementation in built}
        for model in built.values():
            timed(model, ids, backward)  # warm-up
        for _ in range(rounds):
            for implementation, model in built.items():
                model.zero_grad(set_to_none=True)
                times[implementation].append(timed(model, ids, backward))
        sdpa, ours = (statistics.median(times[i]) * 1e3 for i in ("sdpa", "attnlab"))
        mode = "forward + backward" if backward else "forward"
        print(f"| {name} | {mode} | {sdpa:.1f} | {ours:.1f} | {ours / sdpa:.2f} |", flush=True)


def main() -> None:
    batch, tokens, rounds = (int(a) for a in (sys.argv[1:] or ["1", "512", "7"]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ({batch}, {tokens})\n")
    print("| model | mode | sdpa ms | attnlab ms | attnlab / sdpa |")
    print("|---|---|---:|---:|---:|")
    for name, config in models().items():
        compare(name, config, batch, tokens, rounds)


if __name__ == "__main__":
    main()
