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
            "config lacks 'd_out', 'context_length', 'dropout', 'num_heads'",
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


# --- the file is data: schema, tensor specs before allocation, checksum, argument errors ---

FORMAT = "attnlab.MultiHeadAttention"


def _saved(tmp_path, **config):
    """A real attnlab file of a small module (rope unless told otherwise)."""
    torch.manual_seed(3)
    arguments = dict(d_in=8, d_out=8, context_length=12, dropout=0.0, num_heads=2, rope=True)
    module = MultiHeadAttention(**{**arguments, **config}).eval()
    return module, attnlab.save(module, tmp_path / "m.safetensors")


def _rewrite(path, *, config=None, drop=(), tensors=None, metadata=None):
    """Re-write `path` with config keys changed (None removes one), metadata keys dropped,
    tensors replaced: what a hand edit does (the stored checksum is kept as it was)."""
    with safe_open(str(path), framework="pt") as file:
        stored = dict(file.metadata())
        state = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    edited = json.loads(stored["config"])
    for key, value in (config or {}).items():
        edited.pop(key) if value is None else edited.__setitem__(key, value)
    stored["config"] = json.dumps(edited)
    stored.update(metadata or {})
    for key in drop:
        stored.pop(key)
    save_file({**state, **(tensors or {})}, str(path), metadata=stored)
    return path


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("causal", "False", "'False'"),
        ("rope", 1, "1"),
        ("qkv_bias", None, None),  # removal is fine: a default; checked below by the checksum
        ("d_in", 8.0, "8.0"),
        ("d_in", True, "True"),
        ("num_heads", 0, "0"),
        ("context_length", -3, "-3"),
        ("window", 0, "0"),
        ("dropout", float("nan"), "nan"),
        ("rope_base", float("inf"), "inf"),
        ("backend", "fast", "'fast'"),
        ("device", "meta", "'meta'"),
        ("device", "cuda", "'cuda'"),
        ("dtype", "float16", "'float16'"),
        ("colour", "blue", "'blue'"),
        ("context_length", 2**63, "at most 1,099,511,627,776 .* got 9,223,372,036,854,775,808"),
        ("d_in", 2**63, "at most 1,099,511,627,776 .* got 9,223,372,036,854,775,808"),
        ("num_heads", 2**40 + 1, "at most 1,099,511,627,776 .* got 1,099,511,627,777"),
        ("window", 2**64, "at most 1,099,511,627,776 .* got 18,446,744,073,709,551,616"),
    ],
)
def test_a_config_value_off_the_schema_names_the_key_and_the_value(tmp_path, key, value, shown):
    _, path = _saved(tmp_path)
    _rewrite(path, config={key: value})
    if shown is None:
        with pytest.raises(ValueError, match="checksum"):
            attnlab.load(path)
        return
    with pytest.raises(ValueError, match=rf"config\['{key}'\].*{shown}") as error:
        attnlab.load(path)
    if key in ("device", "dtype"):
        assert "the caller says where they go" in str(error.value)


def test_a_required_config_key_missing_is_named(tmp_path):
    _, path = _saved(tmp_path)
    _rewrite(path, config={"d_out": None})
    with pytest.raises(ValueError, match=r"config lacks 'd_out'"):
        attnlab.load(path)


@pytest.mark.parametrize(("key", "value"), [("causal", False), ("rope", False), ("dropout", 0.5)])
def test_an_edit_that_fits_the_schema_is_caught_by_the_checksum(tmp_path, key, value):
    _, path = _saved(tmp_path)
    _rewrite(path, config={key: value})
    with pytest.raises(ValueError, match="checksum"):
        attnlab.load(path)


def test_a_claimed_size_fails_before_any_allocation_of_that_size(tmp_path):
    resource = pytest.importorskip("resource")
    _, path = _saved(tmp_path, rope=False)
    claimed = {"d_in": 20000, "context_dim": 20000, "d_out": 10000}  # 2.8 GB to build
    _rewrite(path, config=claimed)  # a file of 3.5 KB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    shapes = r"tensor '\w+.weight' has shape \(\d+, 8\) in the file, .* \(\d+, \d+000\)"
    with pytest.raises(ValueError, match=shapes):
        attnlab.load(path)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 200 * 1024, f"peak memory grew by {grown} KiB"
    petabytes = {"d_in": 10**7, "d_out": 10**7, "context_dim": 10**7}  # past MAX_SIZE
    _rewrite(path, config=petabytes)
    with pytest.raises(ValueError, match=r"d_in x d_out \(10000000 x 10000000\)"):
        attnlab.load(path)


