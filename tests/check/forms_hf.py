"""transformers' own GPT2Attention (an unannotated config: its module's GPT2Config) and
LlamaAttention, as `attnlab check FILE:LlamaAttention --init CONFIG`
finds it: built from its LlamaConfig with a layer index, called with the position
embeddings and the attention mask its model would make (tests/check/test_forms.py); and a
LlamaAttention with a planted bug: the cache its model passes is dropped; Gemma2Attention
(a declared scale and score cap) and a copy that drops its cap."""

from transformers import Cache
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention

__all__ = [
    "GPT2Attention",
    "Gemma2Attention",
    "Gemma2AttentionIgnoringItsCap",
    "LlamaAttention",
    "LlamaAttentionDroppingItsCache",
]


class LlamaAttentionDroppingItsCache(LlamaAttention):
    """The bug: the cache is taken (under 5.24's name and the earlier one) and never passed
    on, so a call continuing a sequence attends to its own tokens alone."""

    def forward(
        self,
        hidden_states,
        position_embeddings=None,
        attention_mask=None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ):
        return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)


class Gemma2AttentionIgnoringItsCap(Gemma2Attention):
    """The bug: the layer drops the score cap its config declares (attn_logit_softcapping),
    as a port that forgets Gemma 2's tanh would."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx)
        self.attn_logit_softcapping = None
