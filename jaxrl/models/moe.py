"""Mixture-of-experts MLP: top-k softmax router, ragged_dot token dispatch, load-balancing and
router z-losses."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl.kernels.grouped_matmul import grouped_matmul
from jaxrl.mesh import EXPERT_AXIS
from jaxrl.models.config import ModelConfig
from jaxrl.models.linear import param


class Routing(nnx.Intermediate):
  """What one MoE layer's router decided: (experts [B, T, k], logits [B, T, E]).

  Sown under `nnx.capture`; `jaxrl.models.transformer.apply_with_routing` collects it.
  """


def route(logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
  """Top-k routing as HF does it: softmax over all E experts in float32, keep the k largest.

  logits: [..., E]. Returns (weights [..., k] float32, experts [..., k] int32). With
  `renormalize` (Mixtral always; Qwen3-MoE iff `norm_topk_prob`) the k weights sum to 1.
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts.astype(jnp.int32)


def replay_route(
  logits: jax.Array, forced: jax.Array, top_k: int, renormalize: bool
) -> tuple[jax.Array, jax.Array]:
  """Routing replay (R3, "Stabilizing MoE Reinforcement Learning by Aligning Training and
  Inference Routers", arXiv 2510.11370): the experts are the sampler's, the gate weights the live
  router's.

  logits: [..., E] the learner's router logits; forced: [..., k] int experts the sampler chose
  for each token (-1: not recorded, e.g. padding or a sequence's last token, which feeds no
  log-prob: that token keeps its own top k). The weights are the live softmax probabilities of
  the forced experts, renormalised as `route` does: with `renormalize` exactly the softmax of the
  logits restricted to them. So the router still gets gradients through the weights, and forcing
  a token to the experts it would pick anyway changes nothing. Returns (weights [..., k] float32,
  experts [..., k] int32).
  """
  own_weights, own = route(logits, top_k, renormalize)
  recorded = jnp.all(forced >= 0, axis=-1, keepdims=True)
  experts = jnp.where(recorded, forced.astype(jnp.int32), own)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights = jnp.take_along_axis(probs, experts, axis=-1)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return jnp.where(recorded, weights, own_weights), experts


def _swiglu_ragged(x, gate, up, down, group_sizes, kernel=("reference", False)):
  """Each row of x [R, D] (rows sorted by expert) through its expert's SwiGLU -> [R, D].

  kernel = (ModelConfig.moe_kernel, kernel_interpret): "reference" is `jax.lax.ragged_dot`,
  anything else `jaxrl.kernels.grouped_matmul` (whose own reference is ragged_dot too)."""
  impl, interpret = kernel
  if impl == "reference":
    dot = functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes)
  else:
    dot = functools.partial(grouped_matmul, group_sizes=group_sizes, impl=impl, interpret=interpret)
  g = dot(x, gate)  # [R, F]
  u = dot(x, up)
  return dot(jax.nn.silu(g) * u, down)


