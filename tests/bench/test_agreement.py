"""attnlab.bench.agreement: outputs agree to their dtype's relative tolerance, ids exactly."""

import pytest
import torch

from attnlab.bench.agreement import differs


@pytest.mark.parametrize(
    ("dtype", "within", "beyond"), [(torch.float32, 9e-4, 2e-3), (torch.bfloat16, 3e-2, 1e-1)]
)
def test_floats_agree_relative_to_the_largest_value(dtype, within, beyond):
    reference = (torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)) * 1e-6).to(dtype)
    largest = reference.abs().max().float()
    near = reference.float().clone()
    near[0, 0, 0] += within * largest
    far = reference.float().clone()
    far[0, 0, 0] += beyond * largest
    assert differs(near.to(dtype), reference, "ref") == ""
    assert differs(far.to(dtype), reference, "ref").startswith("differs from ref's by ")


def test_integers_agree_exactly_and_say_where_they_part():
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    assert differs(ids.clone(), ids, "sdpa") == ""
    later = ids.clone()
    later[1, 3] = 9
    assert differs(later, ids, "sdpa") == "differs from sdpa's from token 3 on"
    assert differs(ids[:, :2], ids, "sdpa") == "differs from sdpa's in shape: (2, 2) against (2, 4)"
