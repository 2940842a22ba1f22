"""The pure train step: `train_step(state, batch) -> (state, metrics)`, jitted once, state donated.

A loss is an object with `denominator(batch)` (data only: e.g. the number of loss tokens of the
whole batch) and `__call__(params, micro_batch) -> (weighted_sum, {name: (sum, count)})`. The step
accumulates gradients of the weighted sums over micro-batches and divides once by the global
denominator, so k micro-batches give exactly the gradient of one large batch.

`train_step(state, batch, denom)` divides by a given denominator instead: the loop passes the
full batch's when it trains on the rows of a batch that carry gradient (`batch.gradient_rows`),
so dropping rows whose loss terms are all zero leaves the update as it was.

`trainable` (an nnx filter, or "lora" for the adapters) limits training to part of the params:
the gradient, the optimizer state and the update cover only those; the rest pass through as is.

Non-finite guard: an update whose loss terms, gradient or optimizer update hold a NaN or an inf
is skipped inside the compiled step: params, optimizer state and the update count come back as
they went in, and the metric `opt/nonfinite` is 1 (else 0). `jaxrl.guard.NonFiniteGuard` counts
those and stops a run after too many in a row.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.guard import tree_finite


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  step: jax.Array  # int32 number of optimizer updates applied


def make_optimizer(
  *,
  learning_rate: float,
  warmup_steps: int,
  total_steps: int,
  weight_decay: float = 0.0,
  b1: float = 0.9,
  b2: float = 0.999,
  grad_clip: float = 1.0,
  schedule: str = "cosine",
) -> Optimizer:
  """AdamW with global-norm clipping and linear warmup, then cosine decay (to 10%) or constant."""
  # warmup_steps=0 means no warmup: full rate from the first update (not a wasted step at 0).
  start = 0.0 if warmup_steps > 0 else learning_rate
  if schedule == "cosine":
    # optax needs at least one decay step after the warmup: a phase of 0 or 1 updates (or all
    # warmup) decays over one step it never takes, instead of failing to build.
    warm = max(warmup_steps, 1)
    lr = optax.warmup_cosine_decay_schedule(
      start, learning_rate, warm, max(total_steps, warm + 1), 0.1 * learning_rate
    )
  elif schedule == "constant":
    lr = optax.join_schedules(
      [
        optax.linear_schedule(start, learning_rate, max(warmup_steps, 1)),
        optax.constant_schedule(learning_rate),
      ],
      [max(warmup_steps, 1)],
    )
  else:
    raise ValueError(f"unknown lr schedule {schedule!r}; valid: ['constant', 'cosine']")
  tx = optax.chain(
    optax.clip_by_global_norm(grad_clip) if grad_clip > 0 else optax.identity(),
    optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay),
  )
  return Optimizer(tx, lr)


class Optimizer(NamedTuple):
  """An optax transformation plus its schedule, so the step can report the learning rate."""

  tx: optax.GradientTransformation
  lr_fn: Any

  def init(self, params):
    return self.tx.init(params)

  def update(self, grads, opt_state, params):
    return self.tx.update(grads, opt_state, params)


def trainable_filter(trainable):
  """The nnx filter of the trained params: None -> all, "lora" -> the LoRA adapters."""
  if trainable is None:
    return ...
  return nnx.LoRAParam if trainable == "lora" else trainable


def split_trainable(params, trainable):
  """(trained, frozen) parts of `params`; the frozen part is None when everything trains.

  `nnx.merge_state(trained, frozen)` rebuilds `params`. A filter that selects nothing raises:
  training zero params (e.g. trainable="lora" on a model with lora_rank=0) is never intended.
  """
  if trainable is None:
    return params, None
  if not isinstance(params, nnx.State):
    raise ValueError(f"trainable={trainable!r} needs nnx.State params, got {type(params).__name__}")
  trained, frozen = nnx.split_state(params, trainable_filter(trainable), ...)
  if not jax.tree.leaves(trained):
    raise ValueError(
      f"trainable={trainable!r} selects no params (for 'lora' the model needs model.lora_rank > 0)"
    )
  return trained, frozen


def init_state(params, optimizer, *, trainable=None) -> TrainState:
  """A fresh state whose every leaf lives on the params' mesh: params keep their shardings,
  optimizer moments mirror them (by propagation), scalars are replicated.

  With `trainable` the optimizer state covers only the trained params (pass the same value to
  `make_train_step`): for LoRA the Adam moments are adapter-sized, not model-sized.
  """
  opt_state = optimizer.init(split_trainable(params, trainable)[0])
  state = TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32))
  return jax.device_put(state, state_shardings(state))


def state_shardings(state):
  """The sharding of every leaf, with anything not already on the params' mesh replicated."""
  mesh = next(
    (x.sharding.mesh for x in jax.tree.leaves(state) if isinstance(x.sharding, NamedSharding)),
    None,
  )
  if mesh is None:
    return jax.tree.map(lambda x: x.sharding, state)

  def pick(x):
    if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
      return x.sharding
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree.map(pick, state)


