"""transformers' own GPT2Attention (an unannotated config: its module's GPT2Config) and
LlamaAttention, as `attnlab check FILE:LlamaAttention --init CONFIG`
finds it: built from its LlamaConfig with a layer index, called with the position
embeddings and the attention mask its model would make (tests/check/test_forms.py); and a
LlamaAttention with a planted bug: the cache its model passes is dropped; Gemma2Attention
(a declared scale and score cap) and a copy that drops its cap; Qwen3Attention (per-head
query and key norms) and a copy that sets its scale to 1; FalconAttention (its forward takes
`alibi`, None without ALiBi as its model passes it); a LlamaAttention whose rotation swaps
the convention (interleaved pairs turned with the model's rotate_half tables)."""

import torch
from transformers import Cache
from transformers.models.falcon.modeling_falcon import FalconAttention
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

__all__ = [
    "FalconAttention",
    "GPT2Attention",
    "Gemma2Attention",
    "Gemma2AttentionIgnoringItsCap",
    "LlamaAttention",
    "LlamaAttentionDroppingItsCache",
    "LlamaAttentionInterleaved",
    "Qwen3Attention",
    "Qwen3AttentionUnscaled",
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


class Qwen3AttentionUnscaled(Qwen3Attention):
    """The bug: the scores are not scaled (a port setting `scaling` to 1)."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx)
        self.scaling = 1.0


def rotate_every_two(x):
    """GPT-J's turn: interleaved pairs (2i, 2i + 1) -> (-x[2i + 1], x[2i])."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class LlamaAttentionInterleaved(LlamaAttention):
    """The bug: a port that turns interleaved pairs (GPT-J's rotate_every_two) with the
    tables Llama's model makes for rotate_half (cat(freqs, freqs))."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (b, 1, t, hd)
        query = query * cos + rotate_every_two(query) * sin
        key = key * cos + rotate_every_two(key) * sin
        out, weights = eager_attention_forward(
            self, query, key, value, attention_mask, scaling=self.scaling
        )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
