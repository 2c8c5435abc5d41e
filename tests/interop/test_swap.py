"""attnlab.interop.swap: replace_modules and make_caches."""

import pytest
from torch import nn

from attnlab import MultiHeadAttention
from attnlab.interop import make_caches, replace_modules


def test_make_caches_gives_one_cache_per_layer_and_refuses_a_model_without_attnlab():
    model = nn.Sequential(
        MultiHeadAttention(8, 8, 16, 0.0, 2), MultiHeadAttention(8, 8, 16, 0.0, 2)
    )
    caches = make_caches(model, 3, 10)
    assert [(c.batch_size, c.max_tokens) for c in caches] == [(3, 10), (3, 10)]
    with pytest.raises(ValueError, match="holds no attnlab MultiHeadAttention"):
        make_caches(nn.Linear(2, 2), 1)


def test_replace_modules_replaces_what_it_picks_and_not_inside_it():
    inner = nn.Sequential(nn.Linear(2, 2))
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), inner))
    count = replace_modules(model, lambda m: isinstance(m, nn.Sequential), lambda m: nn.Identity())
    assert count == 1 and isinstance(model[1], nn.Identity) and isinstance(model[0], nn.Linear)
