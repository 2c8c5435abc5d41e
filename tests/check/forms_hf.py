"""transformers' own LlamaAttention, as `attnlab check FILE:LlamaAttention --init CONFIG`
finds it: built from its LlamaConfig with a layer index, called with the position
embeddings and the attention mask its model would make (tests/check/test_forms.py)."""

from transformers.models.llama.modeling_llama import LlamaAttention

__all__ = ["LlamaAttention"]
