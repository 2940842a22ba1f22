"""ModelConfig: the shape of a decoder-only transformer, with presets for real checkpoints."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl.kernels import KERNELS

DTYPES = ("float32", "bfloat16", "float16")
_ROPE_KINDS = ("llama3", "linear")
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF `layer_types` names
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# Projections a LoRA adapter can wrap: attention q/k/v/o and the dense (not MoE) gated MLP.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# Activation rematerialisation of each block on the backward pass (`jax.checkpoint`): "none"
# keeps every activation; "full" keeps only each block's input and recomputes the rest; the
# others are the `jax.checkpoint_policies` of the same name (keep matmul outputs, or those
# without batch dimensions, i.e. MaxText's "minimal"; recompute the elementwise rest).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling; "llama3" is HF `_compute_llama3_parameters` (Llama 3.1 / 3.2),
  "linear" divides every frequency by `factor` (Gemma 3 4B+ global layers; other fields unused)."""

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
  # Gemma 3. The defaults are off, so other families (and their seeded inits) are unchanged.
  layer_types: tuple[str, ...] | None = None  # per layer, from LAYER_TYPES; None: all full
  sliding_window: int | None = None  # sliding layers: query i sees keys j with i - W < j <= i
  rope_local_theta: float | None = None  # RoPE base of sliding layers (None: rope_theta)
  query_pre_attn_scalar: float | None = None  # scores scaled by this**-0.5 (None: head_dim)
  mlp_activation: str = "silu"  # gated-MLP activation, from MLP_ACTIVATIONS
  zero_centered_norms: bool = False  # RMSNorm weights w stored zero-centred: y = x/rms * (1 + w)
  post_norms: bool = False  # also norm the attention and MLP outputs before each residual add
  scale_embeddings: bool = False  # token embeddings times sqrt(embed_dim)
  final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)
  attn_logit_softcap: float | None = None  # attention scores = c * tanh(scores / c)
  # Mixture of experts (Qwen3-MoE, Mixtral). num_experts=0 keeps the dense MLP (and its init).
  num_experts: int = 0  # E
  experts_per_token: int = 0  # top k of the router
  moe_mlp_dim: int = 0  # F of each expert
  norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
  # LoRA (jaxrl.models.lora): y = x W + (lora_alpha / lora_rank) (x A) B on each target
  # projection. lora_rank=0 is off and leaves the model (and its seeded init) unchanged.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = LORA_TARGETS
  # How the learner's forward (no KV cache) runs the blocks; neither changes the params, their
  # per-layer layout or the sampler. scan_layers: one `jax.lax.scan` over the layers, so compile
  # time stays flat in depth (see `jaxrl.models.transformer.Transformer`). remat: a name from
  # REMAT_POLICIES, applied to each block. logits_chunk: tokens per chunk of the log-prob head
  # (`token_logprobs`): the [tokens, V] logits are made, and remade on the backward pass, one
  # chunk at a time; 0 makes the whole batch's at once.
  scan_layers: bool = False
  remat: str = "none"
  logits_chunk: int = 0
  # Which implementation each kernel call site runs (jaxrl.kernels.KERNELS lists the choices):
  # the rollout engine's paged attention, the MoE experts' grouped matmul, a quantized
  # sampler's W8A8 projections. "reference" is pure jnp / XLA (every backend); "pallas_*" a
  # Pallas kernel, compiled for its accelerator, or run through the Pallas interpreter on any
  # backend with kernel_interpret (slow: tests). None of them changes the params.
  attention_kernel: str = "reference"
  moe_kernel: str = "reference"
  matmul_kernel: str = "reference"
  kernel_interpret: bool = False

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
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"model.{name}={getattr(self, name)!r}; allowed: {DTYPES}")
    self._validate_gemma_fields()
    self._validate_moe_fields()
    self._validate_lora_fields()
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"model.scan_layers must be True or False, got {self.scan_layers!r}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r}; allowed: {REMAT_POLICIES}")
    chunk = self.logits_chunk
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
      raise ValueError(
        f"model.logits_chunk={chunk!r} must be an int >= 0 (tokens per chunk of the log-prob "
        "head; 0: all tokens' logits at once)"
      )
    for name, allowed in KERNELS.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f"model.{name}={getattr(self, name)!r}; allowed: {allowed}")
    if not isinstance(self.kernel_interpret, bool):
      got = self.kernel_interpret
      raise ValueError(f"model.kernel_interpret must be True or False, got {got!r}")
    h = self.head_dim
    if self.attention_kernel == "pallas_gpu" and not self.kernel_interpret and h & (h - 1):
      # Triton's lowering takes power-of-two array sizes only (tests/kernels/lowering_test.py).
      raise ValueError(
        f"model.attention_kernel='pallas_gpu' needs a power-of-two model.head_dim for JAX's "
        f"Triton paged-attention kernel; this model's is {h}: use 'reference' (or "
        "kernel_interpret=True, the Pallas interpreter)"
      )

  def _validate_gemma_fields(self):
    if self.layer_types is not None:
      # ConfigDicts hand over lists; the config must stay hashable (it is a static jit argument).
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
      if len(self.layer_types) != self.num_layers:
        raise ValueError(
          f"model.layer_types has {len(self.layer_types)} entries; "
          f"model.num_layers={self.num_layers} needs one per layer"
        )
      bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
      if bad:
        raise ValueError(f"model.layer_types has {bad}; allowed: {LAYER_TYPES}")
    has_sliding = "sliding_attention" in (self.layer_types or ())
    if self.sliding_window is not None:
      _positive("sliding_window", self.sliding_window)
      if not has_sliding:
        raise ValueError(
          f"model.sliding_window={self.sliding_window} is set but model.layer_types has no "
          "'sliding_attention' layer"
        )
    elif has_sliding:
      raise ValueError("model.layer_types has 'sliding_attention' layers; set model.sliding_window")
    for name in ("rope_local_theta", "query_pre_attn_scalar"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"model.{name}={value} must be > 0 (or None)")
    for name in ("final_logit_softcap", "attn_logit_softcap"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"model.{name}={value} must be > 0 (or None: no soft-capping)")
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"model.mlp_activation={self.mlp_activation!r}; allowed: {MLP_ACTIVATIONS}")

  def _validate_moe_fields(self):
    if not isinstance(self.num_experts, int) or self.num_experts < 0:
      raise ValueError(f"model.num_experts must be an int >= 0 (0: dense); got {self.num_experts}")
    if self.num_experts == 0:
      for name in ("experts_per_token", "moe_mlp_dim"):
        if getattr(self, name):
          raise ValueError(f"model.{name}={getattr(self, name)} needs model.num_experts > 0")
      return
    k = self.experts_per_token
    if not isinstance(k, int) or not 1 <= k <= self.num_experts:
      raise ValueError(
        f"model.experts_per_token={k!r} must be an int in [1, model.num_experts={self.num_experts}]"
      )
    _positive("moe_mlp_dim", self.moe_mlp_dim)

  def _validate_lora_fields(self):
    if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
      raise ValueError(f"model.lora_rank must be an int >= 0 (0: no LoRA); got {self.lora_rank!r}")
    if not self.lora_alpha > 0:
      raise ValueError(f"model.lora_alpha={self.lora_alpha!r} must be > 0")
    if isinstance(self.lora_targets, str):
      raise ValueError(
        f"model.lora_targets={self.lora_targets!r} must be a sequence of names from {LORA_TARGETS}"
      )
    object.__setattr__(self, "lora_targets", tuple(self.lora_targets))  # hashable, as layer_types
    bad = [t for t in self.lora_targets if t not in LORA_TARGETS]
    if bad:
      raise ValueError(f"model.lora_targets has unknown {bad}; allowed: {LORA_TARGETS}")
    if len(set(self.lora_targets)) != len(self.lora_targets):
      raise ValueError(f"model.lora_targets={self.lora_targets} repeats a name")
    if not self.lora_rank:
      return
    if not self.lora_targets:
      raise ValueError(f"model.lora_rank={self.lora_rank} needs at least one model.lora_targets")
    # Expert weights are not adapted (a per-expert adapter is E adapters, not one); every layer
    # of a jaxrl MoE model is sparse, so MLP targets there would silently adapt nothing.
    mlp = [t for t in self.lora_targets if t in ("gate", "up", "down")]
    if self.num_experts and mlp:
      raise ValueError(
        f"model.lora_targets has MLP targets {mlp} but model.num_experts={self.num_experts}: "
        "MoE expert weights are not LoRA targets; allowed here: ('q', 'k', 'v', 'o')"
      )

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of layer `layer`, or None where it attends to everything before it."""
    if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
      return self.sliding_window
    return None

  def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of layer `layer`: sliding layers use their own base and no scaling."""
    if self.layer_window(layer) is not None:
      return self.rope_local_theta or self.rope_theta, None
    return self.rope_theta, self.rope_scaling

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
  def tiny_moe(cls, vocab_size: int = 259) -> ModelConfig:
    """`tiny` with a Qwen3-MoE-style sparse MLP (5 experts, top 2): MoE pipelines on a CPU."""
    return cls.tiny(vocab_size).replace(num_experts=5, experts_per_token=2, moe_mlp_dim=22)

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
  def arith_small_moe(cls, vocab_size: int = 259) -> ModelConfig:
    """`arith_small` with a Qwen3-MoE-shaped MLP: 8 experts of width 96, top 2 (renormalised),
    so each token runs half the dense model's MLP width out of twice its MLP parameters."""
    return cls.arith_small(vocab_size).replace(num_experts=8, experts_per_token=2, moe_mlp_dim=96)

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
      param_dtype="float32",  # master weights; compute in dtype
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
      param_dtype="float32",  # master weights; compute in dtype
    )

  @classmethod
  def llama3p2_3b(cls) -> ModelConfig:
    """meta-llama/Llama-3.2-3B (and -Instruct; llama3 RoPE scaling, factor 32)."""
    return cls(
      vocab_size=128_256,
      num_layers=28,
      embed_dim=3072,
      num_heads=24,
      num_kv_heads=8,
      head_dim=128,
      mlp_dim=8192,
      rope_theta=500_000.0,
      rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
      norm_eps=1e-5,
      tie_embeddings=True,
      max_seq_len=131_072,
      dtype="bfloat16",
      param_dtype="float32",  # master weights; compute in dtype
    )

  @classmethod
  def qwen2p5_0p5b_instruct(cls) -> ModelConfig:
    """Qwen/Qwen2.5-0.5B-Instruct (q/k/v biases, no QK-norm)."""
    return cls(
      vocab_size=151_936,
      num_layers=24,
      embed_dim=896,
      num_heads=14,
      num_kv_heads=2,
      head_dim=64,
      mlp_dim=4864,
      rope_theta=1_000_000.0,
      norm_eps=1e-6,
      qkv_bias=True,
      tie_embeddings=True,
      max_seq_len=32_768,
      dtype="bfloat16",
      param_dtype="float32",  # master weights; compute in dtype
    )

  @classmethod
  def qwen2p5_1p5b_instruct(cls) -> ModelConfig:
    """Qwen/Qwen2.5-1.5B-Instruct (q/k/v biases, no QK-norm)."""
    return cls(
      vocab_size=151_936,
      num_layers=28,
      embed_dim=1536,
      num_heads=12,
      num_kv_heads=2,
      head_dim=128,
      mlp_dim=8960,
      rope_theta=1_000_000.0,
      norm_eps=1e-6,
      qkv_bias=True,
      tie_embeddings=True,
      max_seq_len=32_768,
      dtype="bfloat16",
      param_dtype="float32",  # master weights; compute in dtype
    )

  @classmethod
  def qwen3_1p7b(cls) -> ModelConfig:
    """Qwen/Qwen3-1.7B."""
    return cls(
      vocab_size=151_936,
      num_layers=28,
      embed_dim=2048,
      num_heads=16,
      num_kv_heads=8,
      head_dim=128,
      mlp_dim=6144,
      rope_theta=1_000_000.0,
      qk_norm=True,
      tie_embeddings=True,
      max_seq_len=40_960,
      dtype="bfloat16",
      param_dtype="float32",  # master weights; compute in dtype
    )

  @classmethod
  def qwen3_8b(cls) -> ModelConfig:
    """Qwen/Qwen3-8B (untied output head)."""
    return cls(
      vocab_size=151_936,
      num_layers=36,
      embed_dim=4096,
      num_heads=32,
      num_kv_heads=8,
      head_dim=128,
      mlp_dim=12_288,
      rope_theta=1_000_000.0,
      qk_norm=True,
      tie_embeddings=False,
      max_seq_len=40_960,
      dtype="bfloat16",
      param_dtype="float32",  # master weights; compute in dtype
    )

  @classmethod
  def gemma3_1b(cls) -> ModelConfig:
    """google/gemma-3-1b-it (and -pt): 5 sliding-window layers, then 1 global, repeated."""
    return cls(
      vocab_size=262_144,
      num_layers=26,
      embed_dim=1152,
      num_heads=4,
      num_kv_heads=1,
      head_dim=256,
      mlp_dim=6912,
      rope_theta=1_000_000.0,
      norm_eps=1e-6,
      qk_norm=True,
      tie_embeddings=True,
      max_seq_len=32_768,
      dtype="bfloat16",
      param_dtype="float32",  # master weights; compute in dtype
      layer_types=sliding_layer_types(26, 6),
      sliding_window=512,
      rope_local_theta=10_000.0,
      query_pre_attn_scalar=256.0,
      mlp_activation="gelu_tanh",
      zero_centered_norms=True,
      post_norms=True,
      scale_embeddings=True,
    )

  @classmethod
  def qwen3_30b_a3b(cls) -> ModelConfig:
    """Qwen/Qwen3-30B-A3B: 128 experts, 8 per token (every layer sparse; mlp_dim unused)."""
    return cls(
      vocab_size=151_936,
      num_layers=48,
      embed_dim=2048,
      num_heads=32,
      num_kv_heads=4,
      head_dim=128,
      mlp_dim=6144,
      rope_theta=1_000_000.0,
      norm_eps=1e-6,
      qk_norm=True,
      tie_embeddings=False,
      max_seq_len=40_960,
      dtype="bfloat16",
      param_dtype="float32",  # master weights; compute in dtype
      num_experts=128,
      experts_per_token=8,
      moe_mlp_dim=768,
      norm_topk_prob=True,
    )

  @classmethod
  def mixtral_8x7b(cls) -> ModelConfig:
    """mistralai/Mixtral-8x7B-v0.1: 8 experts, top-2, no sliding window."""
    return cls(
      vocab_size=32_000,
      num_layers=32,
      embed_dim=4096,
      num_heads=32,
      num_kv_heads=8,
      head_dim=128,
      mlp_dim=14_336,
      rope_theta=1_000_000.0,
      norm_eps=1e-5,
      tie_embeddings=False,
      max_seq_len=32_768,
      dtype="bfloat16",
      param_dtype="float32",  # master weights; compute in dtype
      num_experts=8,
      experts_per_token=2,
      moe_mlp_dim=14_336,
      norm_topk_prob=True,
    )


