"""The three sources capture the maps their models compute: the chapter's stages, attnlab
and PyTorch modules, transformers models (decoder, encoder, encoder-decoder); and each
leaves the model as it found it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab
from attnlab import book
from attnlab.explore.chapter import CAUSAL
from tests.explore import models

ROOT = Path(__file__).resolve().parents[2]
TEXT = "Your journey starts with one step"


def test_the_chapter_stage_by_stage():
    capture = attnlab.explore().capture
    scores, weights, heads = capture.groups
    torch.manual_seed(789)
    sa_v2 = book.SelfAttention_v2(3, 2)
    raw = sa_v2.W_query(book.INPUTS) @ sa_v2.W_key(book.INPUTS).T  # (6, 6)
    torch.testing.assert_close(scores.weights[0, 0], raw.detach(), rtol=0, atol=0)
    torch.testing.assert_close(scores.weights[1, 0], raw.detach() / math.sqrt(2), rtol=1e-6, atol=0)
    assert torch.equal(scores.full_mask()[2, 0], CAUSAL)  # -inf above the diagonal: masked
    assert bool(scores.full_mask()[:2].all())
    expected = book.causal_weights_neg_inf(raw.detach(), 2)
    torch.testing.assert_close(weights.weights[0, 0], expected, rtol=0, atol=0)
    assert weights.layer_names == ("softmax", "dropout p=0.5 (seed 123)")
    dropped = weights.weights[1, 0]
    assert bool(((dropped == 0) | torch.isclose(dropped, 2 * expected)).all())
    torch.manual_seed(123)
    mha = book.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    torch.testing.assert_close(
        heads.weights[0], mha.attention_weights(book.example_batch())[0].detach()
    )


def test_the_chapter_leaves_the_random_state_as_it_was():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    attnlab.explore()
    assert torch.equal(torch.rand(3), expected)


def test_an_attnlab_layer_gives_its_own_weights_and_is_left_as_it_was():
    torch.manual_seed(0)
    layer = attnlab.MultiHeadAttention(8, 8, 32, 0.1, num_heads=2, window=3).train()
    x = torch.randn(1, 7, 8)
    capture = attnlab.explore(layer, x, tokens=list("abcdefg")).capture
    (group,) = capture.groups
    with torch.no_grad():
        _, expected = layer.eval()(x, need_weights=True)
    layer.train()
    # hooks take the layer off its fast paths (attnlab.plan), hence rounding-level differences
    torch.testing.assert_close(group.weights[0], expected[0], rtol=1e-5, atol=1e-6)
    window = attnlab.masks.sliding_window_mask(7, window=3)
    assert torch.equal(group.full_mask()[0, 0], window)
    assert layer.training and not layer._forward_hooks and not layer._forward_pre_hooks
    assert group.query_tokens == tuple("abcdefg")


def test_a_model_of_attnlab_layers_on_text_gives_one_layer_per_call():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(50, 16),
        attnlab.MultiHeadAttention(16, 16, 32, 0.0, num_heads=4),
        attnlab.MultiHeadAttention(16, 16, 32, 0.0, num_heads=4),
    )
    capture = attnlab.explore(model, TEXT).capture
    (group,) = capture.groups
    assert group.shape == (2, 4, 6, 6)
    assert group.layer_names == ("1", "2")
    assert any("CRC-32" in note for note in capture.notes)


def test_any_module_through_its_softmax_with_minus_inf_as_masked():
    torch.manual_seed(123)
    module = book.CausalAttention(3, 2, 6, 0.0)
    (group,) = attnlab.explore(module, TEXT).capture.groups  # the chapter's embeddings
    with torch.no_grad():
        keys, queries = module.W_key(book.INPUTS), module.W_query(book.INPUTS)
        expected = torch.softmax((queries @ keys.T).masked_fill(~CAUSAL, -torch.inf) / 2**0.5, -1)
    torch.testing.assert_close(group.weights[0, 0], expected)
    assert torch.equal(group.full_mask()[0, 0], CAUSAL)


def test_the_seeds_masked_fill_bug_shows_as_no_mask():
    """examples/seed001: masked_fill without the underscore, so nothing is masked."""
    from attnlab.check.loader import load_class

    cls = load_class(ROOT / "examples" / "seed001_causal_attention.py", "CausalAttention")
    torch.manual_seed(0)
    (group,) = attnlab.explore(cls(3, 2, 6, 0.0), TEXT).capture.groups
    assert bool(group.full_mask().all())
    assert bool((group.weights[0, 0].triu(1) > 0).any())  # the future leaks, visibly


class _Sdpa(nn.Module):
    """Attention through F.scaled_dot_product_attention (which returns no weights)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4)  # 3 x (b, h, t, hd)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def test_scaled_dot_product_attention_weights_are_recomputed():
    torch.manual_seed(0)
    module = _Sdpa()
    x = torch.randn(1, 5, 8)
    (group,) = attnlab.explore(module, x).capture.groups
    with torch.no_grad():
        q, k, _ = module.qkv(x).view(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4)
        causal = torch.ones(5, 5, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-2, -1) / 2).masked_fill(~causal, -torch.inf)
    torch.testing.assert_close(group.weights[0], torch.softmax(scores, -1)[0])
    assert torch.equal(group.full_mask()[0, 0], causal)
    assert group.layer_names == ("_Sdpa",)


