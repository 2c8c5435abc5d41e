"""Heatmaps: a readable PNG for square and rectangular weights, and clear errors."""

import matplotlib.image
import pytest
import torch

from attnlab import viz


def test_square_and_cross_attention_heatmaps(tmp_path):
    weights = torch.softmax(torch.randn(3, 5), dim=-1)
    path = viz.save_heatmap(
        weights,
        ["a", "b", "c"],
        tmp_path / "sub" / "w.png",
        title="t",
        key_labels=["k1", "k2", "k3", "k4", "k5"],
    )
    assert matplotlib.image.imread(path).ndim == 3
    square = viz.save_heatmap(torch.eye(2), ["x", "y"], tmp_path / "sq.png")
    assert square.stat().st_size > 1000


def test_labels_must_match_the_weights(tmp_path):
    with pytest.raises(ValueError, match=r"labels \(2\) and key_labels \(2\).*\(3, 3\)"):
        viz.save_heatmap(torch.eye(3), ["a", "b"], tmp_path / "w.png")
    with pytest.raises(ValueError, match=r"weights must have shape \(queries, keys\)"):
        viz.save_heatmap(torch.ones(3), ["a", "b", "c"], tmp_path / "w.png")


def test_returns_the_file_it_wrote_and_refuses_folders(tmp_path):
    path = viz.save_heatmap(torch.eye(2), ["x", "y"], tmp_path / "no_suffix")
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="is a folder"):
        viz.save_heatmap(torch.eye(2), ["x", "y"], tmp_path)
    with pytest.raises(TypeError, match="labels must be a sequence"):
        viz.save_heatmap(torch.eye(2), None, tmp_path / "w.png")
