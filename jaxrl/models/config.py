"""ModelConfig: the shape of a decoder-only transformer, with presets for real checkpoints."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_KINDS = ("llama3",)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling; "llama3" is HF `_compute_llama3_parameters` (Llama 3.1 / 3.2)."""

  kind: str = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192

  def __post_init__(self):
    if self.kind not in _ROPE_KINDS:
      raise ValueError(f"model.rope_scaling.kind={self.kind!r}; allowed: {_ROPE_KINDS}")
    if self.factor <= 0:
      raise ValueError(f"model.rope_scaling.factor={self.factor} must be > 0")
    if not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ValueError(
        f"model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
        f"{self.low_freq_factor} and {self.high_freq_factor}"
      )
    _positive("rope_scaling.original_max_position", self.original_max_position)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Qwen3 / Llama-family decoder shape. Sizes use the axis letters of `jaxrl.models`."""

  vocab_size: int  # V
  num_layers: int  # L
  embed_dim: int  # D
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  mlp_dim: int  # F
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  qk_norm: bool = False
  tie_embeddings: bool = True
  qkv_bias: bool = False  # Qwen2 / Qwen2.5: biases on the q, k and v projections
  rope_scaling: RopeScaling | None = None
  max_seq_len: int = 2048
  dtype: str = "float32"  # activations / compute
  param_dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "embed_dim", "num_heads", "num_kv_heads"):
      _positive(name, getattr(self, name))
    for name in ("head_dim", "mlp_dim", "max_seq_len"):
      _positive(name, getattr(self, name))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"model.num_heads={self.num_heads} must be a multiple of "
        f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention)"
      )
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")
    if self.rope_theta <= 0 or self.norm_eps <= 0:
      raise ValueError("model.rope_theta and model.norm_eps must be > 0")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(
        f"model.rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}"
      )
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"model.{name}={getattr(self, name)!r}; allowed: {_DTYPES}")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self):
    return jnp.dtype(self.param_dtype)

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  @classmethod
  def tiny(cls, vocab_size: int = 259) -> ModelConfig:
    """Odd, prime-ish sizes so transposition bugs show; for tests."""
    return cls(
      vocab_size=vocab_size,
      num_layers=2,
      embed_dim=48,
      num_heads=6,
      num_kv_heads=2,
      head_dim=14,
      mlp_dim=82,
      qk_norm=True,
      tie_embeddings=False,
      max_seq_len=128,
    )

  @classmethod
  def arith_small(cls, vocab_size: int = 259) -> ModelConfig:
    """The embedded default: a ~1M-parameter Qwen3-shaped model for byte-level arithmetic."""
    return cls(
      vocab_size=vocab_size,
      num_layers=4,
      embed_dim=128,
      num_heads=4,
      num_kv_heads=2,
      head_dim=32,
      mlp_dim=384,
      qk_norm=True,
      tie_embeddings=True,
      max_seq_len=64,
    )

  @classmethod
  def qwen3_0p6b(cls) -> ModelConfig:
    """Qwen/Qwen3-0.6B."""
    return cls(
      vocab_size=151_936,
      num_layers=28,
      embed_dim=1024,
      num_heads=16,
      num_kv_heads=8,
      head_dim=128,
      mlp_dim=3072,
      rope_theta=1_000_000.0,
      qk_norm=True,
      tie_embeddings=True,
      max_seq_len=40_960,
      dtype="bfloat16",
      param_dtype="bfloat16",
    )

  @classmethod
  def llama3p2_1b(cls) -> ModelConfig:
    """meta-llama/Llama-3.2-1B (llama3 RoPE scaling, factor 32, from its config.json)."""
    return cls(
      vocab_size=128_256,
      num_layers=16,
      embed_dim=2048,
      num_heads=32,
      num_kv_heads=8,
      head_dim=64,
      mlp_dim=8192,
      rope_theta=500_000.0,
      rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
      norm_eps=1e-5,
      tie_embeddings=True,
      max_seq_len=131_072,
      dtype="bfloat16",
      param_dtype="bfloat16",
    )


PRESETS = {
  "tiny": ModelConfig.tiny,
  "arith_small": ModelConfig.arith_small,
  "qwen3_0p6b": ModelConfig.qwen3_0p6b,
  "llama3p2_1b": ModelConfig.llama3p2_1b,
}


def from_preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"model.preset={name!r} is unknown; allowed: {sorted(PRESETS)}")
  return PRESETS[name]().replace(**overrides)


def _positive(name: str, value: int) -> None:
  if not isinstance(value, int) or value <= 0:
    raise ValueError(f"model.{name} must be a positive int, got {value!r}")
