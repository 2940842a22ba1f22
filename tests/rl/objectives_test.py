"""PolicyLoss and SFTLoss against numpy references from the model's logits; GRPO gradient vs FD."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import KLConfig, OffPolicyConfig, PolicyLossConfig
from jaxrl.models import ModelConfig, make_model
from jaxrl.models.transformer import apply, positions_from_mask, token_logprobs
from jaxrl.rl.batch import TrainBatch
from jaxrl.rl.losses import AGGREGATIONS, POLICY_LOSSES, aggregate
from jaxrl.rl.objectives import PolicyLoss, SFTLoss

pytestmark = pytest.mark.integration

CFG = ModelConfig.tiny().replace(num_layers=1)
B, T, P = 6, 10, 4  # batch, columns, prompt bucket
TEMPERATURE = 0.7


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, tokens, valid):
  return apply(graphdef, params, tokens, positions_from_mask(valid), valid)[0]


@pytest.fixture(scope="module")
def model():
  return make_model(CFG, seed=1)


def np_logprobs(model, tokens, valid, temperature=1.0):
  """float64 log p(tokens[:, j] | tokens[:, :j]) and entropies from the model's raw logits."""
  z = np.asarray(_logits(*model, tokens, valid), np.float64)[:, :-1] / temperature
  z = z - z.max(-1, keepdims=True)
  logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
  logp = np.take_along_axis(logp_all, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  ent = -np.sum(np.exp(logp_all) * logp_all, -1)
  pad = ((0, 0), (1, 0))
  return np.pad(logp, pad), np.pad(ent, pad)


def make_batch(model, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CFG.vocab_size, size=(B, T)).astype(np.int32)
  cols = np.arange(T)[None]
  pad = rng.integers(0, 3, size=(B, 1))
  end = rng.integers(P + 1, T + 1, size=(B, 1))
  valid = (cols >= pad) & (cols < end)
  loss_mask = ((cols >= P) & valid).astype(np.float32)
  logp, _ = np_logprobs(model, tokens, valid, TEMPERATURE)
  adv = rng.normal(size=(B, 1)) * loss_mask
  old = (logp + rng.normal(0.0, 0.3, size=(B, T))) * loss_mask
  ref = (logp + rng.normal(0.0, 0.3, size=(B, T))) * loss_mask
  versions = np.where(loss_mask > 0, 0, -1).astype(np.int32)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return TrainBatch(
    jnp.asarray(tokens),
    jnp.asarray(valid),
    f32(loss_mask),
    f32(adv),
    f32(old),
    f32(ref),
    jnp.asarray(versions),
  )


def test_grpo_loss_matches_numpy_reference(model):
  graphdef, params = model
  batch = make_batch(model, seed=0)
  loss = PolicyLoss(
    graphdef,
    temperature=TEMPERATURE,
    loss=PolicyLossConfig(eps_low=0.2, eps_high=0.28),
    kl=KLConfig(beta=0.05),
  )
  total, metrics = jax.jit(loss)(params, batch)
  logp, ent = np_logprobs(model, batch.tokens, batch.valid, TEMPERATURE)
  m = np.asarray(batch.loss_mask, np.float64)
  a, old, ref = (
    np.asarray(x, np.float64) for x in (batch.advantages, batch.old_logprobs, batch.ref_logprobs)
  )
  ratio = np.exp(logp - old)
  pg = np.maximum(-ratio * a, -np.clip(ratio, 0.8, 1.28) * a)
  clipped = -np.clip(ratio, 0.8, 1.28) * a > -ratio * a
  kl = np.expm1(ref - logp) - (ref - logp)
  n = m.sum()
  assert 0 < np.sum(clipped * m) < n  # both branches are exercised
  np.testing.assert_allclose(total, np.sum((pg + 0.05 * kl) * m), rtol=1e-5, atol=1e-5)
  assert float(loss.denominator(batch)) == n
  want = {
    "rl/loss": np.sum((pg + 0.05 * kl) * m),
    "rl/pg_loss": np.sum(pg * m),
    "rl/kl": np.sum(kl * m),
    "rl/entropy": np.sum(ent * m),
    "rl/clip_frac": np.sum(clipped * m),
    "rl/logprob_gap": np.sum(np.abs(logp - old) * m),
    # Off-policy diagnostics, reported with no correction configured too.
    "offpolicy/kl_k1": np.sum((old - logp) * m),
    "offpolicy/kl_k3": np.sum((np.expm1(logp - old) - (logp - old)) * m),
    "offpolicy/clipped_frac": 0.0,
    "offpolicy/masked_frac": 0.0,
  }
  assert metrics.keys() == want.keys()
  for k, w in want.items():
    s, c = metrics[k]
    np.testing.assert_allclose(s, w, rtol=1e-5, atol=1e-5, err_msg=k)
    assert float(c) == n, k


def test_grpo_without_kl_never_reads_the_reference(model):
  graphdef, params = model
  batch = make_batch(model, seed=1)
  poisoned = batch._replace(ref_logprobs=jnp.full_like(batch.ref_logprobs, jnp.nan))
  loss = PolicyLoss(graphdef, temperature=TEMPERATURE, kl=KLConfig(beta=0.0))
  total, metrics = jax.jit(loss)(params, poisoned)
  assert "rl/kl" not in metrics
  assert np.isfinite(float(total))
  np.testing.assert_allclose(total, metrics["rl/pg_loss"][0], rtol=1e-6)


def test_grpo_gradient_matches_finite_differences(model):
  graphdef, params = model
  batch = make_batch(model, seed=2)
  loss = PolicyLoss(
    graphdef,
    temperature=TEMPERATURE,
    loss=PolicyLossConfig(eps_low=0.2, eps_high=0.28),
    kl=KLConfig(beta=0.05),
  )
  mean_loss = jax.jit(lambda p: loss(p, batch)[0] / loss.denominator(batch))
  grads = jax.jit(jax.grad(mean_loss))(params)
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = [jax.tree_util.keystr(path) for path, _ in flat]
  leaves, gleaves = [x for _, x in flat], jax.tree.leaves(grads)
  # The entry with the largest gradient in each of a few differently-used leaves.
  wanted = ("['embed']", "['head']", "['attn']['q']", "['attn']['o']", "['mlp']['down']")
  chosen = [i for i, n in enumerate(names) if any(w in n for w in wanted)]
  assert len(chosen) == len(wanted), names
  for i in chosen:
    g = np.asarray(gleaves[i])
    idx = np.unravel_index(np.argmax(np.abs(g)), g.shape)
    assert abs(g[idx]) > 1e-2, names[i]
    # A step small against the leaf's own scale: the embedding (std .02) goes through RMSNorm, so
    # a fixed h = 1e-2 would be half its scale and measure curvature, not the gradient.
    h = 0.05 * float(np.std(leaves[i]))
    values = []
    for sign in (1, -1):
      x = np.array(leaves[i])
      x[idx] += sign * h
      values.append(float(mean_loss(treedef.unflatten(leaves[:i] + [x] + leaves[i + 1 :]))))
    fd = (values[0] - values[1]) / (2 * h)
    np.testing.assert_allclose(fd, g[idx], rtol=1e-2, err_msg=names[i])


def test_sft_loss_is_token_mean_nll_of_completion_tokens(model):
  graphdef, params = model
  batch = make_batch(model, seed=3)
  loss = SFTLoss(graphdef)
  nll, metrics = jax.jit(loss)(params, batch)
  logp, _ = np_logprobs(model, batch.tokens, batch.valid)
  m = np.asarray(batch.loss_mask, np.float64)
  np.testing.assert_allclose(nll, -np.sum(logp * m), rtol=1e-5)
  assert float(loss.denominator(batch)) == m.sum()
  s, c = metrics["sft/loss"]
  np.testing.assert_allclose(s, nll, rtol=0)
  assert float(c) == m.sum()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES.names())
