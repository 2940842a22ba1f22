"""Train step: accumulation equals one batch, one compile, donation, metrics, the optimizer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.config import KLConfig, PolicyLossConfig
from jaxrl.models import ModelConfig, Transformer, make_model
from jaxrl.models.lora import merge_lora, split_lora
from jaxrl.models.transformer import apply, positions_from_mask, token_logprobs
from jaxrl.rl.batch import TrainBatch, compact_rows, gradient_rows
from jaxrl.rl.objectives import PolicyLoss
from jaxrl.rl.train_step import Optimizer, init_state, make_optimizer, make_train_step

pytestmark = pytest.mark.integration

# One layer keeps every component (attention, MLP, norms, head) and halves the compile time.
CFG = ModelConfig.tiny().replace(num_layers=1)
B, T, P = 8, 11, 5  # batch, columns, prompt bucket (completion columns are P..T-1)


def _lr(step):
  return 1.0 / (1.0 + step)


# The first update (from a fresh state) is -grad, so parameter deltas expose the step's gradient;
# the rate then decays, so the reported opt/lr can be checked against the step count.
SGD = Optimizer(optax.sgd(_lr), _lr)
# Jitted: op-by-op dispatch of a whole transformer is slow on CPU.
logprobs = jax.jit(functools.partial(token_logprobs, with_entropy=True), static_argnums=0)


@pytest.fixture(scope="module")
def model():
  return make_model(CFG, seed=0)


@pytest.fixture(scope="module")
def loss(model):
  return PolicyLoss(
    model[0], loss=PolicyLossConfig(eps_low=0.2, eps_high=0.28), kl=KLConfig(beta=0.1)
  )


@pytest.fixture(scope="module")
def step1(loss):
  return make_train_step(SGD, loss)


def make_batch(graphdef, params, seed, *, noise=0.3):
  """Random prompts (left-padded) and ragged completions; advantages per sequence; behaviour and
  reference log-probs are the current ones plus `noise` (noise=0: on-policy, ref == current)."""
  k = jax.random.split(jax.random.key(seed), 6)
  tokens = jax.random.randint(k[0], (B, T), 0, CFG.vocab_size)
  cols = jnp.arange(T)[None]
  pad = jax.random.randint(k[1], (B, 1), 0, 3)
  end = jax.random.randint(k[2], (B, 1), P + 1, T + 1)
  valid = (cols >= pad) & (cols < end)
  loss_mask = ((cols >= P) & valid).astype(jnp.float32)
  adv = jax.random.normal(k[3], (B, 1)) * loss_mask
  logp, _ = logprobs(graphdef, params, tokens, valid)
  old = (logp + noise * jax.random.normal(k[4], (B, T))) * loss_mask
  ref = (logp + noise * jax.random.normal(k[5], (B, T))) * loss_mask
  versions = jnp.where(loss_mask > 0, 0, -1).astype(jnp.int32)
  return TrainBatch(tokens, valid, loss_mask, adv, old, ref, versions)


def fresh_state(params):
  # A copy: the step donates its input state, and init_state aliases the arrays it is given.
  return init_state(jax.tree.map(jnp.copy, params), SGD)


def tree_max_abs(tree):
  return max(float(np.max(np.abs(x))) for x in jax.tree.leaves(tree))


def np_norm(tree):
  return np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))


def per_token_abs_grad(loss, params, batch):
  """sum over loss tokens of |grad of that token's loss term|, per parameter, in float64: the
  magnitudes a float32 re-ordering of the batch's gradient sum acts on."""
  grad = jax.jit(jax.grad(lambda p, mask: loss(p, batch._replace(loss_mask=mask))[0]))
  total = jax.tree.map(lambda x: np.zeros(x.shape, np.float64), params)
  # One token at a time (a python loop: vmap over the masks gave wrong layer gradients here).
  for b, t in zip(*np.nonzero(np.asarray(batch.loss_mask)), strict=True):
    one = jnp.zeros((B, T), jnp.float32).at[b, t].set(batch.loss_mask[b, t])
    g = grad(params, one)
    total = jax.tree.map(lambda s, x: s + np.abs(np.asarray(x, np.float64)), total, g)
  return total


def tree_diff(a, b):
  return jax.tree.map(lambda x, y: np.asarray(x) - np.asarray(y), a, b)