def test_rope_tables_larger_than_the_memory_are_refused_before_they_are_built(
    tmp_path, monkeypatch
):
    _, path = _saved(tmp_path)
    _rewrite(path, config={"context_length": 10**12})  # tables of 10^12 x 4 float32
    with pytest.raises(ValueError, match=r"context_length \(1000000000000\).*rotary tables"):
        attnlab.load(path)
    _, path = _saved(tmp_path)  # a real file: loads, unless the machine had 1 MB free
    monkeypatch.setattr(attnlab.checkpoint, "_available_bytes", lambda: 2**20)
    _rewrite(path, config={"context_length": 100_000})
    with pytest.raises(ValueError, match=r"context_length \(100000\)"):
        attnlab.load(path)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_integer_tensors_where_weights_belong_are_refused_not_cast(tmp_path, dtype):
    module, path = _saved(tmp_path)
    weight = module.out_proj.weight.detach()
    _rewrite(path, tensors={"out_proj.weight": torch.ones_like(weight, dtype=dtype)})
    with pytest.raises(ValueError, match=rf"'out_proj.weight'.*{str(dtype).split('.')[1]}"):
        attnlab.load(path)


def test_mixed_float_dtypes_are_refused_on_save_and_load_and_save_leaves_the_file(tmp_path):
    module, path = _saved(tmp_path)
    original = path.read_bytes()
    module.out_proj.to(torch.float64)
    with pytest.raises(ValueError, match="one dtype"):
        attnlab.save(module, path)
    assert path.read_bytes() == original
    _rewrite(path, tensors={"out_proj.weight": module.out_proj.weight.detach()})
    with pytest.raises(ValueError, match="one dtype"):
        attnlab.load(path)


def _data_start(path):
    """Offset of the first tensor byte: after the 8-byte header length and the header."""
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_a_flipped_bit_in_the_tensor_data_is_a_checksum_error(tmp_path):
    _, path = _saved(tmp_path, qkv_bias=True)
    original = path.read_bytes()
    start = _data_start(path)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(start * 8, len(original) * 8, (24,), generator=generator)
    for position in [start * 8, len(original) * 8 - 1, *positions.tolist()]:
        data = bytearray(original)
        data[position // 8] ^= 1 << (position % 8)
        path.write_bytes(bytes(data))
        with pytest.raises(ValueError, match="checksum"):
            attnlab.load(path)


def test_a_flipped_bit_anywhere_in_the_file_is_an_error(tmp_path):
    _, path = _saved(tmp_path)
    original = path.read_bytes()
    generator = torch.Generator().manual_seed(1)
    header_bits = _data_start(path) * 8
    for position in torch.randint(0, header_bits, (48,), generator=generator).tolist():
        data = bytearray(original)
        data[position // 8] ^= 1 << (position % 8)
        path.write_bytes(bytes(data))
        with pytest.raises(ValueError):
            attnlab.load(path)


def test_a_damaged_checksum_key_is_not_taken_for_an_old_file(tmp_path):
    _, path = _saved(tmp_path)
    data = path.read_bytes()
    assert data.count(b'"checksum"') == 1
    path.write_bytes(data.replace(b'"checksum"', b'"chdcksum"'))  # one flipped bit
    with pytest.raises(ValueError, match=r"unknown metadata keys.*chdcksum"):
        attnlab.load(path)


def test_a_file_saved_before_checksums_loads_with_a_warning(tmp_path):
    module, path = _saved(tmp_path)
    _rewrite(path, drop=["checksum"])
    with pytest.warns(UserWarning, match="no checksum"):
        loaded = attnlab.load(path).eval()
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(loaded(x), module(x), atol=0, rtol=0)


def test_the_loaded_module_is_on_the_cpu_with_the_files_tensors(tmp_path):
    module, path = _saved(tmp_path)
    loaded = attnlab.load(path)
    tensors = [*loaded.parameters(), *loaded.buffers()]
    assert all(t.device.type == "cpu" for t in tensors)
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in loaded.parameters())
    for name, tensor in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    torch.testing.assert_close(loaded.rope.cos, module.rope.cos, atol=0, rtol=0)


def test_the_loaded_module_does_not_alias_the_file(tmp_path):
    module, path = _saved(tmp_path)
    loaded = attnlab.load(path)
    data = bytearray(path.read_bytes())
    data[_data_start(path) :] = bytes(len(data) - _data_start(path))  # the weights zeroed
    path.write_bytes(bytes(data))
    for name, tensor in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "state",
    [
        {"W_query.weight": [[1.0, 2.0]]},
        {"W_query.weight": torch.zeros(4, 6), "W_key.weight": "weights", "mask": torch.ones(3, 3)},
        {"W_query.weight": torch.zeros(4, 6), "extra": 3},
        ["W_query.weight"],
    ],
)
def test_a_pth_whose_entries_are_not_tensors(tmp_path, state):
    path = tmp_path / "book.pth"
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"not a tensor|not a state_dict"):
        attnlab.load(path, num_heads=2)


