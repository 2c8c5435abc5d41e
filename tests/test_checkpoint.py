"""attnlab.save / attnlab.load: safetensors with the constructor arguments, book .pth
checkpoints through torch.load(weights_only=True), and clear errors for files that are
tampered with, mismatched or not checkpoints at all (nothing is ever unpickled)."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import attnlab
from attnlab import MultiHeadAttention, book

CONFIGS = [
    dict(d_in=8, d_out=8, context_length=12, dropout=0.0, num_heads=2),
    dict(d_in=8, d_out=12, context_length=12, dropout=0.1, num_heads=4, qkv_bias=True),
    dict(d_in=8, d_out=8, context_length=12, dropout=0.0, num_heads=4, num_kv_heads=2, rope=True),
    dict(d_in=8, d_out=8, context_length=12, dropout=0.0, num_heads=2, window=3, rope_base=500.0),
    dict(d_in=8, d_out=8, context_length=12, dropout=0.0, num_heads=2, context_dim=5),
    dict(d_in=8, d_out=8, context_length=12, dropout=0.0, num_heads=2, causal=False),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_round_trip_gives_the_same_module(tmp_path, config, dtype):
    torch.manual_seed(0)
    module = MultiHeadAttention(**config, dtype=dtype).eval()
    path = attnlab.save(module, tmp_path / "m.safetensors")
    loaded = attnlab.load(path).eval()
    assert loaded.config == module.config
    assert loaded.out_proj.weight.dtype == dtype
    x = torch.randn(2, 7, 8, dtype=dtype)
    context = torch.randn(2, 5, config.get("context_dim", 8), dtype=dtype)
    args = (x, context) if "context_dim" in config else (x,)
    torch.testing.assert_close(loaded(*args), module(*args), atol=0, rtol=0)


def test_the_file_is_plain_safetensors_with_the_config(tmp_path):
    module = MultiHeadAttention(8, 8, 12, 0.0, 2)
    path = attnlab.save(module, tmp_path / "m.safetensors")
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
        assert set(file.keys()) == set(module.state_dict())
    assert metadata["format"] == "attnlab.MultiHeadAttention"
    assert json.loads(metadata["config"]) == module.config


def test_a_book_checkpoint_loads_without_unpickling_code(tmp_path):
    torch.manual_seed(1)
    original = book.MultiHeadAttention(6, 4, 10, 0.0, 2, qkv_bias=True).eval()
    path = tmp_path / "book.pth"
    torch.save(original.state_dict(), path)
    loaded = attnlab.load(path, num_heads=2).eval()
    assert (loaded.d_in, loaded.d_out, loaded.context_length) == (6, 4, 10)
    assert loaded.qkv_bias
    x = torch.randn(2, 10, 6)
    torch.testing.assert_close(loaded(x), original(x), atol=1e-6, rtol=1e-5)


class _Payload:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))


def test_a_pickle_with_code_is_refused_and_never_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pth"
    torch.save({"W_query.weight": torch.zeros(2, 2), "payload": _Payload()}, path)
    with pytest.raises(ValueError, match="weights_only=True refused it"):
        attnlab.load(path, num_heads=1)
    assert not (tmp_path / "PWNED").exists()


def test_a_tampered_file_is_a_clear_error(tmp_path):
    path = attnlab.save(MultiHeadAttention(8, 8, 12, 0.0, 2), tmp_path / "m.safetensors")
    data = bytearray(path.read_bytes())
    data[8:20] = b"not a header"  # the JSON header starts after its 8-byte length
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        attnlab.load(path)
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")  # a header length past the end
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        attnlab.load(path)


def test_tensors_that_do_not_fit_the_config(tmp_path):
    module = MultiHeadAttention(8, 8, 12, 0.0, 2)
    config = dict(module.config, d_out=16, num_heads=4)
    tensors = {k: v.contiguous() for k, v in module.state_dict().items()}
    path = tmp_path / "m.safetensors"
    metadata = {"format": "attnlab.MultiHeadAttention", "config": json.dumps(config)}
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ValueError, match="do not fit its config"):
        attnlab.load(path)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (None, "not an attnlab checkpoint"),
        ({"format": "attnlab.MultiHeadAttention"}, "config metadata is missing"),
        ({"format": "attnlab.MultiHeadAttention", "config": "[1]"}, "not a JSON object"),
        (
            {"format": "attnlab.MultiHeadAttention", "config": '{"d_in": 8}'},
            "does not build a module",
        ),
    ],
)
def test_files_that_are_not_attnlab_checkpoints(tmp_path, metadata, message):
    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata=metadata)
    with pytest.raises(ValueError, match=message):
        attnlab.load(path)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda p: attnlab.save(torch.nn.Linear(2, 2), p / "m.safetensors"), TypeError, "must be"),
        (
            lambda p: attnlab.save(MultiHeadAttention(4, 4, 4, 0.0, 1), p / "m.pt"),
            ValueError,
            "end in",
        ),
        (lambda p: attnlab.load(p / "missing.safetensors"), ValueError, "no such checkpoint"),
    ],
)
def test_bad_arguments(tmp_path, call, error, message):
    with pytest.raises(error, match=message):
        call(tmp_path)


def test_a_book_checkpoint_needs_num_heads(tmp_path):
    path = tmp_path / "book.pth"
    torch.save(book.MultiHeadAttention(6, 4, 10, 0.0, 2).state_dict(), path)
    with pytest.raises(TypeError, match="pass it"):
        attnlab.load(path)
