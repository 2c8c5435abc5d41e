"""attnlab.qkv through MultiHeadAttention.qkv_weights / load_qkv_weights: the one public
way to the query/key/value weights, in either projection layout."""

import pytest
import torch

from attnlab import MultiHeadAttention


@pytest.mark.parametrize("context_dim", [None, 5])
def test_qkv_weights_read_and_write_either_layout(context_dim):
    """The module's one public way to the query/key/value weights: views of the fused or
    the split layout, and load_qkv_weights writes them back (shapes checked first)."""
    torch.manual_seed(2)
    m = MultiHeadAttention(6, 8, 10, 0.0, 4, qkv_bias=True, num_kv_heads=2, context_dim=context_dim)
    w = m.qkv_weights()
    width = 6 if context_dim is None else context_dim
    assert w.q_weight.shape == (8, 6) and w.k_weight.shape == w.v_weight.shape == (4, width)
    assert w.q_bias.shape == (8,) and w.v_bias.shape == (4,)
    fresh = [torch.randn_like(t) for t in w]
    m.load_qkv_weights(type(w)(*fresh))
    for new, now in zip(fresh, m.qkv_weights(), strict=True):
        assert torch.equal(new, now)
    with pytest.raises(ValueError, match=r"weights.k_weight has shape \(3, 6\)"):
        m.load_qkv_weights(w._replace(k_weight=torch.zeros(3, 6)))
    with pytest.raises(ValueError, match=r"weights\.q_bias has shape None"):
        m.load_qkv_weights(w._replace(q_bias=None))
