"""Public arguments are checked at the door: TypeError/ValueError naming the argument and
the value, before anything runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnlab
from attnlab import book
from attnlab.explore import Capture, Exploration, Group, combine
from tests.explore import models


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"source": 42}, TypeError, "source must be None .* got int"),
        ({"inputs": "text"}, ValueError, "inputs does not apply to this source, got 'text'"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"max_tokens": 2.5}, TypeError, "max_tokens"),
        ({"max_cells": -1}, ValueError, "max_cells"),
        ({"precision": 12}, ValueError, r"precision must be 'auto', 8 or 16, got 12"),
        ({"precision": True}, ValueError, "precision"),
        ({"causal": "yes"}, TypeError, "causal must be None, True or False, got 'yes'"),
        ({"title": 3}, TypeError, "title must be a str, got int"),
    ],
)
def test_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        attnlab.explore(**kwargs)


def test_bad_module_inputs():
    module = book.CausalAttention(3, 2, 6, 0.0)
    with pytest.raises(ValueError, match=r"tokens \(2\) must label each of the 6 inputs tokens"):
        attnlab.explore(module, torch.randn(6, 3), tokens=["a", "b"])
    with pytest.raises(ValueError, match=r"inputs must be \(tokens, d\) or \(1, tokens, d\), got"):
        attnlab.explore(module, torch.randn(2, 6, 3))
    with pytest.raises(ValueError, match="inputs must hold at least one token"):
        attnlab.explore(module, "   ")
    with pytest.raises(TypeError, match="inputs must be a text, a list of token strings or a"):
        attnlab.explore(module, 3.5)
    with pytest.raises(ValueError, match="tokenizer does not apply to this source"):
        attnlab.explore(module, "a b", tokenizer=object())


def test_a_module_without_attention_is_refused_by_name():
    with pytest.raises(ValueError, match="no attention weights were seen while running Linear"):
        attnlab.explore(nn.Linear(4, 4), torch.randn(3, 4))


def test_bad_transformers_inputs():
    pytest.importorskip("transformers")
    model = models.tiny_gpt2()
    with pytest.raises(ValueError, match="inputs is a text: give tokenizer="):
        attnlab.explore(model, "Your journey")
    with pytest.raises(ValueError, match="inputs is required for a transformers model"):
        attnlab.explore(model)
    with pytest.raises(
        ValueError, match=r"inputs must be one sequence of token ids, got shape \(2, 3\)"
    ):
        attnlab.explore(model, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="inputs must be a text, token ids"):
        attnlab.explore(model, torch.ones(3))
    with pytest.raises(ValueError, match="decoder_inputs applies to encoder-decoder models only"):
        attnlab.explore(model, [1, 2], decoder_inputs=[1])


def test_save_and_combine_check_their_arguments(tmp_path):
    result = attnlab.explore()
    with pytest.raises(ValueError, match="is a folder"):
        result.save(tmp_path)
    with pytest.raises(TypeError, match="path must be a str or a Path, got int"):
        result.save(3)
    with pytest.raises(TypeError, match=r"explorations\[1\] must be an Exploration, got str"):
        combine(result, "x")
    with pytest.raises(ValueError, match=r"names \(1\) must name each of the 2 explorers"):
        combine(result, result, names=("a",))
    with pytest.raises(TypeError, match="capture must be a Capture, got dict"):
        Exploration({})
    assert isinstance(result + result, Exploration)
    with pytest.raises(ValueError, match="capture 't' has no group of maps to show"):
        Exploration(Capture("t", ()))


def test_a_group_checks_its_maps():
    labels = ("a", "b")
    with pytest.raises(ValueError, match=r"weights must be \(layers, heads, queries, keys\)"):
        Group("g", torch.zeros(2, 2), torch.tensor(True), labels, labels, ("l",))
    with pytest.raises(TypeError, match=r"allowed must be a bool tensor, got a torch\.float32"):
        Group("g", torch.zeros(1, 1, 2, 2), torch.ones(2, 2), labels, labels, ("l",))
    with pytest.raises(ValueError, match=r"allowed \(3, 3\) must broadcast to"):
        Group("g", torch.zeros(1, 1, 2, 2), torch.ones(3, 3).bool(), labels, labels, ("l",))
    with pytest.raises(ValueError, match=r"layer_names \(2\) must name each of the 1 layers"):
        Group("g", torch.zeros(1, 1, 2, 2), torch.tensor(True), labels, labels, ("l", "m"))


# --- a model by name: a local path or the local Hugging Face cache, never the hub ----------


@pytest.fixture
def no_hub(monkeypatch):
    """transformers' loaders, each call recorded, refusing any call that may ask the hub
    (the old code's explore("x") retried it 5 times, ~23 s offline, then raised OSError)."""
    transformers = pytest.importorskip("transformers")
    calls = []
    for cls in (transformers.AutoModel, transformers.AutoTokenizer):
        original = cls.from_pretrained.__func__

        def spy(klass, name, *args, _original=original, **kwargs):
            calls.append((klass.__name__, name, kwargs))
            if not kwargs.get("local_files_only"):
                raise AssertionError(f"{klass.__name__}.from_pretrained({name!r}) may ask the hub")
            return _original(klass, name, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    return calls


@pytest.mark.parametrize("name", ["x", "no-such-org/no-such-model", "./no/such/folder"])
def test_a_name_that_is_neither_a_path_nor_cached_says_so_at_once(name, no_hub, tmp_path):
    from attnlab.explore.hf import ModelNotFoundError

    with pytest.raises(ModelNotFoundError) as error:
        attnlab.explore(name, "Your journey starts")
    assert isinstance(error.value, ValueError) and isinstance(error.value, OSError)
    message = str(error.value)
    assert message.startswith(
        f"source {name!r} is neither an existing path nor a model in the local Hugging Face cache"
    ), message
    assert no_hub and all(kwargs.get("local_files_only") for _, _, kwargs in no_hub)


def test_a_path_that_holds_no_model_says_so(no_hub, tmp_path):
    from attnlab.explore.hf import ModelNotFoundError

    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelNotFoundError, match=r"is a path, but transformers loads no model"):
        attnlab.explore(str(tmp_path), "Your journey starts")


@pytest.mark.parametrize("config", ["null", "[]", '"text"'])
def test_a_folder_whose_config_is_not_a_config_says_so(config, no_hub, tmp_path):
    from attnlab.explore.hf import ModelNotFoundError

    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ModelNotFoundError, match=r"is a path, but transformers loads no model"):
        attnlab.explore(str(tmp_path), "Your journey starts")