def test_microbatch_accumulation_equals_one_batch(model, loss, step1):
  graphdef, params = model
  batch = make_batch(graphdef, params, seed=1)
  assert 0 < float(jnp.sum(batch.loss_mask)) < B * (T - P)  # ragged completions
  s1, m1 = step1(fresh_state(params), batch)
  s4, m4 = make_train_step(SGD, loss, num_microbatches=4)(fresh_state(params), batch)
  u1 = tree_diff(s1.params, params)
  u4 = tree_diff(s4.params, params)
  assert tree_max_abs(u1) > 1e-3  # the comparison below is about a real update
  # The two updates sum the same per-token gradient terms in another order (4 partial sums,
  # and matmul blockings that differ with the batch shape and between CPU types). Float32
  # re-ordering of a sum of n terms moves it by at most gamma_n * sum|terms| (Higham, Accuracy
  # and Stability of Numerical Algorithms, eq. 4.4); so per parameter leaf, two such sums
  # differ by at most 2 gamma_n max(sum|terms|), with n the tokens summed plus the partial sums
  # and sum|terms| the loss tokens' |gradients|. Per leaf, not per element: inside the backward
  # pass each element is itself a sum with cancellation, which no per-element bound sees.
  n = B * T + 4
  gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
  denom = float(jnp.sum(batch.loss_mask))
  abs_terms = per_token_abs_grad(loss, params, batch)
  for d, a in zip(jax.tree.leaves(tree_diff(u4, u1)), jax.tree.leaves(abs_terms), strict=True):
    assert np.max(np.abs(d)) <= 2 * gamma * np.max(a) / denom
  assert m1.keys() == m4.keys()
  for k in m1:
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
  # The batch really exercised both PPO branches and the KL term.
  assert 0 < float(m1["rl/clip_frac"]) < 1 and float(m1["rl/kl"]) > 0


@pytest.mark.parametrize(
  "policy_loss,aggregation",
  [
    ("ppo_clip", "token-mean"),
    ("gspo", "seq-mean-token-mean"),
    ("cispo", "seq-mean-token-sum"),
  ],
)
def test_training_only_rows_with_advantage_gives_the_same_update(model, policy_loss, aggregation):
  # rl.skip_zero_advantage: the rows whose advantages are all zero (a group whose rewards tie)
  # are left out of the forward and backward pass and the step divides by the whole batch's
  # denominator. Without a KL or entropy term every loss is zero there, so the update must be
  # the full batch's, up to the order float32 sums it in.
  graphdef, params = model
  batch = make_batch(graphdef, params, seed=5)
  dead = np.array([1, 0, 1, 1, 0, 1, 1, 0], bool)
  batch = batch._replace(advantages=jnp.where(dead[:, None], 0.0, batch.advantages))
  keep = gradient_rows(batch)
  np.testing.assert_array_equal(keep, ~dead)
  small = compact_rows(batch, keep, multiple=2)
  assert small.size == 4  # 3 live rows, padded to a power of two
  loss = PolicyLoss(
    graphdef, loss=PolicyLossConfig(name=policy_loss, aggregation=aggregation, eps_high=0.28)
  )
  step = make_train_step(SGD, loss)
  s_full, m_full = step(fresh_state(params), batch)
  s_small, m_small = step(fresh_state(params), small, loss.denominator(batch))
  assert step._cache_size() == 2  # one program per row count
  u_full, u_small = tree_diff(s_full.params, params), tree_diff(s_small.params, params)
  assert tree_max_abs(u_full) > 1e-3
  # The same bound as for micro-batches above: the same non-zero terms, summed in another order.
  n = B * T
  gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
  denom = float(loss.denominator(batch))
  abs_terms = per_token_abs_grad(loss, params, batch)
  for d, a in zip(
    jax.tree.leaves(tree_diff(u_small, u_full)), jax.tree.leaves(abs_terms), strict=True
  ):
    assert np.max(np.abs(d)) <= 2 * gamma * np.max(a) / denom
  assert float(m_small["opt/loss_tokens"]) == float(m_full["opt/loss_tokens"]) == denom
  np.testing.assert_allclose(m_small["opt/grad_norm"], m_full["opt/grad_norm"], rtol=1e-5)
  # Leaving out a live row changes the update: the test can tell.
  wrong = compact_rows(batch, np.arange(B) == 1, multiple=1)
  s_wrong, _ = step(fresh_state(params), wrong, loss.denominator(batch))
  assert tree_max_abs(tree_diff(tree_diff(s_wrong.params, params), u_full)) > 1e-3