def test_gpt2_with_its_tokenizer_equals_its_own_attentions():
    pytest.importorskip("transformers")
    model, tokenizer = models.tiny_gpt2(), models.tokenizer()
    model.train()
    capture = attnlab.explore(model, TEXT, tokenizer=tokenizer).capture
    (group,) = capture.groups
    reference = models.eager_attentions(model.eval(), **tokenizer(TEXT, return_tensors="pt"))
    for layer, expected in enumerate(reference.attentions):
        torch.testing.assert_close(group.weights[layer], expected[0], rtol=0, atol=0)
    assert torch.equal(group.full_mask()[0, 0], CAUSAL)
    assert group.query_tokens == tuple(TEXT.split())
    assert model.config._attn_implementation == "sdpa"  # restored


def test_gpt2_without_a_tokenizer_labels_tokens_by_id_and_keeps_training_mode():
    pytest.importorskip("transformers")
    model = models.tiny_gpt2().train()
    capture = attnlab.explore(model, [2, 3, 4]).capture
    assert capture.groups[0].query_tokens == ("2", "3", "4")
    assert model.training
    assert any("ids" in note for note in capture.notes)


def test_bert_is_not_causal_and_its_padding_is_masked():
    pytest.importorskip("transformers")
    model = models.tiny_bert()
    inputs = {
        "input_ids": torch.tensor([[2, 3, 4, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0]]),
    }
    (group,) = attnlab.explore(model, inputs).capture.groups
    expected = torch.tensor([True, True, True, False]).expand(4, 4)
    assert torch.equal(group.full_mask()[1, 1], expected)
    reference = models.eager_attentions(model, **inputs)
    torch.testing.assert_close(group.weights[1], reference.attentions[1][0], rtol=0, atol=0)


def test_t5_gives_encoder_decoder_and_cross_attention():
    pytest.importorskip("transformers")
    model, tokenizer = models.tiny_t5(), models.tokenizer()
    capture = attnlab.explore(model, TEXT, tokenizer=tokenizer).capture
    encoder, decoder, cross = capture.groups
    assert [g.name for g in capture.groups] == [
        "encoder self-attention",
        "decoder self-attention",
        "decoder cross-attention",
    ]
    assert encoder.shape == (2, 2, 6, 6) and bool(encoder.full_mask().all())
    assert decoder.query_tokens == ("[PAD]", *TEXT.split()[:-1])  # start token, shifted
    assert torch.equal(decoder.full_mask()[0, 0], CAUSAL)
    assert cross.shape == (2, 2, 6, 6) and cross.key_tokens == tuple(TEXT.split())
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    dec = torch.cat([torch.tensor([[0]]), ids[:, :-1]], dim=1)
    reference = models.eager_attentions(model, input_ids=ids, decoder_input_ids=dec)
    torch.testing.assert_close(cross.weights[1], reference.cross_attentions[1][0], rtol=0, atol=0)


def test_a_transformers_model_by_path(tmp_path):
    pytest.importorskip("transformers")
    models.tiny_gpt2().save_pretrained(tmp_path / "tiny")
    models.tokenizer().save_pretrained(tmp_path / "tiny")
    capture = attnlab.explore(str(tmp_path / "tiny"), "Your journey").capture
    assert capture.groups[0].query_tokens == ("Your", "journey")


def test_too_many_tokens_are_cut_before_running_and_said():
    capture = attnlab.explore(book.CausalAttention(3, 2, 64, 0.0), "a " * 40, max_tokens=16).capture
    assert capture.groups[0].shape[-2:] == (16, 16)
    assert capture.cuts == (
        "inputs: 40 tokens, cut to the first 16 before running (tokens 17 to 40 left out; "
        "raise max_tokens to see them)",
    )


def test_too_many_cells_keep_the_first_layers_and_say_so():
    pytest.importorskip("transformers")
    model = models.tiny_gpt2(layers=4, heads=2)
    capture = attnlab.explore(model, list(range(2, 10)), max_cells=2 * 2 * 8 * 8).capture
    assert capture.groups[0].shape == (2, 2, 8, 8)
    (cut,) = capture.cuts
    assert cut.startswith("self-attention: layers layer 2 to layer 3 cut (2 of 4 layers kept")