def sliding_layer_types(num_layers: int, period: int) -> tuple[str, ...]:
  """HF `sliding_window_pattern`: every `period`-th layer is global, the others slide."""
  _positive("sliding_window_pattern", period)
  return tuple(
    "full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)
  )


PRESETS = {
  "tiny": ModelConfig.tiny,
  "tiny_moe": ModelConfig.tiny_moe,
  "arith_small": ModelConfig.arith_small,
  "arith_small_moe": ModelConfig.arith_small_moe,
  "qwen3_0p6b": ModelConfig.qwen3_0p6b,
  "llama3p2_1b": ModelConfig.llama3p2_1b,
  "gemma3_1b": ModelConfig.gemma3_1b,
  "llama3p2_3b": ModelConfig.llama3p2_3b,
  "qwen2p5_0p5b_instruct": ModelConfig.qwen2p5_0p5b_instruct,
  "qwen2p5_1p5b_instruct": ModelConfig.qwen2p5_1p5b_instruct,
  "qwen3_1p7b": ModelConfig.qwen3_1p7b,
  "qwen3_8b": ModelConfig.qwen3_8b,
  "qwen3_30b_a3b": ModelConfig.qwen3_30b_a3b,
  "mixtral_8x7b": ModelConfig.mixtral_8x7b,
}


def from_preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"model.preset={name!r} is unknown; allowed: {sorted(PRESETS)}")
  return PRESETS[name]().replace(**overrides)


def _positive(name: str, value: int) -> None:
  if not isinstance(value, int) or value <= 0:
    raise ValueError(f"model.{name} must be a positive int, got {value!r}")
