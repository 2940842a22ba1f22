"""The decoder-only transformer and the pure functions the sampler and learner both call."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.mesh import logical_constraint
from jaxrl.models.config import ModelConfig
from jaxrl.models.layers import (
  MLP,
  NO_WINDOW,
  Attention,
  LayerInputs,
  RMSNorm,
  rope_inv_freq,
  softcap,
)
from jaxrl.models.moe import MoEMLP, Routing

KVCache = tuple  # one (k, v) pair per layer, each [B, S, K, H]

# Logical axes of the residual stream [B, T, D] (see the rules tables of `jaxrl.mesh`).
_ACT = ("batch", "length", "act_embed")

_REMAT = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots_saveable": jax.checkpoint_policies.dots_saveable,
  "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


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

  def __call__(self, x, positions, kv_valid, cache=None, cache_index=0, layer=None, routes=None):
    """routes: [B, T, k] experts an MoE layer replays (`jaxrl.models.moe.replay_route`)."""
    h, cache = self.attn(self.attn_norm(x), positions, kv_valid, cache, cache_index, layer)
    if self.post_attn_norm is not None:
      h = self.post_attn_norm(h)
    x = x + h
    h = self.mlp(self.mlp_norm(x)) if routes is None else self.mlp(self.mlp_norm(x), routes)
    if self.post_mlp_norm is not None:
      h = self.post_mlp_norm(h)
    return x + h, cache


class Transformer(nnx.Module):
  """Token embedding, L pre-norm blocks, final RMSNorm, tied or untied output head.

  The blocks are stored per layer (`layers`: an nnx.List of `Block`), the layout the HF loader
  and exporter, checkpoints, LoRA, quantisation and the sharding rules all read. How a forward
  *without* a KV cache (the learner's) runs them is `cfg.scan_layers` and `cfg.remat`:

  - scan_layers=False: a Python loop, one traced copy of the block per layer, so compile time
    grows with depth. remat wraps each block in `jax.checkpoint` with its policy.
  - scan_layers=True: the per-layer params are stacked inside the traced function ([L, ...]
    per leaf) and one `jax.lax.scan` runs a single traced block over them; compile time no
    longer grows with depth. The price is memory: the stack is a copy of the blocks' weights
    that lives through the forward, and the backward builds the stacked gradient before it is
    split back per layer, so up to one extra copy of the block weights (and one of their
    gradients) is alive, sharded like the weights. What differs per layer is a scanned input
    (`LayerInputs`): Gemma's sliding window (global layers get `NO_WINDOW`) and RoPE frequencies.
    MoE layers scan too (every layer of a jaxrl MoE model is sparse); their routing comes back
    as a scan output and is sown per layer, so `apply_with_routing` is unchanged.

  Calls with a cache (the rollout engine's prefill and paged decode, `jaxrl.rollout.reference`)
  always run the Python loop: the per-layer cache would have to be stacked and unstacked on
  every decode step, a full copy of the KV cache each token. Decode does not differentiate, so
  remat does not apply there either.

  Activations carry logical sharding constraints (`jaxrl.mesh.logical_constraint`): the
  embedding output and every block boundary ("batch", "length", "act_embed"), attention q/k/v
  and output, the MLP hidden state, the logits. They are no-ops outside `jaxrl.mesh.use_mesh`.
  """

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
    routes: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """tokens, positions: [B, T]; kv_valid: [B, S] marks real (non-pad) keys.

    Without a cache S = T. With one, this call's keys land at [cache_index, cache_index + T).
    `logits_at` ([B] indices into T) computes logits at one position per row only.
    Returns (logits [B, T, V] float32 — or [B, V] with logits_at — , new cache);
    with `return_hidden` the final-normed hidden states [B, T, D] instead of logits (a value
    head reads them: jaxrl.rl.critic). `routes` ([B, T, L, k] int, MoE models only) replays the
    sampler's experts in every layer (routing replay; -1 where none was recorded).
    """
    if routes is not None and not self.cfg.num_experts:
      raise ValueError("routes (routing replay) needs an MoE model; this one has no experts")
    x = self.embed[...].astype(self.cfg.compute_dtype)[tokens]  # [B, T, D]
    if self.cfg.scale_embeddings:
      # Rounded to the activation dtype first, as HF Gemma does (sqrt(1152) -> 34.0 in bfloat16).
      x = x * jnp.asarray(self.cfg.embed_dim**0.5, x.dtype)
    x = logical_constraint(x, _ACT)
    new_cache = []
    if cache is None and (self.cfg.scan_layers or self.cfg.remat != "none"):
      x = self._blocks_without_cache(x, positions, kv_valid, routes)
    else:
      for i, layer in enumerate(self.layers):
        layer_cache = None if cache is None else cache[i]
        layer_routes = None if routes is None else routes[:, :, i]
        x, layer_cache = layer(
          x, positions, kv_valid, layer_cache, cache_index, routes=layer_routes
        )
        x = logical_constraint(x, _ACT)
        new_cache.append(layer_cache)
    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)[:, 0]  # [B, D]
    x = self.final_norm(x)
    new_cache = tuple(new_cache) if cache is not None else None
    if return_hidden:
      return x, new_cache
    return self.head_logits(x), new_cache

  def head_logits(self, x: jax.Array, axes: tuple[str, ...] | None = None) -> jax.Array:
    """Final-normed hidden states [..., D] -> float32 logits [..., V], soft-capped.

    `axes` names the logits' dims for their sharding constraint; by default the last of
    ("batch", "length", "act_vocab").
    """
    if self.head is None:
      logits = jnp.einsum("...D,VD->...V", x, self.embed[...].astype(x.dtype))
    else:
      logits = jnp.einsum("...D,DV->...V", x, self.head[...].astype(x.dtype))
    logits = logical_constraint(logits, axes or ("batch", "length", "act_vocab")[-logits.ndim :])
    return softcap(logits.astype(jnp.float32), self.cfg.final_logit_softcap)

  def _blocks_without_cache(self, x, positions, kv_valid, routes=None):
    """The blocks of a cache-free forward, scanned and/or rematerialised (see the class doc)."""
    cfg = self.cfg
    capture = hasattr(self, "__captures__")  # under nnx.capture: MoE routing is being recorded
    # Params apart from the rest (capture bookkeeping), so only arrays are stacked and scanned.
    split = [nnx.split(layer, nnx.Param, ...) for layer in self.layers]

    def run(graphdef, rest, params, x, layer, layer_routes):
      block = nnx.merge(graphdef, params, rest)
      kw = dict(layer=layer, routes=layer_routes)
      if capture:
        (y, _), sown = nnx.capture(block, Routing)(x, positions, kv_valid, **kw)
        routing = sown["mlp"]["routing"][0] if "mlp" in sown else None  # (experts, logits)
      else:
        y, _ = block(x, positions, kv_valid, **kw)
        routing = None
      return logical_constraint(y, _ACT), routing

    def remat(f, **kw):
      return f if cfg.remat == "none" else jax.checkpoint(f, policy=_REMAT[cfg.remat], **kw)

    if not cfg.scan_layers:
      for i, (layer, (graphdef, params, rest)) in enumerate(zip(self.layers, split, strict=True)):
        lr = None if routes is None else routes[:, :, i]
        x, routing = remat(lambda p, x, lr, g=graphdef, r=rest: run(g, r, p, x, None, lr))(
          params, x, lr
        )
        if routing is not None:
          layer.mlp.sow(Routing, "routing", routing)
      return x
    graphdef, _, rest = split[0]
    structure = jax.tree.structure(split[0][1])
    for i, (_, params, _) in enumerate(split):
      if jax.tree.structure(params) != structure:
        raise ValueError(
          f"model.scan_layers=True needs every layer's params alike; layer {i} differs from "
          "layer 0 (set model.scan_layers=False)"
        )
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(p for _, p, _ in split))  # [L, ...]
    per_layer_routes = None if routes is None else jnp.moveaxis(routes, 2, 0)  # [L, B, T, k]
    x, routing = jax.lax.scan(
      remat(lambda x, xs: run(graphdef, rest, xs[0], x, xs[1], xs[2]), prevent_cse=False),
      x,
      (stacked, self._layer_inputs(), per_layer_routes),
    )
    if routing is not None:
      for i, layer in enumerate(self.layers):
        layer.mlp.sow(Routing, "routing", jax.tree.map(lambda a, i=i: a[i], routing))
    return x

  def _layer_inputs(self) -> LayerInputs:
    """Per-layer window and RoPE frequencies as scanned arrays; None where all layers agree."""
    cfg, num = self.cfg, self.cfg.num_layers
    windows = [cfg.layer_window(i) for i in range(num)]
    ropes = [cfg.layer_rope(i) for i in range(num)]
    window = inv_freq = None
    if len(set(windows)) > 1:
      window = jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)  # [L]
    if len(set(ropes)) > 1:
      inv_freq = jnp.stack([rope_inv_freq(cfg.head_dim, *rope) for rope in ropes])  # [L, H/2]
    return LayerInputs(window, inv_freq)


def make_model(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
  """Build a model and split it once into (graphdef, params); hot paths take `params`.

  Initialisation runs as one jitted program: eagerly, every parameter shape would compile its
  own random-number kernel (seconds each on CPU). The seed is an argument of that program, not
  a constant in it, so every seed of a config runs the one compiled program (from a persistent
  compilation cache, too); the weights are those `nnx.Rngs(params=seed)` draws.
  """
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=seed))))

  def init(key_data):
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=jax.random.wrap_key_data(key_data))))[1]

  # The key nnx.Rngs(params=seed) makes, as data: a traced argument of the program.
  return graphdef, jax.jit(init)(jax.random.key_data(jax.random.key(seed)))


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
  graphdef, params, tokens, valid, *, temperature: float = 1.0, with_entropy: bool = False,
  routes=None,
):  # fmt: skip
  """Per-token log p(tokens[:, j] | tokens[:, :j]) under softmax(logits / temperature).

  tokens, valid: [B, T]. Returns logp [B, T] (column 0 is 0: nothing predicts it) and, if asked,
  the entropy [B, T] of the predictive distribution for each target. All in float32. `routes`
  ([B, T, L, k], MoE only) replays recorded experts (`Transformer.__call__`). With
  `cfg.logits_chunk` the logits are made a chunk of tokens at a time (`chunked_logprobs`).
  """
  model = nnx.merge(graphdef, params)
  chunked = model.cfg.logits_chunk > 0
  out, _ = model(tokens, positions_from_mask(valid), valid, routes=routes, return_hidden=chunked)
  return _head_logprobs(model, out, tokens, temperature, with_entropy)


def token_logprobs_and_routing(
  graphdef, params, tokens, valid, *, temperature: float = 1.0, with_entropy: bool = False,
  routes=None,
):  # fmt: skip
  """`token_logprobs` plus the routing of every MoE layer (`apply_with_routing`'s dict, None for
  a dense model) from the same forward: what the MoE auxiliary losses and the routing-agreement
  metric read. With `routes` replayed, the dict still holds the router's own top k."""
  model = nnx.merge(graphdef, params)
  chunked = model.cfg.logits_chunk > 0
  positions = positions_from_mask(valid)
  out, _, routing = apply_with_routing(
    graphdef, params, tokens, positions, valid, routes=routes, return_hidden=chunked
  )
  return _head_logprobs(model, out, tokens, temperature, with_entropy), routing


def _head_logprobs(model: Transformer, out, tokens, temperature, with_entropy):
  """`_logprobs` of the forward's output: logits [B, T, V], or with `cfg.logits_chunk` the
  final-normed hidden states [B, T, D] that `chunked_logprobs` turns into logits chunk by chunk."""
  chunk = model.cfg.logits_chunk
  if not chunk:
    return _logprobs(out, tokens, temperature, with_entropy)
  return chunked_logprobs(model.head_logits, out, tokens, chunk, temperature, with_entropy)


def chunked_logprobs(head, hidden, tokens, chunk: int, temperature=1.0, with_entropy=False):
  """`_logprobs(head(hidden), tokens, ...)` without the [B, T-1, V] logits, forward or backward.

  head: final-normed hidden [C, D] -> float32 logits [C, V] (`Transformer.head_logits`);
  hidden: [B, T, D]; tokens: [B, T]. The B x (T-1) predicting positions are flattened into
  tokens, padded to a multiple of `chunk` and run through one `jax.lax.scan` of `chunk` tokens
  per step. Each step is a `jax.checkpoint`: the backward pass keeps only the chunk's hidden
  states and remakes its logits, so at most one chunk's [C, V] logits (and their cotangent)
  are alive. The head's weights are read inside the step, so their gradient is summed over
  the chunks. Chunk j holds every n-th token from j (n chunks): under a mesh each chunk spreads
  over the batch shards like the rows it comes from.
  """
  b, t, d = hidden.shape
  num = b * (t - 1)
  size = min(chunk, num)  # C
  n = -(-num // size)
  pad = n * size - num
  h = jnp.pad(hidden[:, :-1].reshape(num, d), ((0, pad), (0, 0)))
  y = jnp.pad(tokens[:, 1:].reshape(num), (0, pad))
  h = logical_constraint(jnp.swapaxes(h.reshape(size, n, d), 0, 1), (None, "batch", "act_embed"))
  y = jnp.swapaxes(y.reshape(size, n), 0, 1)  # [n, C]

  @functools.partial(jax.checkpoint, prevent_cse=False)  # inside a scan: nothing to CSE across
  def step(_, xs):
    h, y = xs  # [C, D], [C]
    logits = head(logical_constraint(h, ("batch", "act_embed")), ("batch", "act_vocab"))
    logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)  # [C, V]
    logp = jnp.take_along_axis(logp_all, y[:, None], axis=-1)[:, 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1) if with_entropy else None
    return None, (logp, ent)

  _, (logp, ent) = jax.lax.scan(step, None, (h, y))  # [n, C] each

  def unchunk(x):  # [n, C] -> [B, T] with column 0 = 0
    x = jnp.swapaxes(x, 0, 1).reshape(n * size)[:num].reshape(b, t - 1)
    return jnp.pad(x, ((0, 0), (1, 0)))

  return (unchunk(logp), unchunk(ent)) if with_entropy else unchunk(logp)


def _logprobs(logits, tokens, temperature, with_entropy):
  logp_all = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)  # [B, T-1, V]
  logp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  logp = jnp.pad(logp, ((0, 0), (1, 0)))
  if not with_entropy:
    return logp
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return logp, jnp.pad(ent, ((0, 0), (1, 0)))
