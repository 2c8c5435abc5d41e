"""Properties any causal attention module must have, as reusable assertions."""

import torch


def assert_causal(module, x: torch.Tensor, t: int) -> None:
    """Changing the tokens after position t must leave the outputs up to t unchanged."""
    if not 0 <= t < x.shape[1] - 1:
        raise ValueError(f"t ({t}) must leave a later token to change (tokens: {x.shape[1]})")
    changed = x.clone()
    changed[:, t + 1 :] = torch.randn_like(changed[:, t + 1 :]) * 3
    with torch.no_grad():
        torch.testing.assert_close(
            module(changed)[:, : t + 1], module(x)[:, : t + 1], rtol=1e-5, atol=1e-6
        )


def assert_leaks(module, x: torch.Tensor, t: int) -> None:
    """The opposite: some output up to t moves when a later token changes."""
    if not 0 <= t < x.shape[1] - 1:
        raise ValueError(f"t ({t}) must leave a later token to change (tokens: {x.shape[1]})")
    changed = x.clone()
    changed[:, t + 1 :] += 1.0
    with torch.no_grad():
        assert not torch.allclose(module(changed)[:, : t + 1], module(x)[:, : t + 1], atol=1e-4)


def assert_batch_independent(module, x: torch.Tensor) -> None:
    """Each batch row's output equals the output of that row alone."""
    with torch.no_grad():
        together = module(x)
        for i in range(x.shape[0]):
            torch.testing.assert_close(
                together[i : i + 1], module(x[i : i + 1]), rtol=1e-5, atol=1e-6
            )
