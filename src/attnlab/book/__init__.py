"""The chapter, faithful: every class and step of the seed documents under the book's names.

These are attnlab's reference oracles. They reproduce the seeds' printed tensors under the
seeds' printed random seeds, and they depend on nothing of attnlab's production layer.
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

__all__ = [
    "INPUTS",
    "TOKENS",
    "CausalAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadSelfAttention",
    "QueryStep",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "TorchHeads",
    "additive_causal_mask",
    "all_context_vectors",
    "attention_for_query",
    "attention_scores",
    "attention_scores_for_query",
    "attention_scores_loop",
    "causal_future_mask",
    "causal_keep_mask",
    "causal_weights_additive",
    "causal_weights_neg_inf",
    "causal_weights_renormalised",
    "context_vector_loop",
    "copy_v2_weights_into_v1",
    "count_parameters",
    "dot_product_loop",
    "example_batch",
    "gpt2_small_attention",
    "heads_from_torch",
    "mask_future_scores",
    "normalize_by_sum",
    "scaled_softmax",
    "softmax_naive",
    "torch_attention_by_heads",
    "wrapper_with_2d_output",
]