def test_update_is_the_gradient_of_the_token_mean_loss(model, loss, step1):
  # Central difference of sum / denominator along a random direction vs <grad, v> from the step.
  graphdef, params = model
  batch = make_batch(graphdef, params, seed=2)
  state, _ = step1(fresh_state(params), batch)
  grad = jax.tree.map(lambda new, old: np.asarray(old) - np.asarray(new), state.params, params)
  rng = np.random.default_rng(3)
  v = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
  norm = np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(v)))
  v = jax.tree.map(lambda x: x / norm, v)

  @jax.jit
  def mean_loss_at(h):
    p = jax.tree.map(lambda x, d: x + h * d, params, v)
    return loss(p, batch)[0] / jnp.sum(batch.loss_mask)

  h = 1e-2
  fd = (float(mean_loss_at(h)) - float(mean_loss_at(-h))) / (2 * h)
  analytic = sum(jax.tree.leaves(jax.tree.map(lambda g, d: float(np.vdot(g, d)), grad, v)))
  assert abs(analytic) > 1e-2
  np.testing.assert_allclose(fd, analytic, rtol=1e-2)


def test_compiles_once_donates_and_moves_params(model, step1):
  graphdef, params = model
  state = fresh_state(params)
  for i in range(4):
    old = state
    state, metrics = step1(state, make_batch(graphdef, params, seed=10 + i))
    assert all(x.is_deleted() for x in jax.tree.leaves(old))  # the input state was donated
    assert int(state.step) == i + 1
    # The rate reported is the one the update used: that of the step count before the update.
    assert float(metrics["opt/lr"]) == pytest.approx(1 / (i + 1), rel=1e-6)
    np.testing.assert_allclose(
      metrics["opt/update_norm"], metrics["opt/lr"] * metrics["opt/grad_norm"], rtol=1e-5
    )
    assert float(metrics["opt/update_norm"]) > 0
  assert step1._cache_size() == 1
  assert tree_max_abs(tree_diff(state.params, params)) > 1e-3
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))


def test_on_policy_metrics(model, step1):
  graphdef, params = model
  batch = make_batch(graphdef, params, seed=4, noise=0.0)
  logp, entropy = logprobs(graphdef, params, batch.tokens, batch.valid)
  state, m = step1(fresh_state(params), batch)
  for k in ("opt/grad_norm", "opt/param_norm", "opt/update_norm", "opt/lr", "opt/loss_tokens"):
    assert k in m
  for k in ("rl/loss", "rl/pg_loss", "rl/kl", "rl/entropy", "rl/clip_frac", "rl/logprob_gap"):
    assert k in m
  assert all(v.dtype == jnp.float32 and v.shape == () for v in m.values())
  mask = np.asarray(batch.loss_mask)
  n = mask.sum()
  assert float(m["opt/loss_tokens"]) == n
  # Learner params are the sampler's: no gap, no clipping, no KL to an identical reference.
  assert float(m["rl/logprob_gap"]) < 1e-5
  assert float(m["rl/clip_frac"]) == 0.0
  assert 0.0 <= float(m["rl/kl"]) < 1e-10
  # ratio == 1, so the loss is -mean(A) over loss tokens.
  want_loss = -np.sum(np.asarray(batch.advantages) * mask) / n
  np.testing.assert_allclose(m["rl/loss"], want_loss, atol=1e-5)
  np.testing.assert_allclose(m["rl/entropy"], np.sum(np.asarray(entropy) * mask) / n, rtol=1e-5)
  assert 0 < float(m["rl/entropy"]) < np.log(CFG.vocab_size)
  # Norms, by hand: with SGD(1) the update is -grad.
  update = tree_diff(state.params, params)
  update_norm, param_norm = np_norm(update), np_norm(state.params)
  np.testing.assert_allclose(m["opt/update_norm"], update_norm, rtol=1e-5)
  np.testing.assert_allclose(m["opt/grad_norm"], m["opt/update_norm"], rtol=1e-6)
  np.testing.assert_allclose(m["opt/param_norm"], param_norm, rtol=1e-5)
  assert float(m["opt/lr"]) == 1.0