def test_an_integer_book_checkpoint_is_refused_not_cast(tmp_path):
    state = book.MultiHeadAttention(6, 4, 10, 0.0, 2).state_dict()
    state["W_key.weight"] = torch.ones(4, 6, dtype=torch.int32)
    path = tmp_path / "book.pth"
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"'W_key.weight'.*int32"):
        attnlab.load(path, num_heads=2)


def test_a_production_state_dict_gets_a_hint_naming_the_function_that_fits(tmp_path):
    module = MultiHeadAttention(8, 8, 12, 0.0, 2)
    for name in ("m.pth", "m.safetensors"):
        path = tmp_path / name
        if name.endswith(".pth"):
            torch.save(module.state_dict(), path)
        else:
            save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
        with pytest.raises(ValueError, match=r"load_state_dict.*attnlab.save"):
            attnlab.load(path, **({"num_heads": 2} if name.endswith(".pth") else {}))
    path = tmp_path / "torch.pth"
    torch.save(torch.nn.MultiheadAttention(8, 2).state_dict(), path)
    with pytest.raises(ValueError, match=r"attnlab.interop.from_torch"):
        attnlab.load(path, num_heads=2)


@pytest.mark.parametrize("path", [123, 1.5, None, b"m.safetensors"])
def test_load_of_a_non_path_is_a_type_error(path):
    with pytest.raises(TypeError, match="path must be"):
        attnlab.load(path)


def test_a_missing_file_is_file_not_found(tmp_path):
    for name in ("missing.safetensors", "missing.pth"):
        with pytest.raises(FileNotFoundError, match="missing"):
            attnlab.load(tmp_path / name)


def test_a_bad_device_argument_is_a_value_error(tmp_path):
    _, path = _saved(tmp_path)
    with pytest.raises(ValueError, match="device"):
        attnlab.load(path, device="nonsense")
    with pytest.raises(TypeError, match="device"):
        attnlab.load(path, device=3.5)


def test_numpy_integers_in_the_config_are_saved_as_ints(tmp_path):
    np = pytest.importorskip("numpy")
    module = MultiHeadAttention(np.int64(8), np.int64(8), np.int32(12), 0.0, np.int64(2))
    path = attnlab.save(module, tmp_path / "m.safetensors")
    with safe_open(str(path), framework="pt") as file:
        config = json.loads(file.metadata()["config"])
    plain = MultiHeadAttention(8, 8, 12, 0.0, 2).config  # built from Python ints
    assert config == plain
    assert {k: type(v) for k, v in config.items()} == {k: type(v) for k, v in plain.items()}
    assert attnlab.load(path).config == config


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_file_whose_weights_are_not_finite_is_refused_naming_the_tensor(tmp_path, bad):
    """A diverged run saved with a valid checksum loaded, and every output was NaN."""
    _, path = _saved(tmp_path)
    with safe_open(str(path), framework="pt") as file:
        metadata = dict(file.metadata())
        state = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    state["out_proj.weight"][1, 2] = bad
    metadata["checksum"] = attnlab.checkpoint.checksum(metadata, state)  # a right checksum
    save_file(state, str(path), metadata=metadata)
    with pytest.raises(ValueError, match=r"tensor 'out_proj.weight' has a non-finite value"):
        attnlab.load(path)


def _with_config_text(path, text):
    """Re-write `path` with its config metadata replaced by `text` (any string)."""
    with safe_open(str(path), framework="pt") as file:
        stored = dict(file.metadata())
        state = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    save_file(state, str(path), metadata={**stored, "config": text})
    return path


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deep"),  # once a RecursionError
        ('{"d_in": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deep"),
        ('{"d_in": ' + "9" * 5000 + "}", "digits"),  # Python's int limit: a bare ValueError
        ('{"d_in": 8', "Expecting"),
        ("", "Expecting value"),
    ],
    ids=["deep-list", "deep-value", "long-int", "truncated", "empty"],
)
def test_any_json_failure_of_the_config_is_a_value_error_naming_the_file(tmp_path, text, reason):
    _, path = _saved(tmp_path)
    _with_config_text(path, text)
    with pytest.raises(
        ValueError,
        match=rf"m\.safetensors'?: its config metadata is not "
        rf"readable JSON \(.*{reason}",
    ):
        attnlab.load(path)


