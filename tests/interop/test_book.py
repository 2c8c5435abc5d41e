"""attnlab.interop.book: the book's MultiHeadAttention converted both ways, configuration
and outputs kept; what the book's class cannot hold is refused by name."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnlab import MultiHeadAttention, book, interop


def test_from_book_keeps_configuration_and_outputs():
    torch.manual_seed(4)
    oracle = book.MultiHeadAttention(3, 4, 6, 0.25, 2, qkv_bias=True).eval()
    ours = interop.from_book(oracle).eval()
    assert (ours.d_in, ours.d_out, ours.context_length, ours.dropout, ours.num_heads) == (
        3,
        4,
        6,
        0.25,
        2,
    )
    x = book.example_batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), oracle(x), rtol=1e-5, atol=1e-6)


@given(
    num_kv_heads=st.sampled_from([1, 2, 4]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_to_book_gives_the_same_outputs_and_round_trips(num_kv_heads, bias, seed):
    """to_book is from_book's inverse: the book's class (grouped-query heads repeated)
    gives the production module's outputs, and from_book of it gives them again."""
    torch.manual_seed(seed)
    ours = MultiHeadAttention(6, 8, 10, 0.0, 4, qkv_bias=bias, num_kv_heads=num_kv_heads).eval()
    theirs = interop.to_book(ours).eval()
    assert isinstance(theirs, book.MultiHeadAttention)
    x = torch.randn(2, 7, 6)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), atol=1e-6, rtol=1e-5)
        back = interop.from_book(theirs).eval()
        torch.testing.assert_close(back(x), ours(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(causal=False), "causal=False"),
        (dict(rope=True), "rope=True"),
        (dict(window=3), "window=3"),
        (dict(context_dim=5), "context_dim=5 != d_in=6"),
    ],
)
def test_to_book_refuses_what_the_book_cannot_hold(kwargs, named):
    with pytest.raises(ValueError, match=named):
        interop.to_book(MultiHeadAttention(6, 8, 10, 0.0, 4, **kwargs))
    with pytest.raises(TypeError, match=r"m must be an attnlab\.MultiHeadAttention"):
        interop.to_book(nn.Linear(2, 2))


def test_swap_book_attention_takes_a_readers_own_copy_of_the_class_and_refuses_none():
    """has_book_layout: the chapter's class as a reader writes it (here: the book's own
    class's attributes on another class), swapped; a model without one is a ValueError."""
    from attnlab.interop import restore_book_attention, swap_book_attention

    class MyMultiHeadAttention(book.MultiHeadAttention):  # a reader's copy, same layout
        pass

    torch.manual_seed(0)
    model = nn.Sequential(MyMultiHeadAttention(8, 8, 16, 0.0, 2), nn.Linear(8, 8))
    x = torch.randn(2, 5, 8)
    want = model(x)
    assert swap_book_attention(model) == 1
    assert isinstance(model[0], MultiHeadAttention)
    torch.testing.assert_close(model(x), want)
    assert restore_book_attention(model) == 1
    torch.testing.assert_close(model(x), want)
    with pytest.raises(ValueError, match="holds no book MultiHeadAttention"):
        swap_book_attention(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="holds no attnlab MultiHeadAttention"):
        restore_book_attention(nn.Sequential(nn.Linear(2, 2)))


class ChapterMultiHeadAttention(nn.Module):
    """The chapter's class as the book writes it: neither d_in nor context_length kept, only
    the mask buffer (written afresh in its style)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        b, num_tokens, _ = x.shape
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context_vec = (self.dropout(attn_weights) @ values).transpose(1, 2)
        return self.out_proj(context_vec.contiguous().view(b, num_tokens, self.d_out))


def test_the_chapters_own_class_is_swapped_with_its_sizes_read_from_its_layers():
    from attnlab.interop import swap_book_attention

    torch.manual_seed(0)
    model = nn.Sequential(ChapterMultiHeadAttention(8, 8, 16, 0.0, 2, qkv_bias=True))
    x = torch.randn(2, 5, 8)
    want = model(x)
    assert swap_book_attention(model) == 1
    assert (model[0].d_in, model[0].context_length) == (8, 16)
    torch.testing.assert_close(model(x), want)
