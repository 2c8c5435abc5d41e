"""A zoo of attention modules as a reader of chapter 3 would type them, for `attnlab.check`.

Three are correct (the book's math exactly); every other class carries exactly one bug, marked
`# bug:` on its line and named in its docstring. Each is a plain nn.Module with the book's
constructor: single head (d_in, d_out, context_length, dropout, qkv_bias=False), multi-head
(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False); forward maps
(batch, tokens, d_in) to (batch, tokens, d_out). Only torch is imported: the zoo stands for
anyone's code, not attnlab's.

Apart from NoLengthCheck (the book's class as printed), every class with a mask buffer refuses
inputs longer than context_length with a ValueError, so that it has only its one bug.
At the end, CORRECT and BUGS say what `attnlab.check` must find in each class.
"""

import torch
import torch.nn.functional as F
from torch import nn


def _check_length(num_tokens, context_length):
    if num_tokens > context_length:
        raise ValueError(f"x has {num_tokens} tokens, more than context_length ({context_length})")


# --------------------------------------------------------------------------- correct


class BookCausalAttention(nn.Module):
    """Correct: the book's CausalAttention (listing 3.3) and a ValueError past context_length."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        num_tokens = x.shape[1]
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class BookMultiHeadAttention(nn.Module):
    """Correct: the book's MultiHeadAttention (listing 3.5) and a ValueError past context_length."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.context_length = context_length
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
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


class SdpaMultiHeadAttention(nn.Module):
    """Correct: nanoGPT-style fused qkv projection and F.scaled_dot_product_attention(is_causal)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.context_length = context_length  # stored only: is_causal needs no mask
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = dropout

    def forward(self, x):
        b, num_tokens, _ = x.shape
        queries, keys, values = self.qkv(x).split(self.d_out, dim=2)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        context_vec = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        context_vec = context_vec.transpose(1, 2).contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


# --------------------------------------------------------------------------- one bug each


class NoUnderscoreMaskedFill(nn.Module):
    """Bug (seed 001): masked_fill without the underscore; the result is dropped, nothing masked."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        num_tokens = x.shape[1]
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)  # bug: no _
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class InvertedSdpaMask(nn.Module):
    """Bug: passes the True-is-future mask as SDPA's attn_mask, where True means may attend."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = dropout
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        b, num_tokens, _ = x.shape
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        context_vec = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=self.mask.bool()[:num_tokens, :num_tokens],  # bug: True = future, inverted
            dropout_p=self.dropout if self.training else 0.0,
        )
        context_vec = context_vec.transpose(1, 2).contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


class MissingScale(nn.Module):
    """Bug: softmax of the raw scores, with no division by sqrt(d_k)."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        num_tokens = x.shape[1]
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores, dim=-1)  # bug: not scaled by sqrt(d_k)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class WrongScale(nn.Module):
    """Bug: multi-head scores scaled by sqrt(d_out) instead of sqrt(head_dim)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.context_length = context_length
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
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.d_out**0.5, dim=-1)  # bug: not head_dim
        attn_weights = self.dropout(attn_weights)

        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


class SoftmaxWrongDim(nn.Module):
    """Bug: softmax over dim=1 (the queries) instead of dim=-1 (the keys)."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        num_tokens = x.shape[1]
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=1)  # bug: dim=1
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class ViewWithoutTranspose(nn.Module):
    """Bug: heads split by view(b, h, t, hd) and merged by view, with no transpose either way."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.context_length = context_length
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
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        keys = keys.view(b, self.num_heads, num_tokens, self.head_dim)  # bug: no transpose
        queries = queries.view(b, self.num_heads, num_tokens, self.head_dim)  # bug: no transpose
        values = values.view(b, self.num_heads, num_tokens, self.head_dim)  # bug: no transpose

        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = attn_weights @ values
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)  # bug: no transpose
        return self.out_proj(context_vec)


class DropoutAlwaysOn(nn.Module):
    """Bug: functional dropout with training=True, so it drops weights in eval mode too."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout_p = dropout
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        num_tokens = x.shape[1]
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = torch.nn.functional.dropout(
            attn_weights,
            p=self.dropout_p,
            training=True,  # bug: should be self.training
        )
        return attn_weights @ values


