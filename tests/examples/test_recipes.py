"""The recipes (examples/book_gpt.py, nanogpt.py, llama.py; the book's Llama 3.2 and its
SDPA variant, llama32.py; Qwen3, qwen3.py; Gemma 3, gemma3.py; the book's GPT with
multi-head latent attention, mla.py), run as the docs show them:
each swapped model equals the original with the same weights in eval and in training
(dropout included: the same masks from the same seed), its cached generation equals the
original's recomputing generation (greedy ids), a left-padded batch decodes each row as it
decodes alone, and the way back gives the original class with the same outputs."""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from attnlab import MultiHeadAttention, MultiHeadLatentAttention
from attnlab.interop import make_caches as make_attention_caches

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str):
    """examples/<name>.py as a module (registered, so that its dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location(
        f"attnlab_example_{name}", EXAMPLES / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Family:
    """How the tests drive one example: build the original with a dropout, swap, restore,
    logits of the full sequence, and the original's recomputing greedy generation."""

    example: Any
    config: Any
    model: str = ""  # the from-scratch Llama-style model's class in the example

    def original(self, dropout: float = 0.0):
        ex = self.example
        if hasattr(ex, "GPTConfig"):
            return ex.GPT(replace(self.config, dropout=dropout))
        if hasattr(ex, "GPT_CONFIG_TINY"):
            return ex.GPTModel({**self.config, "drop_rate": dropout})
        model = getattr(ex, self.model)(self.config)
        with torch.no_grad():  # trained norms: not the ones (or zeros) they start at
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.add_(0.2 * torch.randn_like(parameter))
        return model

    @property
    def layers(self) -> int:
        """The attention layers of the configuration."""
        if hasattr(self.example, "GPTConfig"):
            return self.config.n_layer
        return self.config["n_layers"]

    def swapped(self, original):
        ex = self.example
        return ex.swapped_copy(original) if hasattr(ex, "GPTConfig") else ex.swapped_copy(
            original, self._config_of(original)
        )  # fmt: skip

    def restored(self, model):
        ex = self.example
        if hasattr(ex, "GPTConfig"):
            return ex.restored_copy(model)
        return ex.restored_copy(model, self._config_of(model))

    def _config_of(self, model):
        if hasattr(self.example, "GPT_CONFIG_TINY"):
            dropout = model.drop_emb.p
            return {**self.config, "drop_rate": dropout}
        return self.config

    def logits(self, model, idx):
        if hasattr(self.example, "GPTConfig"):
            return model(idx, torch.roll(idx, -1, dims=1))[0]  # every position's logits
        return model(idx)

    def recompute(self, model, idx, new):
        ex = self.example
        if hasattr(ex, "generate_text_simple_cached"):  # the book's MLA file
            return ex.generate_text_simple_cached(model, idx, new, use_cache=False)
        if hasattr(ex, "GPTConfig"):
            return model.generate(idx, new)
        if hasattr(ex, "GPT_CONFIG_TINY"):
            return ex.generate_text_simple(model, idx, new, self.config["context_length"])
        return ex.generate(model, idx, new, self.config["context_length"])


# each family: (example file, its tiny configuration, the model class of a Llama-style one)
FAMILIES = {
    "book_gpt": ("book_gpt", "GPT_CONFIG_TINY", ""),
    "nanogpt": ("nanogpt", "", ""),
    "llama": ("llama", "LLAMA_CONFIG_TINY", "Llama"),
    "llama32": ("llama32", "LLAMA32_CONFIG_TINY", "Llama3Model"),
    "llama32_fast": ("llama32", "LLAMA32_CONFIG_TINY", "Llama3ModelFast"),
    "qwen3": ("qwen3", "QWEN3_CONFIG_TINY", "Qwen3Model"),
    "gemma3": ("gemma3", "GEMMA3_CONFIG_TINY", "Gemma3Model"),
    "mla": ("mla", "MLA_CONFIG_TINY", "GPTModel"),
}


def _family(name: str) -> Family:
    file, config, model = FAMILIES[name]
    ex = load(file)
    return Family(ex, getattr(ex, config) if config else ex.GPTConfig(), model)


NAMES = list(FAMILIES)
FILES = sorted({file for file, _, _ in FAMILIES.values()})
DROPOUTS = {name: [0.0] for name in NAMES}  # the Llama-style models have no dropout
DROPOUTS |= {"book_gpt": [0.0, 0.1], "nanogpt": [0.0, 0.1]}


