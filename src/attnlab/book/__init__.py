"""The chapter, faithful: every class and step of the book chapter "Coding attention
mechanisms" (sections 3.3-3.6, exercises 3.1-3.3), and the per-head layer of the
self-attention blog post, under their own names, signatures and parameter order.

These are attnlab's reference oracles. They reproduce the tensors the chapter prints under
the random seeds it sets, and they depend on nothing of attnlab's production layer.
"""

from attnlab.book.causal import (
    CausalAttention,
    additive_causal_mask,
    causal_future_mask,
    causal_keep_mask,
    causal_weights_additive,
    causal_weights_neg_inf,
    causal_weights_renormalised,
    mask_future_scores,
)
from attnlab.book.data import INPUTS, TOKENS, example_batch
from attnlab.book.multihead import (
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    count_parameters,
    gpt2_small_attention,
    wrapper_with_2d_output,
)
from attnlab.book.per_head import (
    MultiHeadSelfAttention,
    TorchHeads,
    heads_from_torch,
    torch_attention_by_heads,
)
from attnlab.book.simple import (
    all_context_vectors,
    attention_scores,
    attention_scores_for_query,
    attention_scores_loop,
    context_vector_loop,
    dot_product_loop,
    normalize_by_sum,
    softmax_naive,
)
from attnlab.book.trainable import (
    QueryStep,
    SelfAttention_v1,
    SelfAttention_v2,
    attention_for_query,
    copy_v2_weights_into_v1,
    scaled_softmax,
)

__all__ = [  # noqa: RUF022 - in the chapter's order, which the API reference follows
    # the running example
    "INPUTS",
    "TOKENS",
    "example_batch",
    # 3.3 self-attention without trainable weights
    "dot_product_loop",
    "attention_scores_for_query",
    "attention_scores_loop",
    "attention_scores",
    "normalize_by_sum",
    "softmax_naive",
    "context_vector_loop",
    "all_context_vectors",
    # 3.4 trainable weights
    "scaled_softmax",
    "QueryStep",
    "attention_for_query",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "copy_v2_weights_into_v1",
    # 3.5 causal attention and dropout
    "causal_keep_mask",
    "causal_future_mask",
    "additive_causal_mask",
    "causal_weights_renormalised",
    "mask_future_scores",
    "causal_weights_neg_inf",
    "causal_weights_additive",
    "CausalAttention",
    # 3.6 multi-head attention
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
    "wrapper_with_2d_output",
    "gpt2_small_attention",
    "count_parameters",
    # the blog post's per-head layer
    "MultiHeadSelfAttention",
    "TorchHeads",
    "heads_from_torch",
    "torch_attention_by_heads",
]
