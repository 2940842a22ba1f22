"""The model's kernel switches (ModelConfig.attention_kernel / moe_kernel / matmul_kernel and
kernel_interpret, config.model.* in a run): each Pallas kernel, run through the interpreter at
its call site in a whole model (and the MoE's plain-jnp `tiled` grouped matmul), gives what the
reference path gives; bad choices are named."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import apply, graphdef_of, perturbed_model, small_engine, tiny_model

from jaxrl.config import ConfigError, config_module, validate
from jaxrl.kernels import backend_problem
from jaxrl.models import ModelConfig
from jaxrl.models.transformer import positions_from_mask
from jaxrl.quant import quantize_params, quantize_weight, quantized_einsum
from jaxrl.rollout.driver import Driver, Request
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration

INTERPRET = dict(kernel_interpret=True)


@pytest.fixture
def pallas_calls(monkeypatch):
  """Counts the Pallas kernels traced, by module: proof that a switch reached its call site."""
  # The modules, not the package's functions of the same names.
  gmm, paged, qmm = (
    importlib.import_module(f"jaxrl.kernels.{m}")
    for m in ("grouped_matmul", "paged_attention", "quant_matmul")
  )
  counts = {"attention": 0, "moe": 0, "matmul": 0}
  for key, mod, name in [
    ("attention", paged, "paged_attention_pallas"),
    ("attention", paged, "paged_attention_gpu"),
    ("moe", gmm, "_pallas"),
    ("moe", gmm, "_triton"),
    ("moe", gmm, "tiled"),
    ("matmul", qmm, "_pallas"),
  ]:
    real = getattr(mod, name)

    def counted(*a, _real=real, _key=key, **kw):
      counts[_key] += 1
      return _real(*a, **kw)

    monkeypatch.setattr(mod, name, counted)
  return counts


def _tokens(cfg, b=2, t=7, seed=3):
  tokens = jax.random.randint(jax.random.key(seed), (b, t), 3, cfg.vocab_size)
  valid = jnp.ones((b, t), bool).at[1, :2].set(False)
  return tokens, positions_from_mask(valid), valid


@pytest.mark.parametrize(
  "mode, impl", [("int8", "pallas_tpu"), ("int8", "pallas_gpu"), ("fp8", "pallas_tpu")]
)
def test_quantized_projections_through_the_matmul_kernel_equal_the_reference(
  mode, impl, pallas_calls
):
  cfg, graphdef, params = tiny_model()
  qparams = quantize_params(params, mode)
  tokens, pos, valid = _tokens(cfg)
  want, _ = apply(graphdef, qparams, tokens, pos, valid)
  assert pallas_calls == {"attention": 0, "moe": 0, "matmul": 0}
  kgraph = graphdef_of(cfg.replace(matmul_kernel=impl, **INTERPRET))
  got, _ = apply(kgraph, qparams, tokens, pos, valid)
  assert pallas_calls["matmul"] == 7 * cfg.num_layers  # q, k, v, o, gate, up, down
  # The same 8-bit codes and scales: int8 sums are exact in int32 either way, fp8 ones are
  # float32 sums in another order; only the final rescale's rounding can differ.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  # ... and the quantized logits are not the float ones (the kernel really ran 8-bit codes).
  float_logits, _ = apply(graphdef, params, tokens, pos, valid)
  assert np.abs(np.asarray(got) - np.asarray(float_logits)).max() > 1e-3


def test_block_scaled_weights_have_no_matmul_kernel():
  w = jax.random.normal(jax.random.key(0), (8, 6))
  q = quantize_weight(w, 1, "fp8_block")
  x = jnp.ones((2, 3, 8))
  want = quantized_einsum("BTD,DF->BTF", x, q)  # the reference runs, and so does "auto"
  np.testing.assert_array_equal(quantized_einsum("BTD,DF->BTF", x, q, impl="auto"), want)
  with pytest.raises(ValueError, match="no quantized-matmul kernel"):
    quantized_einsum("BTD,DF->BTF", x, q, impl="pallas_tpu", interpret=True)


def _requests(temperature):
  prompts = [[1, 5, 9, 17, 30], [1, 40, 41], [1, 100, 7, 8, 9, 10, 11]]
  return [
    Request(p, i, sampling=SamplingParams(temperature=temperature), max_new_tokens=12)
    for i, p in enumerate(prompts)
  ]


@pytest.mark.parametrize(
  "impl, kv_dtype", [("pallas_tpu", "auto"), ("pallas_tpu", "fp8"), ("pallas_gpu", "auto")]
)
def test_engine_with_the_paged_attention_kernel_decodes_what_the_reference_does(
  impl, kv_dtype, pallas_calls
):
  cfg, graphdef, params = tiny_model()
  kcfg = cfg.replace(attention_kernel=impl, **INTERPRET)
  runs = {}
  for name, (c, g) in {"ref": (cfg, graphdef), "kernel": (kcfg, graphdef_of(kcfg))}.items():
    driver = Driver(small_engine(c, g, kv_dtype=kv_dtype), steps_per_call=3, eos_id=None)
    runs[name] = {
      t: sorted(driver.run(params, _requests(t), seed=0).finished, key=lambda x: x.request_id)
      for t in (0.0, 1.0)
    }
    # Traced at the engine's prefill and decode programs' attention layers, kernel run only.
    assert (pallas_calls["attention"] > 0) == (name == "kernel")
  for t in (0.0, 1.0):
    for a, b in zip(runs["ref"][t], runs["kernel"][t], strict=True):
      # Same tokens (greedy, and sampled from the same keys); log-probs equal up to the
      # online softmax's summation order.
      assert list(a.tokens) == list(b.tokens)
      np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-5)


def _moe_cfg(**kw):
  return ModelConfig.tiny().replace(
    num_experts=5, experts_per_token=2, moe_mlp_dim=22, rope_theta=1000.0, **kw
  )


@pytest.mark.parametrize(
  "scan, impl",
  [(False, "pallas_tpu"), (True, "pallas_tpu"), (False, "pallas_gpu"), (True, "tiled")],
)
def test_moe_through_the_grouped_matmul_kernel_equals_ragged_dot_with_gradients(
  scan, impl, pallas_calls
):
  cfg = _moe_cfg(scan_layers=scan)
  graphdef, params = perturbed_model(cfg)
  kgraph = graphdef_of(cfg.replace(moe_kernel=impl, **INTERPRET))
  tokens, pos, valid = _tokens(cfg)

  def loss(g, p):
    logits, _ = apply(g, p, tokens, pos, valid)
    return jnp.sum(jnp.where(valid[..., None], jax.nn.log_softmax(logits), 0.0)[..., :9])

  want, want_grad = jax.value_and_grad(lambda p: loss(graphdef, p))(params)
  assert pallas_calls["moe"] == 0  # the reference: jax.lax.ragged_dot
  got, got_grad = jax.value_and_grad(lambda p: loss(kgraph, p))(params)
  assert pallas_calls["moe"] >= 3  # gate, up, down (per layer, or once in the scanned body)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(want_grad), jax.tree.leaves(got_grad), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
  experts = [g for path, g in jax.tree_util.tree_leaves_with_path(got_grad) if "gate" in str(path)]
  assert experts and all(np.abs(np.asarray(g)).max() > 0 for g in experts)


def test_bad_kernel_choices_are_named():
  with pytest.raises(ValueError, match="model.moe_kernel='triton'"):
    ModelConfig.tiny().replace(moe_kernel="triton")
  with pytest.raises(ValueError, match="kernel_interpret"):
    ModelConfig.tiny().replace(kernel_interpret="yes")
  # JAX's Triton paged attention lowers only power-of-two sizes (tests/kernels/lowering_test.py).
  with pytest.raises(ValueError, match="power-of-two model.head_dim.*this model's is 14"):
    ModelConfig.tiny().replace(attention_kernel="pallas_gpu")
  assert ModelConfig.tiny().replace(attention_kernel="pallas_gpu", head_dim=16).head_dim == 16
  assert ModelConfig.tiny().replace(attention_kernel="pallas_gpu", kernel_interpret=True)
  assert backend_problem("pallas_tpu", False, "tpu") is None
  assert backend_problem("pallas_gpu", True, "cpu") is None
  assert "GPU only" in backend_problem("pallas_gpu", False, "tpu")
  base = config_module("configs/grpo_arith.py").get_config("smoke")
  c = base.copy_and_resolve_references()
  c.model.attention_kernel = "pallas_tpu"  # this machine is a CPU: needs the interpreter
  with pytest.raises(ConfigError, match="model.attention_kernel='pallas_tpu'.*TPU only"):
    validate(c)
  c.model.kernel_interpret = True
  assert validate(c).model.attention_kernel == "pallas_tpu"
  c = base.copy_and_resolve_references()
  c.model.matmul_kernel, c.model.kernel_interpret = "pallas_gpu", True
  with pytest.raises(ConfigError, match="model.matmul_kernel.*'none' has no kernel"):
    validate(c)
  c.rl.rollout.quantize = "fp8_block"
  with pytest.raises(ConfigError, match="'fp8_block' has no kernel"):
    validate(c)
  c.model.matmul_kernel = "auto"  # the backend's kernel where one applies: none, so reference
  assert validate(c).model.matmul_kernel == "auto"
  c.model.matmul_kernel = "pallas_gpu"
  c.rl.rollout.quantize = "int8"
  assert validate(c).model.matmul_kernel == "pallas_gpu"