def _split_micro(batch, k: int):
  def split(x):
    if x.shape[0] % k:
      raise ValueError(f"batch size {x.shape[0]} is not divisible by {k} micro-batches")
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])

  return jax.tree.map(split, batch)


def make_train_step(
  optimizer,
  loss,
  *,
  num_microbatches: int = 1,
  donate: bool = True,
  trainable=None,
  skip_nonfinite: bool = True,
):
  """Build the jitted train step for `loss` (see module docstring).

  `trainable` (None: all params; "lora": the adapters; or an nnx filter) must be the value the
  state was built with (`init_state`). Metrics' norms are over the trained params.
  """
  if num_microbatches < 1:
    raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")

  def step_fn(state: TrainState, batch, denom=None):
    if denom is None:
      denom = loss.denominator(batch)
    denom = jnp.maximum(denom, 1.0)
    trained, frozen = split_trainable(state.params, trainable)

    def full(p):
      return p if frozen is None else nnx.merge_state(p, frozen)

    grad_fn = jax.grad(lambda p, mb: loss(full(p), mb), has_aux=True)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trained)

    if num_microbatches == 1:
      g, aux = grad_fn(trained, batch)
    else:
      micro_batches = _split_micro(batch, num_microbatches)
      _, aux0 = jax.eval_shape(grad_fn, trained, jax.tree.map(lambda x: x[0], micro_batches))
      init = (zeros, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux0))

      def body(carry, mb):
        grads, aux_sum = carry
        g, aux = grad_fn(trained, mb)
        grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
        return (grads, jax.tree.map(jnp.add, aux_sum, aux)), None

      (g, aux), _ = jax.lax.scan(body, init, micro_batches)
    grads = jax.tree.map(lambda x: x.astype(jnp.float32) / denom, g)
    updates, opt_state = optimizer.update(grads, state.opt_state, trained)
    # The moments keep the dtype they were made in (the params'): float32 gradients would
    # otherwise promote bfloat16 moments after the first update, and the next step would meet
    # a state of another type (a second compile, and a resume restoring the first type).
    opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state, state.opt_state)
    new_trained = optax.apply_updates(trained, updates)
    # The gradient's and the update's norms are finite iff every element is (or they overflow:
    # a gradient too large to square in float32 is skipped as well).
    grad_norm, update_norm = optax.tree.norm(grads), optax.tree.norm(updates)
    finite = tree_finite(aux) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
    if skip_nonfinite:
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
      trained = keep(new_trained, trained)
      opt_state = keep(opt_state, state.opt_state)
      count = state.step + finite.astype(state.step.dtype)
    else:
      trained, count = new_trained, state.step + 1
    metrics = {k: s / jnp.maximum(c, 1e-9) for k, (s, c) in aux.items()}
    metrics.update(
      {
        "opt/grad_norm": grad_norm,
        "opt/param_norm": optax.tree.norm(trained),
        "opt/update_norm": update_norm,
        "opt/nonfinite": 1.0 - finite.astype(jnp.float32),
        "opt/lr": jnp.asarray(optimizer.lr_fn(state.step), jnp.float32),
        "opt/loss_tokens": denom,
      }
    )
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    new = TrainState(params=full(trained), opt_state=opt_state, step=count)
    return new, metrics

  return _PinnedStep(step_fn, donate)


class _PinnedStep:
  """jit(step_fn) whose output state keeps the input state's shardings (taken on the first
  call), so the state fed back in hits the same compiled program: one compile per run."""

  def __init__(self, step_fn, donate: bool):
    self._fn = step_fn
    self._donate = (0,) if donate else ()
    self._jitted = None

  def __call__(self, state, batch, denom=None):
    if self._jitted is None:
      self._jitted = jax.jit(
        self._fn, donate_argnums=self._donate, out_shardings=(state_shardings(state), None)
      )
    if denom is not None:
      denom = jnp.asarray(denom, jnp.float32)
    return self._jitted(state, batch, denom)

  def _cache_size(self) -> int:
    return 0 if self._jitted is None else self._jitted._cache_size()
