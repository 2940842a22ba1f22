"""Transformer building blocks: RMSNorm, RoPE, grouped-query attention, gated MLP (weights and
LoRA adapters come from `linear.py`; the decoder block that joins them is in `transformer.py`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.kernels.attention import dot_attention, softcap
from jaxrl.kernels.paged_attention import PagedKV, paged_attention, write_kv
from jaxrl.mesh import logical_constraint
from jaxrl.models.config import ModelConfig, RopeScaling
from jaxrl.models.linear import make_adapters, param, project

__all__ = [  # dot_attention and softcap live with the kernels; the model imports them from here
  "MLP",
  "Attention",
  "RMSNorm",
  "NO_WINDOW",
  "LayerInputs",
  "apply_rope",
  "attention_mask",
  "dot_attention",
  "rope_inv_freq",
  "rope_rotate",
  "softcap",
]


class RMSNorm(nnx.Module):
  """y = x / rms(x) * w, computed in float32 whatever the activation dtype.

  `zero_centered` (Gemma) stores w - 1 instead: y = x / rms(x) * (1 + w), w initialised to 0.
  """

  def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, zero_centered: bool = False):
    init = jnp.zeros if zero_centered else jnp.ones
    self.scale = nnx.Param(init((dim,), dtype), axes=("norm",))
    self.eps = eps
    self.zero_centered = zero_centered

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    w = self.scale[...].astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(var + self.eps) * (1.0 + w if self.zero_centered else w)
    return y.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  """Inverse RoPE frequencies [H/2] in float32, optionally with Llama-3 frequency scaling."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is None:
    return inv_freq
  if scaling.kind == "linear":
    return inv_freq / scaling.factor
  # Written as in HF `_compute_llama3_parameters` so the float32 rounding matches: long
  # wavelengths are divided by `factor`, short ones kept, the band between interpolated.
  old_len = scaling.original_max_position
  low_freq_wavelen = old_len / scaling.low_freq_factor
  high_freq_wavelen = old_len / scaling.high_freq_factor
  wavelen = 2 * jnp.pi / inv_freq
  scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old_len / wavelen - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(
  x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
  """Rotary embedding in the HF "rotate half" layout. x: [B, T, N, H]; positions: [B, T]."""
  return rope_rotate(x, positions, rope_inv_freq(x.shape[-1], theta, scaling))


def rope_rotate(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """`apply_rope` with the inverse frequencies [H/2] given (they differ per layer in Gemma 3, and
  a scanned stack of layers receives them as an input)."""
  h = x.shape[-1]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : h // 2], x32[..., h // 2 :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class LayerInputs(NamedTuple):
  """What may differ between layers that share one traced body under `jax.lax.scan`.

  window: int32 scalar, the sliding window (`NO_WINDOW` for a global layer); inv_freq: [H/2]
  RoPE inverse frequencies. A None field keeps the layer's own (static) value.
  """

  window: jax.Array | None = None
  inv_freq: jax.Array | None = None


# The window of a global layer inside a scan over mixed layers: larger than any sequence, and
# small enough that `query_index - NO_WINDOW` cannot overflow int32.
NO_WINDOW = 2**30


def attention_mask(
  kv_valid: jax.Array, num_queries: int, query_offset, window: int | None = None
) -> jax.Array:
  """Causal + padding mask [B, T, S]: query t (global index query_offset + t) sees key s iff the
  key is a real token and s <= query_offset + t; with a sliding `window` W also
  s > query_offset + t - W (HF `sliding_window_overlay`: the query and the W - 1 keys before it).

  Indices are cache slots, not positions: with left padding and contiguous decoding the two
  differ by a per-row constant, so the window is the same either way.
  """
  s = kv_valid.shape[1]
  q_idx = query_offset + jnp.arange(num_queries)[:, None]  # [T, 1]
  k_idx = jnp.arange(s)[None, :]  # [1, S]
  visible = k_idx <= q_idx  # [T, S]
  if window is not None:
    visible &= k_idx > q_idx - window
  return kv_valid[:, None, :] & visible[None]


# Logical axes of the attention activations (mapped to mesh axes by the rules of `jaxrl.mesh`).
_Q_AXES = ("batch", "length", "act_heads", "act_head_dim")
_KV_AXES = ("batch", "length", "act_kv_heads", "act_head_dim")


class Attention(nnx.Module):
  """Grouped-query self-attention with optional QK-norm and a functional KV cache."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer_idx: int = 0):
    d, n, k, h, dt = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.weight_dtype
    self.q = param(rngs, (d, n, h), d, ("embed", "q_heads", "head_dim"), dt)
    self.k = param(rngs, (d, k, h), d, ("embed", "kv_heads", "head_dim"), dt)
    self.v = param(rngs, (d, k, h), d, ("embed", "kv_heads", "head_dim"), dt)
    self.o = param(
      rngs, (n, h, d), n * h, ("q_heads", "head_dim", "embed"), dt, (2 * cfg.num_layers) ** -0.5
    )
    zc = cfg.zero_centered_norms
    self.q_norm = RMSNorm(h, cfg.norm_eps, dtype=dt, zero_centered=zc) if cfg.qk_norm else None
    self.k_norm = RMSNorm(h, cfg.norm_eps, dtype=dt, zero_centered=zc) if cfg.qk_norm else None
    # Zero-initialised (as HF does), so they draw no random numbers: with qkv_bias off the RNG
    # stream, and hence every other parameter, is exactly what it was before biases existed.
    if cfg.qkv_bias:
      self.q_bias = nnx.Param(jnp.zeros((n, h), dt), axes=("q_heads", "head_dim"))
      self.k_bias = nnx.Param(jnp.zeros((k, h), dt), axes=("kv_heads", "head_dim"))
      self.v_bias = nnx.Param(jnp.zeros((k, h), dt), axes=("kv_heads", "head_dim"))
    else:
      self.q_bias = self.k_bias = self.v_bias = None
    self.rope_theta, self.rope_scaling = cfg.layer_rope(layer_idx)
    self.window = cfg.layer_window(layer_idx)
    qh, kh = ((n, h), ("q_heads", "head_dim")), ((k, h), ("kv_heads", "head_dim"))
    lora = make_adapters(
      cfg,
      rngs,
      {
        "q": ((d,), ("embed",), *qh),
        "k": ((d,), ("embed",), *kh),
        "v": ((d,), ("embed",), *kh),
        "o": (*qh, (d,), ("embed",)),
      },
    )
    self.q_lora, self.k_lora, self.v_lora, self.o_lora = lora.values()
    self.scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
    self.logit_cap = cfg.attn_logit_softcap
    self.attention_kernel = (cfg.attention_kernel, cfg.kernel_interpret)
    self.matmul_kernel = (cfg.matmul_kernel, cfg.kernel_interpret)

  def __call__(self, x, positions, kv_valid, cache=None, cache_index=0, layer=None):
    """x: [B, T, D]; positions: [B, T]; kv_valid: [B, S] (S = T without a cache).

    With a cache (k, v: [B, S, K, H]) the new keys/values are written at `cache_index` and the
    queries attend over the whole cache; returns (out [B, T, D], new cache or None).
    `layer` (`LayerInputs`) overrides this layer's window and RoPE frequencies with traced values
    (the scanned stack of `jaxrl.models.transformer.Transformer`; no paged cache then).
    """
    dt = x.dtype
    q = project("BTD,DNH->BTNH", x, self.q, self.q_lora, self.matmul_kernel)
    k = project("BTD,DKH->BTKH", x, self.k, self.k_lora, self.matmul_kernel)
    v = project("BTD,DKH->BTKH", x, self.v, self.v_lora, self.matmul_kernel)
    if self.q_bias is not None:
      q = q + self.q_bias[...].astype(dt)
      k = k + self.k_bias[...].astype(dt)
      v = v + self.v_bias[...].astype(dt)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    layer = LayerInputs() if layer is None else layer
    if layer.inv_freq is None:
      q = apply_rope(q, positions, self.rope_theta, self.rope_scaling)
      k = apply_rope(k, positions, self.rope_theta, self.rope_scaling)
    else:
      q = rope_rotate(q, positions, layer.inv_freq)
      k = rope_rotate(k, positions, layer.inv_freq)
    window = self.window if layer.window is None else layer.window
    q = logical_constraint(q, _Q_AXES)
    k = logical_constraint(k, _KV_AXES)
    v = logical_constraint(v, _KV_AXES)
    if isinstance(cache, PagedKV):
      # Paged decode/prefill (the rollout engine): keys land in their pages at their positions;
      # `kv_valid` and `cache_index` are unused, the page table and lengths say it all.
      cache = write_kv(cache, k, v, positions)
      impl, interpret = self.attention_kernel
      out = paged_attention(
        q,
        cache,
        positions,
        window=window,
        soft_cap=self.logit_cap,
        scale=self.scale,
        impl=impl,
        interpret=interpret,
      )
      return project("BTNH,NHD->BTD", out, self.o, self.o_lora, self.matmul_kernel), cache
    if cache is not None:
      ck, cv = cache
      k = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), cache_index, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), cache_index, axis=1)
      cache = (k, v)
    mask = attention_mask(kv_valid, x.shape[1], cache_index, window)
    out = dot_attention(
      q, k.astype(dt), v.astype(dt), mask, scale=self.scale, logit_cap=self.logit_cap
    )
    out = logical_constraint(out, _Q_AXES)
    return project("BTNH,NHD->BTD", out, self.o, self.o_lora, self.matmul_kernel), cache


class MLP(nnx.Module):
  """Gated MLP: down(act(gate(x)) * up(x)); act is silu (SwiGLU) or tanh-GeLU (Gemma's GeGLU)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, dt = cfg.embed_dim, cfg.mlp_dim, cfg.weight_dtype
    self.gate = param(rngs, (d, f), d, ("embed", "mlp"), dt)
    self.up = param(rngs, (d, f), d, ("embed", "mlp"), dt)
    self.down = param(rngs, (f, d), f, ("mlp", "embed"), dt, (2 * cfg.num_layers) ** -0.5)
    self.activation = cfg.mlp_activation
    d_in, f_in = ((d,), ("embed",)), ((f,), ("mlp",))
    lora = make_adapters(
      cfg, rngs, {"gate": (*d_in, *f_in), "up": (*d_in, *f_in), "down": (*f_in, *d_in)}
    )
    self.gate_lora, self.up_lora, self.down_lora = lora.values()
    self.matmul_kernel = (cfg.matmul_kernel, cfg.kernel_interpret)

  def __call__(self, x):
    g = project("BTD,DF->BTF", x, self.gate, self.gate_lora, self.matmul_kernel)
    u = project("BTD,DF->BTF", x, self.up, self.up_lora, self.matmul_kernel)
    # HF "gelu_pytorch_tanh" is the tanh approximation, which jax.nn.gelu computes by default.
    act = jax.nn.silu(g) if self.activation == "silu" else jax.nn.gelu(g, approximate=True)
    h = logical_constraint(act * u, ("batch", "length", "act_mlp"))
    return project("BTF,FD->BTD", h, self.down, self.down_lora, self.matmul_kernel)
