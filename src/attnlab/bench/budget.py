"""The memory a bench run will need, estimated from its sizes before anything is allocated,
and the memory the machine has: `attnlab bench` refuses a run that cannot fit instead of
allocating until the system kills it.

The estimates are deliberately low (the tensors each mode certainly holds at its peak, not
the allocator's slack or Python's own memory), so that a refused run is a run that could not
have finished; a run that passes can still be tight.

Models (b batch, t tokens, d model width, h heads, s bytes per element, L layers):

- compare: 8 b t d s (input, q, k, v, output and their gradients) plus, for the peers that
  hold (b, h, t, t) float32 scores and are not skipped for exceeding `max_bytes`, twice those
  scores (the scores and their softmax), plus the reference matmul's three matrices.
- memory: the same for batch 1 at its longest context: the forward's 4 b t d s, and the
  attention core's forward + backward, which holds q, k, v, the output and its gradient,
  and the gradients of q, k and v (8 b t d s).
- decode: L layers of cache for the longest context, 2 t d s each, plus the recomputation
  of that context through one layer, 8 t d s, plus the weights, 4 d^2 s per layer.
- hf: per element, the two models' weights and gradients, 4 (12 L d^2 + V d) (their
  layers' matrices and the embedding), and the logits, their gradient and a copy, 3 b t V,
  at the forward's (batch, tokens), s bytes each.
- parallel: one process holding the whole sequence, 8 t d s, then N processes, each with
  its 1/N share (8 t d s / N) and the torch runtime of a process (PROCESS_BYTES).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab import _memory

PROCESS_BYTES = 200 * 2**20  # a spawned Python process with torch imported, at the least
SCORE_ITEMSIZE = 4  # the materialising peers hold float32 scores
MAX_SCORE_BYTES = 2 * 2**30  # as attnlab.bench.memory.DEFAULT_MAX_BYTES: larger is skipped


@dataclass(frozen=True)
class Sizes:
    """The sizes one bench run uses: batch, tokens, model width, heads, element bytes."""

    batch: int
    tokens: int
    d_model: int
    num_heads: int
    itemsize: int

    @property
    def activation_bytes(self) -> int:
        """Bytes of one (b, t, d) tensor."""
        return self.batch * self.tokens * self.d_model * self.itemsize

    @property
    def score_bytes(self) -> int:
        """Bytes of one float32 (b, h, t, t) score tensor."""
        return self.batch * self.num_heads * self.tokens**2 * SCORE_ITEMSIZE


def compare_bytes(sizes: Sizes, *, matmul_size: int, max_bytes: int = MAX_SCORE_BYTES) -> int:
    """Peak estimate of the peer comparison (module docstring)."""
    scores = 2 * sizes.score_bytes if sizes.score_bytes <= max_bytes else 0
    return 8 * sizes.activation_bytes + scores + 3 * matmul_size**2 * sizes.itemsize


def memory_bytes(sizes: Sizes, *, max_bytes: int) -> int:
    """Peak estimate of the memory table at its longest context (module docstring)."""
    scores = 2 * sizes.score_bytes if sizes.score_bytes <= max_bytes else 0
    return max(4 * sizes.activation_bytes + scores, 8 * sizes.activation_bytes)


def decode_bytes(context: int, *, d_model: int, layers: int, itemsize: int, batch: int = 8) -> int:
    """Peak estimate of decoding at the longest context (module docstring): every layer's
    weights and its cache for the largest batch the steps table runs."""
    per_token = d_model * itemsize
    weights = 4 * d_model * d_model * itemsize
    return layers * (2 * batch * context * per_token + weights) + 8 * context * per_token


def hf_bytes(
    batch: int, tokens: int, *, d_model: int, layers: int, vocab: int, itemsize: int
) -> int:
    """Peak estimate of the transformers models' run (module docstring)."""
    weights = 12 * layers * d_model**2 + vocab * d_model
    return (4 * weights + 3 * batch * tokens * vocab) * itemsize


def parallel_bytes(world: int, tokens: int, *, d_model: int, itemsize: int) -> int:
    """Peak estimate of the ring benchmark over `world` processes (module docstring)."""
    whole = 8 * tokens * d_model * itemsize
    return whole + world * PROCESS_BYTES + whole


available_bytes = _memory.available_bytes  # the one reading, owned by attnlab._memory