@pytest.fixture(scope="module", params=NAMES)
def family(request) -> Family:
    return _family(request.param)


def _pair(family: Family, dropout: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    original = family.original(dropout)
    return original, family.swapped(original)


def make_caches(model, batch_size, max_tokens=None):
    """One cache per attention layer: LatentCaches for the MLA recipe, KVCaches for the
    others (attnlab.interop.make_caches)."""
    layers = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
    if layers:
        return [layer.make_cache(batch_size, max_tokens) for layer in layers]
    return make_attention_caches(model, batch_size, max_tokens)


def _tokens(family, batch=2, tokens=12, seed=1):
    vocab = 96  # every tiny configuration's
    return torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def test_the_swap_puts_attnlab_in_every_layer(family):
    original, model = _pair(family)
    ours = (MultiHeadAttention, MultiHeadLatentAttention)
    layers = [m for m in model.modules() if isinstance(m, ours)]
    assert len(layers) == family.layers >= 2
    assert not any(isinstance(m, ours) for m in original.modules())


def test_eval_logits_equal_the_original(family):
    original, model = _pair(family)
    idx = _tokens(family)
    with torch.no_grad():
        torch.testing.assert_close(
            family.logits(model.eval(), idx), family.logits(original.eval(), idx),
            rtol=1e-5, atol=1e-5,
        )  # fmt: skip


@pytest.mark.parametrize(("name", "dropout"), [(name, p) for name in NAMES for p in DROPOUTS[name]])
def test_training_steps_equal_the_original_dropout_masks_included(name, dropout):
    """Five AdamW steps from the same seed: the same losses (the same dropout masks: both
    draw them in the same order) and the same weights after."""
    family = _family(name)
    original, model = _pair(family, dropout)
    original.train(), model.train()
    idx = _tokens(family, tokens=16)
    targets = torch.roll(idx, -1, dims=1)
    losses = []
    for net in (original, model):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        torch.manual_seed(7)
        run = []
        for _ in range(5):
            logits = family.logits(net, idx)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    if dropout:  # the masks were drawn: a second seed gives other losses
        assert losses[0][0] != pytest.approx(_first_loss(family, dropout, seed=8), rel=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(
            family.logits(model.eval(), idx), family.logits(original.eval(), idx),
            rtol=1e-4, atol=1e-4,
        )  # fmt: skip


def _first_loss(family, dropout, seed):
    original, _ = _pair(family, dropout)
    original.train()
    idx = _tokens(family, tokens=16)
    torch.manual_seed(seed)
    logits = family.logits(original, idx)
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(idx, -1, dims=1).flatten()).item()


def test_cached_generation_equals_the_originals_recomputing_one(family):
    original, model = _pair(family)
    idx = _tokens(family, batch=3, tokens=7)
    want = family.recompute(original.eval(), idx, 25)
    got = family.example.generate_cached(model.eval(), idx, 25)
    assert torch.equal(got, want)


def test_a_left_padded_batch_decodes_each_row_as_it_decodes_alone(family):
    _, model = _pair(family)
    model.eval()
    lengths = [5, 9, 7]
    prompts = [_tokens(family, batch=1, tokens=n, seed=n)[0] for n in lengths]
    longest = max(lengths)
    pad = torch.tensor([longest - n for n in lengths])
    batch = torch.stack([F.pad(p, (longest - len(p), 0), value=0) for p in prompts])
    got = family.example.generate_cached(model, batch, 12, pad)
    with torch.no_grad():
        caches = make_caches(model, len(prompts), longest + 1)
        logits = family.example.forward_cached(model, batch, caches, pad)  # (b, t, vocab)
    for row, prompt in enumerate(prompts):
        alone = family.example.generate_cached(model, prompt[None], 12)
        assert torch.equal(got[row, pad[row] :], alone[0]), row
        with torch.no_grad():
            own = family.example.forward_cached(model, prompt[None], make_caches(model, 1))
        torch.testing.assert_close(logits[row, pad[row] :], own[0], rtol=1e-5, atol=1e-5)


def test_the_way_back_is_the_original_class_with_the_same_outputs(family):
    original, model = _pair(family)
    back = family.restored(model)
    assert type(back) is type(original)
    assert back.state_dict().keys() == original.state_dict().keys()
    idx = _tokens(family)
    with torch.no_grad():
        torch.testing.assert_close(
            family.logits(back.eval(), idx), family.logits(original.eval(), idx),
            rtol=1e-5, atol=1e-5,
        )  # fmt: skip


@pytest.mark.parametrize("name", FILES)
def test_the_example_runs_as_a_script(name, capsys):
    load(name).main()
    printed = capsys.readouterr().out
    claims = 4 if name == "llama32" else 2  # llama32.py: both models
    assert "False" not in printed and printed.count("True") == claims, printed


def test_every_snippet_the_docs_include_is_a_marked_section_of_an_example():
    """The recipes page's code is the examples' own (pymdownx.snippets sections), so it
    cannot drift: each include names a file and a section that exist, and each section of
    each example is shown."""
    page = (EXAMPLES.parent / "docs" / "guide" / "recipes.md").read_text()
    included = re.findall(r'--8<-- "examples/(\w+)\.py:(\w+)"', page)
    assert {name for name, _ in included} == set(FILES)
    for name in FILES:
        source = (EXAMPLES / f"{name}.py").read_text()
        sections = set(re.findall(r"# --8<-- \[start:(\w+)\]", source))
        assert sections == set(re.findall(r"# --8<-- \[end:(\w+)\]", source))
        assert {section for n, section in included if n == name} == sections, name


def test_the_speedup_script_runs_and_checks_the_ids(capsys):
    spec = importlib.util.spec_from_file_location(
        "attnlab_recipe_speedups", EXAMPLES.parent / "scripts" / "recipe_speedups.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main([4, 8], 2)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3 * 2  # the header, then 3 models x 2 prompts


@st.composite
def recipe_cases(draw):
    """A family at drawn sizes: heads (and key/value groups for the Llama), width per head,
    a batch of prompts of drawn lengths (left-padded to the longest), new tokens."""
    name = draw(st.sampled_from(NAMES))
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8]))
    lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    return name, heads, head_dim, lengths, draw(st.integers(1, 4)), draw(st.integers(0, 99))


