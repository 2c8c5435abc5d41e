"""attnlab bench --padded: the stacks it times compute the same thing on both backends, and
the command runs end to end with every ratio in its JSON."""

import json

import torch

from attnlab import masks
from attnlab.bench import padded
from attnlab.cli import main


def test_both_backends_compute_the_same_padded_forward():
    sizes = padded.QUICK_PADDED
    lengths = padded.left_padded_lengths(sizes["batch"], sizes["tokens"])
    keep = torch.arange(sizes["tokens"]) >= (sizes["tokens"] - torch.tensor(lengths))[:, None]
    x = torch.randn(sizes["batch"], sizes["tokens"], sizes["d_model"])
    outs = []
    for backend in padded.BACKENDS:
        forward = padded._model_call(padded._stack(sizes, backend), x, masks.padding_mask(keep))
        outs.append(forward())
    real = keep[:, :, None]  # (b, t, 1): padded queries attend to nothing, then the MLP
    torch.testing.assert_close(outs[0] * real, outs[1] * real, atol=1e-4, rtol=1e-4)


def test_the_command_writes_every_ratio(tmp_path, capsys):
    path = tmp_path / "padded.json"
    assert main(["bench", "--padded", "--quick", "--json", str(path)]) == 0
    figures = json.loads(path.read_text())
    assert figures["lengths"] == padded.left_padded_lengths(4, 64)
    assert len(figures["ratios"]) == 8 and all(r > 0 for r in figures["ratios"].values())
    assert "padded / unpadded" in capsys.readouterr().out
