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


def test_masked_cells_are_not_zeros():
    """What the plot is drawn from: a masked cell is masked data with no number, a weight
    that is zero stays a value reading 0.00."""
    weights = torch.tensor([[0.0, 0.0], [0.5, 0.5]])
    allowed = torch.tensor([[True, False], [True, True]])
    values, texts = viz.cells(weights, allowed)
    assert values.mask.tolist() == [[False, True], [False, False]]
    assert texts.tolist() == [["0.00", viz.MASKED_TEXT], ["0.50", "0.50"]]
    assert viz.MASKED_TEXT != "0.00"
    unmasked, texts = viz.cells(weights)
    assert not unmasked.mask.any() and texts[0, 1] == "0.00"


def test_allowed_must_be_a_bool_mask_of_the_weights_shape(tmp_path):
    with pytest.raises(TypeError, match=r"allowed must be a bool tensor, got torch\.float32"):
        viz.save_heatmap(torch.eye(2), ["x", "y"], tmp_path / "w.png", allowed=torch.eye(2))
    with pytest.raises(ValueError, match=r"allowed's shape \(3, 3\) must be the weights' \(2, 2\)"):
        viz.cells(torch.eye(2), torch.ones(3, 3, dtype=torch.bool))


def test_a_heatmap_with_masked_cells_and_a_note(tmp_path):
    allowed = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    path = viz.save_heatmap(
        torch.eye(3), ["a", "b", "c"], tmp_path / "m.png", allowed=allowed, note="a note " * 20
    )
    assert matplotlib.image.imread(path).ndim == 3