def moe_dispatch(x, weights, experts, gate, up, down, kernel=("reference", False)) -> jax.Array:
  """Sparse MoE: each token runs only through its k experts, grouped with `jax.lax.ragged_dot`.

  x: [..., D]; weights, experts: [..., k]; gate, up: [E, D, F]; down: [E, F, D] -> [..., D].
  The token-expert assignments are sorted by expert so each expert's rows are contiguous (the
  layout ragged_dot and grouped-matmul kernels want), then unsorted and summed with their weights.
  """
  lead, d = x.shape[:-1], x.shape[-1]
  k, e = experts.shape[-1], gate.shape[0]
  flat_experts = experts.reshape(-1)  # [R], R = tokens * k
  order = jnp.argsort(flat_experts, stable=True)
  rows = x.reshape(-1, d)[order // k]  # [R, D], row r is assignment order[r]
  group_sizes = jnp.bincount(flat_experts, length=e).astype(jnp.int32)  # [E]
  gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
  y = _swiglu_ragged(rows, gate, up, down, group_sizes, kernel)  # [R, D]
  y = jnp.zeros_like(y).at[order].set(y)  # back to assignment order
  y = y.reshape(*lead, k, d).astype(jnp.float32)
  out = jnp.sum(y * weights[..., None].astype(jnp.float32), axis=-2)
  return out.astype(x.dtype)


def expert_parallel_size(mesh=None) -> int:
  """The size of the context mesh's expert axis (1 without one, or outside a mesh)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
    return 1
  return dict(mesh.shape)[EXPERT_AXIS]


def moe_dispatch_ep(x, weights, experts, gate, up, down, kernel=("reference", False)) -> jax.Array:
  """`moe_dispatch` with expert parallelism over the context mesh's expert axis (shard_map).

  Each device holds E / n of the experts (n = the expert axis size) and a 1 / (data * fsdp * n)
  share of the tokens. It sends each of its token-expert assignments to the device holding that
  expert with one all-to-all over the expert axis, runs the rows it receives through its local
  experts (grouped, `jax.lax.ragged_dot`), sends the results back with a second all-to-all and
  sums each token's k results with its gate weights. Dropless: every destination gets a buffer
  with room for all of a device's assignments, so nothing is dropped however unbalanced the
  routing, at the price of n times the assignment rows in the exchange buffers (a ragged
  all-to-all would send only what is routed). Same arguments and result as `moe_dispatch`;
  differentiable (the all-to-alls transpose to all-to-alls).
  """
  mesh = jax.sharding.get_abstract_mesh()
  n = expert_parallel_size(mesh)
  e = gate.shape[0]
  if e % n:
    raise ValueError(f"expert parallelism over {n} devices needs E={e} divisible by it")
  lead, d = x.shape[:-1], x.shape[-1]
  k = experts.shape[-1]
  rows = [a for a in ("data", "fsdp", EXPERT_AXIS) if a in mesh.axis_names]
  ways = math.prod(dict(mesh.shape)[a] for a in rows)
  tok, w, ex = x.reshape(-1, d), weights.reshape(-1, k), experts.reshape(-1, k)
  m = tok.shape[0]
  pad = -m % ways  # padding tokens route to expert 0 with weight 0
  if pad:
    tok = jnp.pad(tok, ((0, pad), (0, 0)))
    w, ex = jnp.pad(w, ((0, pad), (0, 0))), jnp.pad(ex, ((0, pad), (0, 0)))
  local_e = e // n

  def local(tok, w, ex, gate, up, down):
    r = tok.shape[0] * k  # this device's assignments
    flat = ex.reshape(-1)
    dest, slot = flat // local_e, jnp.arange(r)
    send = jnp.zeros((n, r, d), tok.dtype).at[dest, slot].set(tok[slot // k])
    send_e = jnp.full((n, r), local_e, jnp.int32).at[dest, slot].set(flat % local_e)
    recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0)  # recv[i]: what device i sent here
    recv_e = jax.lax.all_to_all(send_e, EXPERT_AXIS, 0, 0).reshape(-1)  # local_e = empty slot
    order = jnp.argsort(recv_e, stable=True)  # empty slots (id local_e) sort last
    sizes = jnp.bincount(recv_e, length=local_e + 1)[:local_e].astype(jnp.int32)
    y = _swiglu_ragged(
      recv.reshape(-1, d)[order],
      *(a.astype(tok.dtype) for a in (gate, up, down)),
      sizes,
      kernel,
    )
    y = jnp.zeros_like(y).at[order].set(y).reshape(n, r, d)  # rows past the groups are 0
    back = jax.lax.all_to_all(y, EXPERT_AXIS, 0, 0)  # back[i]: my rows, done by device i
    mine = back[dest, slot].reshape(-1, k, d).astype(jnp.float32)
    return jnp.sum(mine * w[..., None].astype(jnp.float32), axis=1).astype(tok.dtype)

  spec = P(tuple(rows))
  out = jax.shard_map(
    local,
    in_specs=(spec, spec, spec, P(EXPERT_AXIS), P(EXPERT_AXIS), P(EXPERT_AXIS)),
    out_specs=spec,
    check_vma=False,
  )(tok, w, ex, gate, up, down)
  return out[:m].reshape(*lead, d)


def moe_dense_reference(x, weights, experts, gate, up, down) -> jax.Array:
  """Every expert on every token, weighted by the sparse gate (zero off the top k); for tests.

  Same arguments and result as `moe_dispatch`.
  """
  e = gate.shape[0]
  dense_gate = jnp.sum(jax.nn.one_hot(experts, e) * weights[..., None], axis=-2)  # [..., E]
  g = jnp.einsum("...D,EDF->...EF", x, gate.astype(x.dtype))
  u = jnp.einsum("...D,EDF->...EF", x, up.astype(x.dtype))
  y = jnp.einsum("...EF,EFD->...ED", jax.nn.silu(g) * u, down.astype(x.dtype))
  out = jnp.einsum("...ED,...E->...D", y.astype(jnp.float32), dense_gate.astype(jnp.float32))
  return out.astype(x.dtype)


def load_balancing_loss(
  router_logits: jax.Array, top_k: int, valid: jax.Array | None = None
) -> jax.Array:
  """Switch-Transformer load-balancing loss (Fedus et al. 2021, eqs. 4-6), as HF computes it.

  router_logits: [L, B, T, E] (or any leading dims); valid: broadcastable to its leading dims,
  False for padding. With f_e the fraction of (unpadded) tokens that put expert e in their top k
  and P_e the mean router probability of e, both pooled over every layer, the loss is
  E * sum_e f_e * P_e (= k for perfectly uniform routing). Float32.
  """
  e = router_logits.shape[-1]
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  _, experts = jax.lax.top_k(probs, top_k)
  counts = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32), axis=-2)  # [..., E]
  if valid is None:
    w = jnp.ones(router_logits.shape[:-1], jnp.float32)
  else:
    w = jnp.broadcast_to(valid, router_logits.shape[:-1]).astype(jnp.float32)
  total = jnp.sum(w)
  frac = jnp.sum((counts * w[..., None]).reshape(-1, e), axis=0) / total  # [E]
  prob = jnp.sum((probs * w[..., None]).reshape(-1, e), axis=0) / total  # [E]
  return e * jnp.sum(frac * prob)


def router_z_loss(router_logits: jax.Array, valid: jax.Array | None = None) -> jax.Array:
  """ST-MoE's router z-loss (Zoph et al. 2022, "ST-MoE: Designing Stable and Transferable
  Sparse Expert Models", arXiv 2202.08906, eq. 5): the mean over (unpadded) tokens and layers of
  logsumexp(router logits)^2, which keeps the router's logits small. router_logits [..., E];
  valid broadcastable to its leading dims. Float32."""
  z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)
  if valid is None:
    return jnp.mean(z * z)
  w = jnp.broadcast_to(valid, z.shape).astype(jnp.float32)
  return jnp.sum(z * z * w) / jnp.maximum(jnp.sum(w), 1.0)


class MoEMLP(nnx.Module):
  """Top-k routed SwiGLU experts, stored expert-major: gate/up [E, D, F], down [E, F, D]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, e, dt = cfg.embed_dim, cfg.moe_mlp_dim, cfg.num_experts, cfg.weight_dtype
    self.router = param(rngs, (d, e), d, ("embed", "experts"), dt)
    self.gate = param(rngs, (e, d, f), d, ("experts", "embed", "mlp"), dt)
    self.up = param(rngs, (e, d, f), d, ("experts", "embed", "mlp"), dt)
    self.down = param(
      rngs, (e, f, d), f, ("experts", "mlp", "embed"), dt, (2 * cfg.num_layers) ** -0.5
    )
    self.top_k = cfg.experts_per_token
    self.renormalize = cfg.norm_topk_prob
    self.kernel = (cfg.moe_kernel, cfg.kernel_interpret)

  def __call__(self, x, routes=None):
    """x: [B, T, D] -> [B, T, D]; sows `Routing` (the router's own top-k experts, its logits).

    routes: [B, T, k] int experts to replay (`replay_route`; -1 where none was recorded), or
    None to route by the router's own top k. What is sown is the router's own choice either way:
    comparing it with `routes` is the sampler-learner routing agreement.
    """
    logits = jnp.einsum("BTD,DE->BTE", x, self.router[...].astype(x.dtype))
    weights, experts = route(logits, self.top_k, self.renormalize)
    # Recorded only under `nnx.capture` (see `apply_with_routing`); a plain forward keeps nothing.
    if hasattr(self, "__captures__"):
      self.sow(Routing, "routing", (experts, logits.astype(jnp.float32)))
    if routes is not None:
      weights, experts = replay_route(logits, routes, self.top_k, self.renormalize)
    # On a mesh with an expert axis, tokens travel to their experts' devices (all-to-all);
    # elsewhere every device runs the experts it is handed (GSPMD gathers what it lacks).
    dispatch = moe_dispatch_ep if expert_parallel_size() > 1 else moe_dispatch
    return dispatch(x, weights, experts, self.gate[...], self.up[...], self.down[...], self.kernel)