def test_a_huge_config_value_is_shown_cut_in_the_message(tmp_path):
    _, path = _saved(tmp_path)
    _rewrite(path, config={"colour": "x" * 1_000_000, "d_in": list(range(100_000))})
    with pytest.raises(ValueError) as error:
        attnlab.load(path)
    assert len(str(error.value)) < 1000 and "\u2026" in str(error.value)


BOOK_NAMES = ["W_query.weight", "W_key.weight", "W_value.weight", "out_proj.weight"]
BOOK_NAMES += ["out_proj.bias"]


@pytest.mark.parametrize(
    ("kept", "given", "lacks", "hint"),
    [
        (["W_query.weight"], {}, [*BOOK_NAMES[1:], "mask"], True),
        (["W_query.weight"], {"context_length": 10}, BOOK_NAMES[1:], False),
        (BOOK_NAMES, {}, ["mask"], True),
        ([*BOOK_NAMES, "W_query.bias", "mask"], {}, ["W_key.bias", "W_value.bias"], False),
    ],
    ids=["query-only", "query-only-with-context_length", "no-mask", "one-bias"],
)
def test_a_book_checkpoint_missing_tensors_names_them(tmp_path, kept, given, lacks, hint):
    """A .pth holding only W_query.weight once raised Python's TypeError about the
    constructor's context_length."""
    full = book.MultiHeadAttention(6, 4, 10, 0.0, 2, qkv_bias=True).state_dict()
    path = tmp_path / "book.pth"
    torch.save({name: full[name] for name in kept}, path)
    with pytest.raises(ValueError, match="a book MultiHeadAttention state_dict") as error:
        attnlab.load(path, num_heads=2, **given)
    message = str(error.value)
    assert message.startswith(repr(str(path))), message
    assert f"lacks {lacks}" in message, message
    assert ("pass context_length=" in message) == hint, message


def test_a_book_checkpoint_without_a_mask_loads_with_context_length_given(tmp_path):
    torch.manual_seed(2)
    original = book.MultiHeadAttention(6, 4, 10, 0.0, 2).eval()
    state = {k: v for k, v in original.state_dict().items() if k != "mask"}
    path = tmp_path / "book.pth"
    torch.save(state, path)
    loaded = attnlab.load(path, num_heads=2, context_length=10).eval()
    x = torch.randn(1, 10, 6)
    torch.testing.assert_close(loaded(x), original(x), atol=1e-6, rtol=1e-5)


def test_a_book_mask_that_is_not_square_is_named(tmp_path):
    state = book.MultiHeadAttention(6, 4, 10, 0.0, 2).state_dict()
    state["mask"] = state["mask"][0]  # (10,): no context_length to read
    path = tmp_path / "book.pth"
    torch.save(state, path)
    with pytest.raises(
        ValueError,
        match=r"tensor 'mask' must be \(context_length, "
        r"context_length\), got shape \(10,\)",
    ):
        attnlab.load(path, num_heads=2)


def test_a_scale_not_finite_in_float32_is_refused_on_load(tmp_path):
    """A file whose config claims scale 1e39 (finite as a Python float, infinite in float32,
    where the scores are computed): a ValueError naming it, not NaN outputs."""
    _, path = _saved(tmp_path, scale=0.5)
    _rewrite(path, config={"scale": 1e39})
    with pytest.raises(ValueError, match=r"scale \(1e\+39\) is not finite in torch\.float32"):
        attnlab.load(path)


def test_a_norms_eps_edited_after_construction_is_saved(tmp_path):
    """The config takes the norms' eps and offset as they are now: an edit of both comes
    back (it was the constructor's, 0.19 off after a reload); two that differ, which the
    config cannot hold, are a ValueError naming both, with no file written."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 32, 8, 0.0, 4, qk_norm="head").eval()
    m.q_norm.eps = m.k_norm.eps = 0.3
    path = tmp_path / "edited.safetensors"
    attnlab.save(m, path)
    loaded = attnlab.load(path).eval()
    assert (loaded.q_norm.eps, loaded.k_norm.eps) == (0.3, 0.3)
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), m(x), rtol=0, atol=0)
    m.k_norm.eps = 0.1
    with pytest.raises(ValueError, match=r"q_norm \(eps 0.3, offset 0.0\) and k_norm \(eps 0.1"):
        attnlab.save(m, tmp_path / "differing.safetensors")
    assert not (tmp_path / "differing.safetensors").exists()
