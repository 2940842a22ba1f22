"""Decoder-only language models in Flax NNX.

One axis vocabulary, used in einsum strings, shape comments and sharding names everywhere:
  B batch, T query positions, S key positions, D model dim, N query heads, K kv heads,
  H head dim, F mlp hidden, V vocab, E experts, L layers, G group size, R LoRA rank.

Logical parameter axes (mapped to mesh axes by the tables in `jaxrl.mesh`):
  "vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "norm", "experts", "lora".
Logical activation axes (the model's `jaxrl.mesh.logical_constraint`s, same tables):
  "batch", "length", "act_embed", "act_heads", "act_kv_heads", "act_head_dim", "act_mlp",
  "act_vocab".
"""

from jaxrl.models.config import ModelConfig, RopeScaling
from jaxrl.models.transformer import Transformer, init_cache, make_model

__all__ = ["ModelConfig", "RopeScaling", "Transformer", "init_cache", "make_model"]
