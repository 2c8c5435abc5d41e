"""attnlab.check.weights: which weights a constructor leaves unset, and their filling."""

import math

import pytest
import torch
from torch import nn

from attnlab.check.weights import fill_unset, unseeded


class Unset(nn.Module):
    """A projection over torch.empty (what init_method=identity leaves), and a seeded one."""

    def __init__(self, fill: float | None = None):
        super().__init__()
        self.seeded = nn.Linear(6, 4)
        self.raw = nn.Parameter(torch.empty(4, 6))
        if fill is not None:
            with torch.no_grad():
                self.raw.fill_(fill)


def _two_builds(make):
    state = torch.random.get_rng_state()
    first = make()
    torch.random.set_rng_state(state)
    return first, make()


def test_a_weight_the_seed_does_not_set_is_found_by_a_second_build():
    class Drawn(nn.Module):  # a counter-based init: differs at every build
        count = 0

        def __init__(self):
            super().__init__()
            Drawn.count += 1
            self.seeded = nn.Linear(6, 4)
            self.raw = nn.Parameter(torch.full((4, 6), float(Drawn.count)))

    first, second = _two_builds(Drawn)
    assert unseeded(first, second) == {"raw"}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3e38, 0.0])
def test_a_nonfinite_huge_or_zero_matrix_is_filled(value):
    module = Unset(value)
    seeded = module.seeded.weight.detach().clone()
    assert fill_unset(module, 0, set()) == ["raw"]
    bound = 1 / math.sqrt(6)
    assert (
        bool(torch.isfinite(module.raw.detach()).all())
        and float(module.raw.detach().abs().max()) <= bound
    )
    assert float(module.raw.detach().std()) > bound / 4  # spread, not a constant
    assert torch.equal(module.seeded.weight, seeded)  # a set weight is left as it is


def test_the_filling_is_the_same_at_every_build_and_differs_by_seed_and_name():
    first, second, other = Unset(float("nan")), Unset(float("nan")), Unset(float("nan"))
    fill_unset(first, 3, set())
    fill_unset(second, 3, set())
    fill_unset(other, 4, set())
    assert torch.equal(first.raw, second.raw) and not torch.equal(first.raw, other.raw)


def test_plausible_values_are_filled_only_when_named_unseeded():
    module = Unset(0.25)
    before = module.raw.detach().clone()
    assert fill_unset(module, 0, set()) == []
    assert torch.equal(module.raw, before)
    assert fill_unset(module, 0, {"raw"}) == ["raw"] and not torch.equal(module.raw, before)


def test_vectors_and_integer_parameters_are_left_alone():
    module = nn.Module()
    module.gain = nn.Parameter(torch.zeros(5))  # a zero-initialised gate is a design choice
    module.table = nn.Parameter(torch.zeros(3, 3, dtype=torch.int64), requires_grad=False)
    assert fill_unset(module, 0, {"gain", "table"}) == []
