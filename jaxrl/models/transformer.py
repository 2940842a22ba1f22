"""The decoder-only transformer and the pure functions the sampler and learner both call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.layers import MLP, Attention, RMSNorm, softcap
from jaxrl.models.moe import MoEMLP, Routing

KVCache = tuple  # one (k, v) pair per layer, each [B, S, K, H]


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)).

  With `cfg.post_norms` (Gemma 2/3) each branch output is normed again before the residual add.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer_idx: int = 0):
    d, eps, dt, zc = cfg.embed_dim, cfg.norm_eps, cfg.weight_dtype, cfg.zero_centered_norms
    self.attn_norm = RMSNorm(d, eps, dtype=dt, zero_centered=zc)
    self.attn = Attention(cfg, rngs=rngs, layer_idx=layer_idx)
    self.mlp_norm = RMSNorm(d, eps, dtype=dt, zero_centered=zc)
    if cfg.num_experts:
      self.mlp = MoEMLP(cfg, rngs=rngs)
    else:
      self.mlp = MLP(cfg, rngs=rngs)
    # Norm scales are constants, not random draws: adding them leaves the RNG stream unchanged.
    self.post_attn_norm = RMSNorm(d, eps, dtype=dt, zero_centered=zc) if cfg.post_norms else None
    self.post_mlp_norm = RMSNorm(d, eps, dtype=dt, zero_centered=zc) if cfg.post_norms else None

  def __call__(self, x, positions, kv_valid, cache=None, cache_index=0):
    h, cache = self.attn(self.attn_norm(x), positions, kv_valid, cache, cache_index)
    if self.post_attn_norm is not None:
      h = self.post_attn_norm(h)
    x = x + h
    h = self.mlp(self.mlp_norm(x))
    if self.post_mlp_norm is not None:
      h = self.post_mlp_norm(h)
    return x + h, cache


class Transformer(nnx.Module):
  """Token embedding, L pre-norm blocks, final RMSNorm, tied or untied output head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = cfg.weight_dtype
    embed = 0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.embed_dim), jnp.float32)
    self.embed = nnx.Param(embed.astype(dt), axes=("vocab", "embed"))
    self.layers = nnx.List([Block(cfg, rngs=rngs, layer_idx=i) for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(
      cfg.embed_dim, cfg.norm_eps, dtype=dt, zero_centered=cfg.zero_centered_norms
    )
    if cfg.tie_embeddings:
      self.head = None
    else:
      head = jax.random.normal(rngs.params(), (cfg.embed_dim, cfg.vocab_size), jnp.float32)
      self.head = nnx.Param((head * cfg.embed_dim**-0.5).astype(dt), axes=("embed", "vocab"))

  def __call__(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    kv_valid: jax.Array,
    *,
    cache: KVCache | None = None,
    cache_index=0,
    logits_at: jax.Array | None = None,
    return_hidden: bool = False,
  ) -> tuple[jax.Array, KVCache | None]:
    """tokens, positions: [B, T]; kv_valid: [B, S] marks real (non-pad) keys.

    Without a cache S = T. With one, this call's keys land at [cache_index, cache_index + T).
    `logits_at` ([B] indices into T) computes logits at one position per row only.
    Returns (logits [B, T, V] float32 — or [B, V] with logits_at — , new cache);
    with `return_hidden` the final-normed hidden states [B, T, D] instead of logits (a value
    head reads them: jaxrl.rl.critic).
    """
    x = self.embed[...].astype(self.cfg.compute_dtype)[tokens]  # [B, T, D]
    if self.cfg.scale_embeddings:
      # Rounded to the activation dtype first, as HF Gemma does (sqrt(1152) -> 34.0 in bfloat16).
      x = x * jnp.asarray(self.cfg.embed_dim**0.5, x.dtype)
    new_cache = []
    for i, layer in enumerate(self.layers):
      layer_cache = None if cache is None else cache[i]
      x, layer_cache = layer(x, positions, kv_valid, layer_cache, cache_index)
      new_cache.append(layer_cache)
    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)[:, 0]  # [B, D]
    x = self.final_norm(x)
    if return_hidden:
      return x, (tuple(new_cache) if cache is not None else None)
    if self.head is None:
      logits = jnp.einsum("...D,VD->...V", x, self.embed[...].astype(x.dtype))
    else:
      logits = jnp.einsum("...D,DV->...V", x, self.head[...].astype(x.dtype))
    logits = softcap(logits.astype(jnp.float32), self.cfg.final_logit_softcap)
    return logits, (tuple(new_cache) if cache is not None else None)


def make_model(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
  """Build a model and split it once into (graphdef, params); hot paths take `params`.

  Initialisation runs as one jitted program: eagerly, every parameter shape would compile its
  own random-number kernel (seconds each on CPU).
  """
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=seed))))
  params = jax.jit(lambda: nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=seed)))[1])()
  return graphdef, params


def apply(graphdef: nnx.GraphDef, params: nnx.State, *args, **kwargs):
  """The one forward: the sampler and the learner both call this with the same params."""
  return nnx.merge(graphdef, params)(*args, **kwargs)


def apply_with_routing(graphdef: nnx.GraphDef, params: nnx.State, *args, **kwargs):
  """`apply`, plus what every MoE layer's router decided (for routing replay and the aux loss).

  Returns (logits, cache, routing) with routing = {"experts": [L, B, T, k] int32,
  "router_logits": [L, B, T, E] float32} over the MoE layers in order, or None for a dense model.
  """
  model = nnx.merge(graphdef, params)
  (logits, cache), sown = nnx.capture(model, Routing)(*args, **kwargs)
  layers = sown.get("layers", {})
  per_layer = [layers[i]["mlp"]["routing"][0] for i in sorted(layers)]  # one call: one entry
  if not per_layer:
    return logits, cache, None
  experts, router_logits = (jnp.stack(x) for x in zip(*per_layer, strict=True))
  return logits, cache, {"experts": experts, "router_logits": router_logits}


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
  dtype = dtype or cfg.compute_dtype
  shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
  return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))


def positions_from_mask(valid: jax.Array) -> jax.Array:
  """Position of each token counting only real tokens (left padding gets position 0)."""
  return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def token_logprobs(
  graphdef, params, tokens, valid, *, temperature: float = 1.0, with_entropy: bool = False
):
  """Per-token log p(tokens[:, j] | tokens[:, :j]) under softmax(logits / temperature).

  tokens, valid: [B, T]. Returns logp [B, T] (column 0 is 0: nothing predicts it) and, if asked,
  the entropy [B, T] of the predictive distribution for each target. All in float32.
  """
  logits, _ = apply(graphdef, params, tokens, positions_from_mask(valid), valid)
  logp_all = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)  # [B, T-1, V]
  logp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  logp = jnp.pad(logp, ((0, 0), (1, 0)))
  if not with_entropy:
    return logp
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return logp, jnp.pad(ent, ((0, 0), (1, 0)))