@pytest.mark.parametrize("batch_first", [True, False])
def test_pytorchs_multihead_attention_gives_the_weights_it_returns(batch_first):
    torch.manual_seed(0)
    module = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    x = torch.randn(1, 5, 8)  # (1, t, d)
    (group,) = attnlab.explore(module, x).capture.groups
    xs = x if batch_first else x.transpose(0, 1)
    with torch.no_grad():
        _, expected = module(xs, xs, xs, average_attn_weights=False)  # (1, h, t, t)
    assert group.shape == (1, 2, 5, 5)
    torch.testing.assert_close(group.weights[0], expected[0], rtol=0, atol=0)


class _ByteLevel:
    """A tokenizer's two readings of ids 0 and 1: GPT-2's "Ġa", and a piece that decodes
    to nothing visible."""

    def convert_ids_to_tokens(self, ids):
        return [["Ġa", "Ċ"][i] for i in ids]

    def decode(self, ids):
        return [" a", "\n"][ids[0]]


def test_token_labels_are_decoded_text_or_the_vocabulary_entry_where_blank():
    from attnlab.explore import hf

    assert hf.labels(torch.tensor([[0, 1]]), _ByteLevel()) == (" a", "Ċ")
    assert hf.labels(torch.tensor([[0, 1]]), None) == ("0", "1")


class _WithProbabilities(nn.Module):
    """The book's causal attention, then a softmax over a 20-word vocabulary (not attention)."""

    def __init__(self):
        super().__init__()
        self.attention = book.CausalAttention(3, 3, 6, 0.0)
        self.head = nn.Linear(3, 20)

    def forward(self, x):
        return torch.softmax(self.head(self.attention(x)), dim=-1)


def test_a_softmax_over_a_vocabulary_is_not_taken_for_attention():
    torch.manual_seed(0)
    (group,) = attnlab.explore(_WithProbabilities(), TEXT).capture.groups
    assert group.shape == (1, 1, 6, 6)
    assert group.layer_names == ("attention",)


def test_a_llama_with_grouped_query_heads_gives_every_query_head():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=10,
        max_position_embeddings=32,
    )
    model = LlamaModel(config).eval()
    (group,) = attnlab.explore(model, [1, 2, 3, 4, 5]).capture.groups
    assert group.shape == (2, 4, 5, 5)
    assert torch.equal(group.full_mask()[1, 3], torch.ones(5, 5, dtype=torch.bool).tril())
    reference = models.eager_attentions(model, input_ids=torch.tensor([[1, 2, 3, 4, 5]]))
    torch.testing.assert_close(group.weights[1], reference.attentions[1][0], rtol=0, atol=0)


class _SdpaFinfoMask(nn.Module):
    """SDPA given an additive causal mask filled with torch.finfo(dtype).min (as
    transformers and GPT-NeoX write it), not -inf."""

    def forward(self, x):  # (b, t, d)
        t = x.shape[1]
        mask = torch.zeros(t, t).masked_fill(
            torch.ones(t, t).triu(1).bool(), torch.finfo(x.dtype).min
        )
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


def test_an_sdpa_mask_filled_with_the_lowest_finite_value_is_masked():
    torch.manual_seed(0)
    (group,) = attnlab.explore(_SdpaFinfoMask(), torch.randn(1, 6, 16)).capture.groups
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(group.full_mask()[0, 0], causal)


@pytest.mark.parametrize("build", ["tiny_gpt2", "tiny_bert"])
def test_a_saved_model_without_tokenizer_files_gets_one_hashed_id_per_word(tmp_path, build):
    """transformers 5.24 loads an empty tokenizer from a folder without tokenizer files
    (no error): it is taken as none, and each word of the text gets crc32(word) % vocab."""
    pytest.importorskip("transformers")
    import zlib

    model = getattr(models, build)().eval()
    model.save_pretrained(tmp_path / "no-tokenizer")
    capture = attnlab.explore(str(tmp_path / "no-tokenizer"), TEXT).capture
    words = tuple(TEXT.split())
    assert capture.groups[0].query_tokens == words
    ids = torch.tensor([[zlib.crc32(w.encode()) % model.config.vocab_size for w in words]])
    reference = models.eager_attentions(model, input_ids=ids)
    for layer, expected in enumerate(reference.attentions):  # (1, h, t, t) each
        torch.testing.assert_close(capture.groups[0].weights[layer], expected[0])
    assert any("crc32" in note for note in capture.notes)