def test_bad_num_microbatches_raise(model, loss):
  graphdef, params = model
  with pytest.raises(ValueError, match="num_microbatches must be >= 1, got 0"):
    make_train_step(SGD, loss, num_microbatches=0)
  step3 = make_train_step(SGD, loss, num_microbatches=3)
  batch = make_batch(graphdef, params, seed=5)
  with pytest.raises(ValueError, match="batch size 8 is not divisible by 3 micro-batches"):
    step3(fresh_state(params), batch)


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_lr_schedules(schedule):
  lr = make_optimizer(learning_rate=0.1, warmup_steps=4, total_steps=12, schedule=schedule).lr_fn
  np.testing.assert_allclose([lr(i) for i in range(5)], [0.0, 0.025, 0.05, 0.075, 0.1], rtol=1e-6)
  if schedule == "cosine":
    # Half-way through the decay: 0.01 + (0.1 - 0.01) * (1 + cos(pi / 2)) / 2; ends at 10%.
    np.testing.assert_allclose([lr(8), lr(12), lr(50)], [0.055, 0.01, 0.01], rtol=1e-5)
  else:
    np.testing.assert_allclose([lr(8), lr(50)], [0.1, 0.1], rtol=1e-6)
  # No warmup means the full rate at the first update.
  lr0 = make_optimizer(learning_rate=0.1, warmup_steps=0, total_steps=12, schedule=schedule).lr_fn
  assert float(lr0(0)) == pytest.approx(0.1, rel=1e-6)
  # Phases too short for a decay (sft.steps=0 in grpo_gsm8k, rl.steps=1) still build.
  for warmup, total in [(0, 0), (0, 1), (3, 0), (3, 3)]:
    fn = make_optimizer(
      learning_rate=0.1, warmup_steps=warmup, total_steps=total, schedule=schedule
    ).lr_fn
    assert float(fn(0)) == pytest.approx(0.0 if warmup else 0.1, rel=1e-6)
  with pytest.raises(ValueError, match=r"unknown lr schedule 'linear'.*'constant', 'cosine'"):
    make_optimizer(learning_rate=0.1, warmup_steps=0, total_steps=1, schedule="linear")


def test_adamw_first_update_clipping_and_weight_decay():
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  grads = {"w": jnp.array([3.0, -4.0, 0.0])}  # global norm 5
  opt = make_optimizer(learning_rate=0.1, warmup_steps=0, total_steps=10, grad_clip=1.0)
  state = opt.init(params)
  updates, state = opt.update(grads, state, params)
  # Adam's first step is lr * g / (|g| + eps): a sign step (0 where the gradient is 0). rtol:
  # optax's bias corrections 1 - b^t are float32 (0.999 is inexact): ~7e-6 off in sqrt(v_hat).
  np.testing.assert_allclose(updates["w"], [-0.1, 0.1, 0.0], rtol=1e-5, atol=1e-9)
  # The moments saw the clipped gradient g * 1 / 5: mu = (1 - b1) * g_clipped.
  mu = optax.tree_utils.tree_get(state, "mu")
  np.testing.assert_allclose(mu["w"], [0.1 * 0.6, 0.1 * -0.8, 0.0], rtol=1e-6)
  # Zero gradients: only decoupled weight decay moves the params, by -lr * wd * p.
  opt = make_optimizer(learning_rate=0.1, warmup_steps=0, total_steps=10, weight_decay=0.5)
  zeros = {"w": jnp.zeros(3)}
  updates, _ = opt.update(zeros, opt.init(params), params)
  np.testing.assert_allclose(updates["w"], [-0.05, 0.1, -0.15], rtol=1e-6)


class _TokenNLL:
  """Supervised -log p of the loss tokens: a loss whose decrease is unambiguous."""

  def __init__(self, graphdef):
    self.graphdef = graphdef

  def denominator(self, batch):
    return jnp.sum(batch.loss_mask)

  def __call__(self, params, mb):
    logp = token_logprobs(self.graphdef, params, mb.tokens, mb.valid)
    total = -jnp.sum(logp * mb.loss_mask)
    return total, {"nll": (total, jnp.sum(mb.loss_mask))}


