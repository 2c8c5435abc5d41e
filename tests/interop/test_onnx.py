"""attnlab.interop.export_onnx: dynamic batch and token axes, causal and padding masks;
onnxruntime gives the module's outputs (atol 1e-5) on shapes other than the export
example's."""

import logging
import warnings

import pytest
import torch

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the optional extra attnlab[onnx]")
pytest.importorskip("onnxscript", reason="onnxscript is the optional extra attnlab[onnx]")

from attnlab import MultiHeadAttention, masks  # noqa: E402
from attnlab.interop import export_onnx  # noqa: E402


def _run(path, **inputs):
    session = ort.InferenceSession(str(path))
    return torch.from_numpy(session.run(None, {k: v.numpy() for k, v in inputs.items()})[0])


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(num_kv_heads=2, rope=True, qkv_bias=True), dict(window=5)],
    ids=["causal", "rope-gqa", "window"],
)
def test_onnxruntime_equals_the_module_on_other_shapes(tmp_path, kwargs):
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 16, 64, 0.0, 4, **kwargs).eval()
    path = export_onnx(module, tmp_path / "attention.onnx")
    for batch, tokens in ((1, 3), (3, 50)):  # the export example was (2, 8)
        x = torch.randn(batch, tokens, 16)
        with torch.no_grad():
            expected = module(x)
        torch.testing.assert_close(_run(path, x=x), expected, atol=1e-5, rtol=1e-5)


def test_padding_mask(tmp_path):
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 16, 64, 0.0, 2).eval()
    path = export_onnx(module, tmp_path / "padded.onnx", padding_mask=True)
    x = torch.randn(3, 20, 16)
    keep = torch.ones(3, 20, dtype=torch.bool)
    keep[1, :6], keep[2, :19] = False, False  # left padding; row 2 has one real token
    with torch.no_grad():
        expected = module(x, mask=masks.padding_mask(keep))
    got = _run(path, x=x, keep=keep)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match=r"attnlab\.MultiHeadAttention"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx")
    with pytest.raises(ValueError, match="self-attention"):
        export_onnx(MultiHeadAttention(8, 8, 16, 0.0, 2, context_dim=4), tmp_path / "x.onnx")


def test_export_is_quiet(tmp_path, capfd):
    """No exporter progress on stdout, no log lines or warnings on stderr, and torch.onnx's
    log level as it was."""
    logger = logging.getLogger("torch.onnx")
    before = logger.level
    module = MultiHeadAttention(8, 8, 16, 0.0, 2).eval()
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_onnx(module, tmp_path / "quiet.onnx", padding_mask=True)  # both inputs
    assert capfd.readouterr() == ("", "")
    assert [str(w.message) for w in caught] == []
    assert logger.level == before
