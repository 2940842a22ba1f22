"""The MoE auxiliary losses in the training objectives (rl.loss / sft load_balance_coef and
router_z_coef): the router z-loss by hand, the losses added to the policy and SFT losses from
the same forward's routing, gradients reaching the router through them alone, the end-to-end
run's metrics, and the config error on a dense model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import numpy_model

from configs import grpo_arith
from jaxrl.config import ConfigError, PolicyLossConfig, validate
from jaxrl.metrics import read_jsonl
from jaxrl.models import ModelConfig
from jaxrl.models.moe import load_balancing_loss, router_z_loss
from jaxrl.models.transformer import apply_with_routing, positions_from_mask
from jaxrl.rl.batch import TrainBatch
from jaxrl.rl.loop import Trainer
from jaxrl.rl.objectives import PolicyLoss, SFTLoss

pytestmark = pytest.mark.integration

CFG = ModelConfig.tiny_moe().replace(num_layers=2)
B, T, P = 4, 9, 3


def test_router_z_loss_by_hand():
  logits = np.array([[[0.0, 0.0], [np.log(3.0), 0.0]], [[1.0, -1.0], [5.0, 5.0]]], np.float32)
  valid = np.array([[True, True], [True, False]])
  z = np.log(np.exp(logits).sum(-1))  # [2, 2]: log 2, log 4, log(e + 1/e), 5 + log 2
  want = (z[0, 0] ** 2 + z[0, 1] ** 2 + z[1, 0] ** 2) / 3
  np.testing.assert_allclose(
    router_z_loss(jnp.asarray(logits), jnp.asarray(valid)), want, rtol=1e-6
  )
  np.testing.assert_allclose(router_z_loss(jnp.asarray(logits)), np.mean(z**2), rtol=1e-6)


def _batch(seed, zero_advantage):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CFG.vocab_size, size=(B, T)).astype(np.int32)
  cols = np.arange(T)[None]
  valid = (cols >= rng.integers(0, 2, size=(B, 1))) & (cols < rng.integers(P + 2, T + 1, (B, 1)))
  mask = ((cols >= P) & valid).astype(np.float32)
  adv = (0.0 if zero_advantage else rng.normal(size=(B, 1))) * mask
  old = rng.normal(-2.0, 0.3, size=(B, T)) * mask
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  return TrainBatch(
    jnp.asarray(tokens), jnp.asarray(valid), f32(mask), f32(adv), f32(old), f32(old),
    jnp.asarray(np.where(mask > 0, 0, -1).astype(np.int32)),
  )  # fmt: skip


def _aux(graphdef, params, batch):
  """The load-balancing and z losses of the batch's real tokens, from a separate forward."""
  _, _, routing = apply_with_routing(
    graphdef, params, batch.tokens, positions_from_mask(batch.valid), batch.valid
  )
  logits = routing["router_logits"]
  return (
    float(load_balancing_loss(logits, CFG.experts_per_token, batch.valid[None])),
    float(router_z_loss(logits, batch.valid[None])),
  )


def test_policy_and_sft_losses_add_the_aux_losses_and_train_the_router_through_them():
  graphdef, params = numpy_model(CFG, 0)
  batch = _batch(0, zero_advantage=True)  # the policy-gradient term is exactly zero
  lb, z = _aux(graphdef, params, batch)
  assert lb > 0 and z > 0
  n = float(jnp.sum(batch.loss_mask))
  plain = PolicyLoss(graphdef)
  aux = PolicyLoss(graphdef, loss=PolicyLossConfig(load_balance_coef=0.01, router_z_coef=0.001))
  total0, _ = jax.jit(plain)(params, batch)
  total, metrics = jax.jit(aux)(params, batch)
  assert float(total0) == 0.0
  np.testing.assert_allclose(float(total), (0.01 * lb + 0.001 * z) * n, rtol=1e-5)
  np.testing.assert_allclose(metrics["moe/load_balance"][0], lb, rtol=1e-5)
  np.testing.assert_allclose(metrics["moe/router_z"][0], z, rtol=1e-5)

  # The router learns from the aux losses alone (zero advantages: no policy gradient).
  def router_grads(loss):
    g = jax.jit(jax.grad(lambda p: loss(p, batch)[0]))(params)
    return [
      np.asarray(v)
      for path, v in jax.tree_util.tree_leaves_with_path(g)
      if "router" in jax.tree_util.keystr(path)
    ]

  assert all(np.all(g == 0) for g in router_grads(plain))
  assert all(np.abs(g).max() > 0 for g in router_grads(aux))
  # SFT: the token-sum NLL plus the same aux losses, weighted by the loss tokens.
  nll, _ = jax.jit(SFTLoss(graphdef))(params, batch)
  sft, sft_metrics = jax.jit(SFTLoss(graphdef, load_balance_coef=0.01, router_z_coef=0.001))(
    params, batch
  )
  np.testing.assert_allclose(float(sft), float(nll) + (0.01 * lb + 0.001 * z) * n, rtol=1e-5)
  assert set(sft_metrics) == {"sft/loss", "moe/load_balance", "moe/router_z"}


@pytest.mark.e2e
def test_a_moe_run_reports_its_aux_losses_in_both_phases_and_trains_every_row(
  tmp_path, smoke_config
):
  aux = {"load_balance_coef": 0.01, "router_z_coef": 0.001}
  cfg = smoke_config(
    tmp_path,
    model={"preset": "tiny_moe"},
    sft={"steps": 4, **aux},
    rl={"steps": 2, "loss": aux},
    eval={"every": 0, "num_examples": 8},
  )
  trainer = Trainer(cfg, log=lambda *_: None)
  assert not trainer.learner.skip_rows  # the aux losses read every token
  trainer.run()
  trainer.close()
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  for phase in ("sft", "rl"):
    got = [r for r in rows if r["phase"] == phase and "moe/load_balance" in r]
    assert got, phase
    # k = 2 of 5 experts: the load-balancing loss is k = 2 when routing is uniform, more if not.
    assert all(r["moe/load_balance"] >= 2.0 - 1e-4 and r["moe/router_z"] > 0 for r in got)


def test_aux_losses_on_a_dense_model_are_a_config_error(tmp_path):
  c = grpo_arith.get_config("smoke")
  c.workdir, c.model.preset = str(tmp_path), "tiny"
  c.rl.loss.router_z_coef = 0.001
  with pytest.raises(
    ConfigError, match=r"config\.rl\.loss\.router_z_coef=0\.001 is invalid.*no MoE"
  ):
    Trainer(validate(c), log=lambda *_: None)