def test_lora_step_trains_only_the_adapters():
  cfg = CFG.replace(lora_rank=3, lora_alpha=8.0)
  graphdef, params = make_model(cfg, seed=0)
  opt = make_optimizer(learning_rate=3e-2, warmup_steps=0, total_steps=8, schedule="constant")
  step = make_train_step(opt, _TokenNLL(graphdef), num_microbatches=2, trainable="lora")
  batch = make_batch(graphdef, params, seed=6)
  state = init_state(jax.tree.map(jnp.copy, params), opt, trainable="lora")
  adapter0, base0 = split_lora(params)
  # The optimizer state is adapter-sized: Adam's two moments per adapter leaf, nothing else.
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert len(moments) == 2 * len(jax.tree.leaves(adapter0))
  assert sorted(x.shape for x in moments) == sorted(
    2 * [x.shape for x in jax.tree.leaves(adapter0)]
  )
  nll = []
  for _ in range(5):
    old = state
    state, m = step(state, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(old))  # donated, base params included
    nll.append(float(m["nll"]))
    adapter, _ = split_lora(state.params)
    np.testing.assert_allclose(m["opt/param_norm"], np_norm(adapter), rtol=1e-5)
  assert step._cache_size() == 1
  assert all(b < a for a, b in zip(nll, nll[1:], strict=False)) and nll[-1] < nll[0] - 0.05, nll
  adapter, base = split_lora(state.params)
  jax.tree.map(np.testing.assert_array_equal, base, base0)  # bitwise: the base is frozen
  for new, old in zip(jax.tree.leaves(adapter), jax.tree.leaves(adapter0), strict=True):
    assert np.abs(np.asarray(new) - np.asarray(old)).max() > 1e-4  # A and B both moved
  # The trained model, merged, is the same function: base graphdef, folded weights.
  merged_cfg, merged = merge_lora(cfg, state.params)
  plain_graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(merged_cfg, rngs=nnx.Rngs(0))))
  pos = positions_from_mask(batch.valid)
  want, _ = jax.jit(apply, static_argnums=0)(graphdef, state.params, batch.tokens, pos, batch.valid)
  got, _ = jax.jit(apply, static_argnums=0)(plain_graphdef, merged, batch.tokens, pos, batch.valid)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_trainable_lora_without_adapters_raises(model):
  _, params = model
  with pytest.raises(ValueError, match=r"trainable='lora' selects no params.*lora_rank > 0"):
    init_state(params, SGD, trainable="lora")


@pytest.mark.parametrize(
  "poison",
  [
    "nan_advantage",  # the loss is NaN
    "neg_inf_old_logprob",  # the ratio is inf: a loss that may look finite, a NaN gradient
  ],
)
def test_nonfinite_update_is_skipped_and_the_next_one_applies(model, loss, poison):
  # Adam, so that the optimizer state (moments, count) is something a NaN could poison too.
  graphdef, params = model
  opt = make_optimizer(learning_rate=1e-2, warmup_steps=0, total_steps=8)
  step = make_train_step(opt, loss)
  state = init_state(jax.tree.map(jnp.copy, params), opt)
  good = make_batch(graphdef, params, seed=7)
  state, m = step(state, good)
  assert float(m["opt/nonfinite"]) == 0.0 and int(state.step) == 1
  before = jax.device_get(state)
  if poison == "nan_advantage":
    bad = good._replace(advantages=good.advantages.at[2, P].set(jnp.nan))
  else:
    row = int(np.argmax(np.asarray(good.loss_mask).sum(1)))
    bad = good._replace(old_logprobs=good.old_logprobs.at[row, P].set(-jnp.inf))
  state, m = step(state, bad)
  assert float(m["opt/nonfinite"]) == 1.0
  # Skipped: params, optimizer state and the update count are bit for bit what they were.
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state)), strict=True):
    np.testing.assert_array_equal(a, b)
  state, m = step(state, good)
  assert float(m["opt/nonfinite"]) == 0.0 and int(state.step) == 2
  assert tree_max_abs(tree_diff(state.params, before.params)) > 1e-4
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(state)))
  assert step._cache_size() == 1
  # Without the guard the same batch poisons the params: the guard is what kept them.
  unguarded = make_train_step(opt, loss, skip_nonfinite=False)
  state, m = unguarded(init_state(jax.tree.map(jnp.copy, params), opt), bad)
  assert not all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(state.params)))