def test_a_path_under_the_home_folder_loads_as_written(tmp_path, monkeypatch):
    """ "~/tiny" is the folder, as a shell would read it (transformers takes "~/tiny" as a
    hub name and refuses it)."""
    from transformers import GPT2Config, GPT2Model

    monkeypatch.setenv("HOME", str(tmp_path))
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=50, n_positions=16)
    GPT2Model(config).save_pretrained(tmp_path / "tiny")
    exploration = attnlab.explore("~/tiny", torch.tensor([[1, 2, 3]]))
    assert exploration.capture.groups  # the model ran: its attention maps are captured


def test_a_model_in_the_local_cache_loads_by_name_without_the_hub(no_hub, tmp_path, monkeypatch):
    """A hub name downloaded before (here a cache laid out by hand) loads by its name."""
    import huggingface_hub.constants

    repo = tmp_path / "models--local--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    models.tiny_gpt2().save_pretrained(snapshot)
    models.tokenizer().save_pretrained(snapshot)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    result = attnlab.explore("local/tiny", "Your journey starts")
    assert result.capture.groups[0].shape == (2, 3, 3, 3)
    assert result.capture.groups[0].query_tokens == ("Your", "journey", "starts")  # its words
    assert {(cls, name) for cls, name, _ in no_hub} == {
        ("AutoModel", "local/tiny"),
        ("AutoTokenizer", "local/tiny"),
    }