def _sized(name: str, heads: int, head_dim: int, seed: int) -> Family:
    family = _family(name)
    width = heads * head_dim
    if name == "nanogpt":
        family.config = replace(family.config, n_head=heads, n_embd=width)
    elif name == "book_gpt":
        family.config = {**family.config, "n_heads": heads, "emb_dim": width}
    else:
        groups = heads // 2 if heads > 1 and seed % 2 else heads  # grouped or one per head
        family.config = {**family.config, "n_heads": heads, "n_kv_groups": groups}
        if "head_dim" in family.config:  # Qwen3, Gemma 3: heads of their own width
            family.config.update(head_dim=head_dim)
        else:
            family.config.update(emb_dim=width, hidden_dim=2 * width)
    return family


@settings(max_examples=20, deadline=None)
@given(recipe_cases())
def test_drawn_sizes_decode_padded_rows_as_alone_and_equal_recomputing(case):
    name, heads, head_dim, lengths, new, seed = case
    family = _sized(name, heads, head_dim, seed)
    original, model = _pair(family, seed=seed)
    original.eval(), model.eval()
    prompts = [_tokens(family, batch=1, tokens=n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    longest = max(lengths)
    pad = torch.tensor([longest - n for n in lengths])
    batch = torch.stack([F.pad(p, (longest - len(p), 0), value=0) for p in prompts])
    with torch.no_grad():
        logits = family.example.forward_cached(model, batch, make_caches(model, len(lengths)), pad)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            own = family.example.forward_cached(model, prompt[None], make_caches(model, 1))
        torch.testing.assert_close(logits[row, pad[row] :], own[0], rtol=1e-4, atol=1e-5)
        want = family.recompute(original, prompt[None], new)
        assert torch.equal(family.example.generate_cached(model, prompt[None], new), want)


@pytest.mark.parametrize("name", ["book_gpt", "nanogpt", "mla"])
def test_cached_generation_past_the_context_is_a_value_error(name):
    family = _family(name)
    _, model = _pair(family)
    idx = torch.zeros(1, 60, dtype=torch.long)
    with pytest.raises(ValueError, match=r"exceed|past context_length"):
        family.example.generate_cached(model.eval(), idx, 10)  # 64 positions