def test_every_registered_loss_and_aggregation_wires_through(model, policy_loss, aggregation):
  """PolicyLoss hands the loss mask (GSPO's |y_i|) and the constant normaliser through: its value
  equals the registered function aggregated by hand, and sum / denominator is what `aggregate`
  defines."""
  graphdef, params = model
  batch = make_batch(model, seed=5)
  loss = PolicyLoss(
    graphdef,
    temperature=TEMPERATURE,
    loss=PolicyLossConfig(name=policy_loss, aggregation=aggregation),
    max_tokens=T - P,
  )
  total, metrics = jax.jit(loss)(params, batch)
  logp = jnp.asarray(np_logprobs(model, batch.tokens, batch.valid, TEMPERATURE)[0], jnp.float32)
  per_token, _ = POLICY_LOSSES.get(policy_loss)(
    logp, batch.old_logprobs, batch.advantages, mask=batch.loss_mask
  )
  expect_sum, expect_den = aggregate(per_token, batch.loss_mask, aggregation, max_tokens=T - P)
  np.testing.assert_allclose(float(total), float(expect_sum), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(float(loss.denominator(batch)), float(expect_den))
  assert metrics["rl/loss"][1] == loss.denominator(batch)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_entropy_bonus_is_aggregated_like_the_loss(model, aggregation):
  graphdef, params = model
  batch = make_batch(model, seed=6)
  bonus_loss = PolicyLossConfig(aggregation=aggregation, entropy_coef=0.1)
  total, metrics = jax.jit(PolicyLoss(graphdef, TEMPERATURE, bonus_loss))(params, batch)
  plain = PolicyLossConfig(aggregation=aggregation)
  base, _ = jax.jit(PolicyLoss(graphdef, TEMPERATURE, plain))(params, batch)
  _, ent = np_logprobs(model, batch.tokens, batch.valid, TEMPERATURE)  # tempered entropy
  m = np.asarray(batch.loss_mask, np.float64)
  if aggregation == "token-mean":
    bonus = np.sum(ent * m)
  else:
    bonus = np.sum(np.sum(ent * m, -1) / np.maximum(m.sum(-1), 1))
  np.testing.assert_allclose(float(total), float(base) - 0.1 * bonus, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(metrics["rl/entropy"][0], np.sum(ent * m), rtol=1e-5)


def _on_policy_batch(model, seed):
  """old_logprobs = the learner's own log-probs (float32, the PolicyLoss forward)."""
  graphdef, params = model
  batch = make_batch(model, seed)
  logp = jax.jit(
    lambda p: token_logprobs(graphdef, p, batch.tokens, batch.valid, temperature=TEMPERATURE)
  )(params)
  return batch._replace(old_logprobs=logp * batch.loss_mask)


def test_is_corrections_leave_on_policy_data_unchanged(model):
  """ratio 1 => TIS / MIS (token and sequence) give the loss and gradient of no correction."""
  graphdef, params = model
  batch = _on_policy_batch(model, seed=7)
  names = ["none", "tis", "tis_seq", "mis", "mis_seq"]

  @jax.jit
  def all_grads(p):
    out = []
    for name in names:
      loss = PolicyLoss(
        graphdef,
        temperature=TEMPERATURE,
        loss=PolicyLossConfig(eps_high=0.28),
        offpolicy=OffPolicyConfig(is_correction=name),
      )
      out.append(jax.value_and_grad(lambda q, loss=loss: loss(q, batch)[0])(p))
    return out

  results = all_grads(params)
  (v0, g0), rest = results[0], results[1:]
  for name, (v, g) in zip(names[1:], rest, strict=True):
    # Bit-equal up to float32 rounding of a ratio that is exactly 1 in exact arithmetic (the
    # learner's log-probs come from a separately compiled forward).
    np.testing.assert_allclose(v, v0, rtol=1e-6, err_msg=name)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name)


FD_CASES = [dict(policy_loss=name) for name in POLICY_LOSSES.names()] + [
  dict(is_correction="tis", is_cap=1.3),
  dict(is_correction="tis_seq", is_cap=1.05),
  dict(is_correction="mis", mis_low=0.7, mis_high=1.4),
  dict(is_correction="mis_seq", mis_low=0.9, mis_high=1.1),
  dict(method="decoupled"),  # prox recomputed (in the batch)
  dict(method="decoupled", prox=False),  # prox interpolated by version lag
  dict(method="m2po", m2po_tau=0.05),
  dict(method="sat", sat_tail=1.0),
]


@pytest.mark.parametrize("case", FD_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_full_loss_gradient_matches_finite_differences_along_a_random_direction(model, case):
  """d/dt L(params + t u) at t = 0 by central differences equals <grad L, u>, for the full
  PolicyLoss (policy loss, off-policy correction, KL and entropy terms) of the tiny model.

  Stop-gradient parts (IS weights, masks, SAT bounds, CISPO's weight) are held at the unperturbed
  params in the finite difference, as autodiff treats them (PolicyLoss.from_logprobs's
  detached_logp). u is Gaussian, scaled per leaf by the leaf's RMS, so every parameter moves by
  ~h of its own scale. h = 1e-3: float32 loss evaluations carry ~1e-7 relative rounding, i.e.
  ~1e-4 absolute error after dividing by 2h against derivatives of O(0.1-1); the O(h^2) truncation
  is smaller still. rtol = 1e-2 keeps a tenfold margin over that; larger h crosses PPO's clip kinks
  (measured: 7% error at h = 3e-3), which the branch-count check below would flag.
  """
  graphdef, params = model
  case = dict(case)
  batch = make_batch(model, seed=8)
  rng = np.random.default_rng(9)
  mask = np.asarray(batch.loss_mask)
  if case.pop("prox", True) and (case.get("is_correction") or case.get("method")):
    prox = np.asarray(batch.old_logprobs) + rng.normal(0.0, 0.3, mask.shape)
    batch = batch._replace(prox_logprobs=jnp.asarray(prox * mask, jnp.float32))
  else:
    batch = batch._replace(learner_version=jnp.full((B,), 2, jnp.int32))  # lag 2
  name = case.pop("policy_loss", "ppo_clip")
  loss = PolicyLoss(
    graphdef,
    temperature=TEMPERATURE,
    loss=PolicyLossConfig(name=name, eps_low=0.2, eps_high=0.28, entropy_coef=0.01),
    kl=KLConfig(beta=0.05),
    offpolicy=OffPolicyConfig(**case),  # the rest of the case: the off-policy section
  )
  den = loss.denominator(batch)
  grads = jax.jit(jax.grad(lambda p: loss(p, batch)[0] / den))(params)
  leaves, treedef = jax.tree.flatten(params)
  u = [rng.normal(size=x.shape).astype(np.float32) * np.sqrt(np.mean(np.square(x))) for x in leaves]
  g_leaves = jax.tree.leaves(grads)
  directional = sum(float(np.vdot(np.asarray(g), v)) for g, v in zip(g_leaves, u, strict=True))

  forward = jax.jit(
    lambda p: token_logprobs(
      graphdef, p, batch.tokens, batch.valid, temperature=TEMPERATURE, with_entropy=True
    )
  )
  frozen = forward(params)[0]

  def at(t):
    logp, ent = forward(treedef.unflatten([x + t * v for x, v in zip(leaves, u, strict=True)]))
    total, metrics = loss.from_logprobs(logp, ent, batch, detached_logp=frozen)
    return float(total / den), float(metrics["rl/clip_frac"][0]), metrics

  h = 1e-3
  (plus, clip_p, _), (minus, clip_m, _), (_, clip_0, m0) = at(h), at(-h), at(0.0)
  assert clip_p == clip_m == clip_0  # no token switches clip branch within [-h, h]
  if case.get("is_correction") or case.get("method") in ("m2po", "sat"):
    # The correction acts on this batch: some tokens are truncated, masked or contracted.
    active = m0["offpolicy/clipped_frac"][0] + m0["offpolicy/masked_frac"][0]
    assert 0 < float(active) < float(np.sum(mask)), case
  assert abs(directional) > 1e-2
  np.testing.assert_allclose((plus - minus) / (2 * h), directional, rtol=1e-2)
