"""On-policy distillation: exact-expectation gradients, numpy KL, invariants, a learning run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import make_model, token_logprobs
from jaxrl.rl.distill import (
  AdaptiveWindow,
  DistillBatch,
  DistillLoss,
  forward_kl_topk,
  grad_alignment,
  prefix_window,
  reverse_kl_sampled,
  teacher_scores,
)
from jaxrl.rl.train_step import init_state, make_optimizer, make_train_step

pytestmark = pytest.mark.integration


def test_reverse_kl_surrogate_has_the_kl_gradient_in_expectation():
  # For one categorical, E_{y ~ pi}[surrogate gradient] (enumerated exactly) = grad KL(pi || pt).
  rng = np.random.default_rng(0)
  theta = jnp.asarray(rng.normal(size=7), jnp.float32)
  teacher = jax.nn.log_softmax(jnp.asarray(rng.normal(size=7), jnp.float32))

  def expected_surrogate(th):
    logp = jax.nn.log_softmax(th)
    probs = jax.lax.stop_gradient(jnp.exp(logp))  # the sampling distribution is not differentiated
    surrogate, _ = reverse_kl_sampled(logp, teacher)
    return jnp.sum(probs * surrogate)

  def kl(th):
    logp = jax.nn.log_softmax(th)
    return jnp.sum(jnp.exp(logp) * (logp - teacher))

  np.testing.assert_allclose(jax.grad(expected_surrogate)(theta), jax.grad(kl)(theta), atol=1e-6)


def test_forward_kl_topk_equals_exact_kl_at_full_k_and_renormalises():
  rng = np.random.default_rng(1)
  s = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(2, 3, 6)), jnp.float32))
  t = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(2, 3, 6)), jnp.float32))
  top_logp, top_ids = jax.lax.top_k(t, 6)
  ref = np.sum(np.exp(t) * (t - s), axis=-1)
  np.testing.assert_allclose(forward_kl_topk(s, top_ids, top_logp), ref, atol=1e-5)
  # k = 2: the teacher is renormalised over its two best tokens.
  top_logp, top_ids = jax.lax.top_k(t, 2)
  tn = np.asarray(top_logp) - np.log(np.exp(np.asarray(top_logp)).sum(-1, keepdims=True))
  sk = np.take_along_axis(np.asarray(s), np.asarray(top_ids), -1)
  ref2 = np.sum(np.exp(tn) * (tn - sk), axis=-1)
  np.testing.assert_allclose(forward_kl_topk(s, top_ids, top_logp), ref2, atol=1e-5)


def test_prefix_window_keeps_first_loss_tokens():
  m = np.array([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]], np.float32)
  np.testing.assert_array_equal(prefix_window(m, 3), [[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(prefix_window(m, None), m)


def test_adaptive_window_rule_and_errors():
  w = AdaptiveWindow(window=8, min_window=2, max_window=32, probe_every=5, low=0.5, high=0.9)
  assert w.is_probe(10) and not w.is_probe(11)
  assert w.update(0.2) == 16 and w.update(0.1) == 32 and w.update(0.0) == 32
  assert w.update(0.7) == 32  # inside [low, high]: keep
  assert w.update(0.99) == 16
  w.load_state_dict({"window": 2})
  assert w.update(1.0) == 2 and w.state_dict() == {"window": 2}
  with pytest.raises(ValueError, match="min_window"):
    AdaptiveWindow(window=1, min_window=2)
  with pytest.raises(ValueError, match="low < high"):
    AdaptiveWindow(window=4, low=0.9, high=0.5)


def test_grad_alignment():
  a = {"x": jnp.array([1.0, 0.0]), "y": jnp.array([[0.0]])}
  assert float(grad_alignment(a, a)) == pytest.approx(1.0)
  b = {"x": jnp.array([0.0, 3.0]), "y": jnp.array([[0.0]])}
  assert float(grad_alignment(a, b)) == pytest.approx(0.0)
  c = jax.tree.map(lambda x: -2.0 * x, a)
  assert float(grad_alignment(a, c)) == pytest.approx(-1.0)


def _batch(graphdef_t, params_t, tokens, valid, loss_mask, student_logp, k):
  sampled, ids, top = jax.jit(lambda p, t, v: teacher_scores(graphdef_t, p, t, v, top_k=k))(
    params_t, tokens, valid
  )
  return DistillBatch(tokens, valid, loss_mask, student_logp, sampled, ids, top)


def _data(cfg, b=4, t=9, seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(b, t)), jnp.int32)
  valid = jnp.ones((b, t), bool).at[0, :2].set(False)
  loss_mask = jnp.zeros((b, t), jnp.float32).at[:, 4:].set(1.0)
  return tokens, valid, loss_mask


def test_teacher_scores_match_learner_logprobs():
  cfg = ModelConfig.tiny(vocab_size=31)
  g, p = make_model(cfg, seed=3)
  tokens, valid, _ = _data(cfg)
  sampled, ids, top = jax.jit(lambda p, t, v: teacher_scores(g, p, t, v, top_k=4))(p, tokens, valid)
  ref = jax.jit(lambda p, t, v: token_logprobs(g, p, t, v))(p, tokens, valid)
  np.testing.assert_allclose(sampled[:, 1:], ref[:, 1:], atol=1e-5)
  assert ids.shape == (4, 9, 4) and bool(jnp.all(top[..., :-1] >= top[..., 1:]))


def test_identical_teacher_gives_zero_loss_and_zero_gradient():
  cfg = ModelConfig.tiny(vocab_size=31)
  g, p = make_model(cfg, seed=3)
  tokens, valid, loss_mask = _data(cfg)
  logp = jax.jit(lambda p, t, v: token_logprobs(g, p, t, v))(p, tokens, valid)
  batch = _batch(g, p, tokens, valid, loss_mask, logp, k=cfg.vocab_size)
  for mode in ("reverse_kl", "forward_kl_topk", "mixed"):
    loss = DistillLoss(g, loss=mode)
    (total, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(p, batch)
    assert abs(float(total)) < 1e-5, mode
    gnorm = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grads))
    assert gnorm < 1e-5, (mode, gnorm)
    kl_sum, n = metrics["distill/reverse_kl"]
    assert abs(float(kl_sum / n)) < 1e-6


@pytest.mark.parametrize("mode", ["reverse_kl", "forward_kl_topk"])
def test_student_moves_towards_teacher(mode):
  cfg = ModelConfig.tiny(vocab_size=31)
  g, student = make_model(cfg, seed=1)
  _, teacher = make_model(cfg, seed=2)
  tokens, valid, loss_mask = _data(cfg, b=8)
  score = jax.jit(lambda p: token_logprobs(g, p, tokens, valid))
  batch = _batch(g, teacher, tokens, valid, loss_mask, score(student), k=8)
  opt = make_optimizer(learning_rate=3e-3, warmup_steps=0, total_steps=30, schedule="constant")
  step = make_train_step(opt, DistillLoss(g, loss=mode))
  state = init_state(jax.tree.map(jnp.copy, student), opt)

  def distance(params):
    # reverse_kl moves each sampled token's log-prob onto the teacher's; forward_kl_topk
    # matches the teacher's top-k distribution.
    if mode == "reverse_kl":
      gap = jnp.abs(score(params) - batch.teacher_logprobs) * loss_mask
      return float(jnp.sum(gap) / jnp.sum(loss_mask))
    return float(
      jax.jit(lambda p: DistillLoss(g, loss=mode)(p, batch)[1]["distill/forward_kl_topk"])(params)[
        0
      ]
      / jnp.sum(loss_mask)
    )

  before = distance(jax.tree.map(jnp.copy, student))
  for _ in range(30):
    state, _ = step(state, batch)
  assert distance(state.params) < 0.5 * before
  assert step._cache_size() == 1


def test_bad_loss_name_lists_the_valid_ones():
  with pytest.raises(ValueError, match="reverse_kl"):
    DistillLoss(None, loss="jsd")
  with pytest.raises(ValueError, match="alpha"):
    DistillLoss(None, alpha=1.5)


@pytest.mark.parametrize("mode", ["reverse_kl", "forward_kl_topk", "mixed"])
def test_distill_loss_gradient_matches_finite_differences(mode):
  """d/dt L(params + t u) at t = 0 by central differences equals <grad L, u> (h, rtol as in
  objectives_test). The reverse-KL surrogate's weight sg(log pi_s - log pi_t) is held at the
  unperturbed params, as autodiff treats it: the finite difference runs on a batch whose
  teacher log-probs are shifted so that the weight is that constant."""
  cfg = ModelConfig.tiny(vocab_size=31)
  g, student = make_model(cfg, seed=1)
  _, teacher = make_model(cfg, seed=2)
  tokens, valid, loss_mask = _data(cfg, b=4)
  score = jax.jit(lambda p: token_logprobs(g, p, tokens, valid))
  batch = _batch(g, teacher, tokens, valid, loss_mask, score(student), k=8)
  loss = DistillLoss(g, loss=mode, alpha=0.3)
  den = loss.denominator(batch)
  grads = jax.jit(jax.grad(lambda p: loss(p, batch)[0] / den))(student)
  rng = np.random.default_rng(5)
  leaves, treedef = jax.tree.flatten(student)
  u = [rng.normal(size=x.shape).astype(np.float32) * np.sqrt(np.mean(np.square(x))) for x in leaves]
  directional = sum(
    float(np.vdot(np.asarray(gr), v)) for gr, v in zip(jax.tree.leaves(grads), u, strict=True)
  )
  k1_frozen = score(student) - batch.teacher_logprobs

  def at(t):
    p = treedef.unflatten([x + t * v for x, v in zip(leaves, u, strict=True)])
    # teacher' = logp(p) - k1_frozen keeps sg(logp - teacher') = k1_frozen at every t.
    b = batch._replace(teacher_logprobs=score(p) - k1_frozen)
    return float(jax.jit(lambda q: loss(q, b)[0] / den)(p))

  h = 1e-3
  assert abs(directional) > 1e-3
  np.testing.assert_allclose((at(h) - at(-h)) / (2 * h), directional, rtol=1e-2)
