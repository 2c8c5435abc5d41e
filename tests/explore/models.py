"""Tiny transformers models built from their configurations (no download), and a word-level
tokenizer built in memory; their attentions as the model itself returns them."""

from __future__ import annotations

import pytest
import torch

WORDS = ["[PAD]", "[UNK]", "Your", "journey", "starts", "with", "one", "step", "the", "a"]


def tiny_gpt2(layers: int = 2, heads: int = 3, seed: int = 0):
    """A GPT-2 of `layers` x `heads` (width 24), weights spread enough for peaked maps."""
    pytest.importorskip("transformers", reason="transformers is the optional extra attnlab[hf]")
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=layers,
        n_head=heads,
        n_embd=8 * heads,
        vocab_size=len(WORDS),
        n_positions=64,
        initializer_range=0.6,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2Model(config).eval()


def tiny_bert(seed: int = 0):
    pytest.importorskip("transformers", reason="transformers is the optional extra attnlab[hf]")
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_size=16,
        intermediate_size=32,
        vocab_size=len(WORDS),
        max_position_embeddings=64,
        initializer_range=0.5,
    )
    return BertModel(config).eval()


def tiny_t5(seed: int = 0):
    pytest.importorskip("transformers", reason="transformers is the optional extra attnlab[hf]")
    from transformers import T5Config, T5Model

    torch.manual_seed(seed)
    config = T5Config(
        num_layers=2,
        num_heads=2,
        d_model=16,
        d_kv=8,
        d_ff=32,
        vocab_size=len(WORDS),
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        initializer_factor=3.0,
    )
    return T5Model(config).eval()


def tokenizer():
    """A word-level tokenizer of WORDS (whitespace split), as a transformers tokenizer."""
    pytest.importorskip("transformers", reason="transformers is the optional extra attnlab[hf]")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(WORDS)}
    inner = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]", pad_token="[PAD]")


def eager_attentions(model, **kwargs):
    """The model's own output_attentions on an eager copy of it (the reference)."""
    import copy

    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        return reference(**kwargs, output_attentions=True, return_dict=True)
