"""transformers' own GPT2Attention (an unannotated config: its module's GPT2Config) and
LlamaAttention, as `attnlab check FILE:LlamaAttention --init CONFIG`
finds it: built from its LlamaConfig with a layer index, called with the position
embeddings and the attention mask its model would make (tests/check/test_forms.py)."""

from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention

__all__ = ["GPT2Attention", "LlamaAttention"]
