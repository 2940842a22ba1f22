"""GRPOLoss and SFTLoss against numpy references from the model's logits; GRPO gradient vs FD."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models import ModelConfig, make_model
from jaxrl.models.transformer import apply, positions_from_mask
from jaxrl.rl.batch import TrainBatch
from jaxrl.rl.losses import AGGREGATIONS, POLICY_LOSSES, aggregate
from jaxrl.rl.objectives import GRPOLoss, SFTLoss

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
  loss = GRPOLoss(graphdef, temperature=TEMPERATURE, eps_low=0.2, eps_high=0.28, beta=0.05)
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
  loss = GRPOLoss(graphdef, temperature=TEMPERATURE, beta=0.0)
  total, metrics = jax.jit(loss)(params, poisoned)
  assert "rl/kl" not in metrics
  assert np.isfinite(float(total))
  np.testing.assert_allclose(total, metrics["rl/pg_loss"][0], rtol=1e-6)


def test_grpo_gradient_matches_finite_differences(model):
  graphdef, params = model
  batch = make_batch(model, seed=2)
  loss = GRPOLoss(graphdef, temperature=TEMPERATURE, eps_low=0.2, eps_high=0.28, beta=0.05)
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
  """GRPOLoss hands the loss mask (GSPO's |y_i|) and the constant normaliser through: its value
  equals the registered function aggregated by hand, and sum / denominator is what `aggregate`
  defines."""
  graphdef, params = model
  batch = make_batch(model, seed=5)
  loss = GRPOLoss(
    graphdef,
    temperature=TEMPERATURE,
    policy_loss=policy_loss,
    aggregation=aggregation,
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