class PlainAttributeMask(nn.Module):
    """Bug: the mask is a plain tensor attribute, not a register_buffer: .to() leaves it behind."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.mask = torch.triu(  # bug: a plain attribute, not register_buffer
            torch.ones(context_length, context_length), diagonal=1
        )

    def forward(self, x):
        num_tokens = x.shape[1]
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class BatchMixingSoftmax(nn.Module):
    """Bug: softmax over dim=0, normalising across the batch (masked the figure 3.20 way)."""

    # The mask is applied the chapter's first way (softmax, zero the future, renormalise the
    # rows): with -inf scores a softmax over the batch would be NaN everywhere, hiding the bug.

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        num_tokens = x.shape[1]
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=0)  # bug: dim=0
        mask_simple = 1.0 - self.mask[:num_tokens, :num_tokens]  # 1 on and below the diagonal
        masked_simple = attn_weights * mask_simple
        attn_weights = masked_simple / masked_simple.sum(dim=-1, keepdim=True)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class UnusedValueWeight(nn.Module):
    """Bug: values computed with W_key instead of W_value, so W_value never gets a gradient."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        num_tokens = x.shape[1]
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_key(x)  # bug: W_key, not W_value

        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class MaskNotSliced(nn.Module):
    """Bug: the whole context_length mask is used, unsliced: fewer tokens raise a torch error."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        num_tokens = x.shape[1]
        _check_length(num_tokens, self.context_length)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool(), -torch.inf)  # bug: not sliced to num_tokens
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class NoLengthCheck(nn.Module):
    """The book's class as printed: longer input than context_length raises a torch error
    (loud, not wrong: a warning)."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        num_tokens = x.shape[1]
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(  # no check that num_tokens <= context_length
            self.mask.bool()[:num_tokens, :num_tokens], -torch.inf
        )
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


# --------------------------------------------------------------------------- what must catch what

SINGLE = dict(d_in=8, d_out=8, context_length=6, dropout=0.0)
MULTI = dict(d_in=8, d_out=8, context_length=6, dropout=0.0, num_heads=2)

CORRECT = ["BookCausalAttention", "BookMultiHeadAttention", "SdpaMultiHeadAttention"]
# class name -> constructor kwargs for the correct classes
CORRECT_KWARGS = {
    "BookCausalAttention": SINGLE,
    "BookMultiHeadAttention": MULTI,
    "SdpaMultiHeadAttention": MULTI,
}
# class name -> (constructor kwargs, the property names that must fail, words the explanation
# must contain); the set holds the primary catch (other properties may fail as well)
BUGS = {
    "NoUnderscoreMaskedFill": (SINGLE, {"causal"}, "masked_fill"),
    "InvertedSdpaMask": (MULTI, {"causal"}, "inverted"),
    "MissingScale": (SINGLE, {"reference"}, "scale"),
    "WrongScale": (MULTI, {"reference"}, "scale"),
    "SoftmaxWrongDim": (SINGLE, {"reference"}, "softmax"),
    "ViewWithoutTranspose": (MULTI, {"reference"}, "transpose"),
    "DropoutAlwaysOn": (dict(SINGLE, dropout=0.5), {"dropout_modes"}, "dropout"),
    "PlainAttributeMask": (SINGLE, {"follows_to"}, "register_buffer"),
    "BatchMixingSoftmax": (SINGLE, {"batch_independent"}, "batch"),
    "UnusedValueWeight": (SINGLE, {"finite_gradients"}, "gradient"),
    "MaskNotSliced": (SINGLE, {"runs"}, "mask"),
}
# the book's class as printed: no failure, a warning for its loud limit past context_length
LOUD_LIMITS = {"NoLengthCheck": (SINGLE, "long_input")}
