"""The kernels on a mesh of 8 simulated devices (jaxrl.kernels.partition): each Pallas kernel,
wrapped in a shard_map per kv-head shard (paged attention), per column or row shard of its
weight (quantized matmul) or whole (grouped matmul), gives through the Pallas interpreter what
its reference gives unsharded; the split each weight gets is the one its layout implies; and the
rollout engine decodes the same tokens with every kernel on, on the mesh, as without them off
it."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import perturbed_model, small_engine

from jaxrl.kernels import PagedKV, grouped_matmul, paged_attention
from jaxrl.kernels.partition import kernel_mesh, matmul_split
from jaxrl.mesh import make_mesh, use_mesh
from jaxrl.models import ModelConfig
from jaxrl.quant import quantize_params, quantize_weight, quantized_einsum
from jaxrl.rollout.driver import Driver, Request
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture
def mesh():
  return make_mesh(fsdp=4, tensor=2)


def test_kernels_are_wrapped_only_on_a_mesh_of_several_devices(mesh):
  assert kernel_mesh() is None
  with use_mesh(mesh, "fsdp_tp"):
    assert kernel_mesh() is not None
    jax.shard_map(lambda x: _no_mesh_inside(x), in_specs=jax.P(), out_specs=jax.P())(1.0)
  with use_mesh(make_mesh(fsdp=1, tensor=1, devices=jax.devices()[:1]), "fsdp_tp"):
    assert kernel_mesh() is None


def _no_mesh_inside(x):
  assert kernel_mesh() is None  # inside a shard_map every axis is manual: called as it is
  return x


def test_each_weight_is_split_as_its_layout_implies(mesh):
  with use_mesh(mesh, "fsdp_tp"):  # embed -> fsdp (storage), heads / mlp -> tensor
    assert matmul_split(mesh, ("embed", "q_heads", "head_dim"), (48, 6, 16), 1) == ("n", "tensor")
    assert matmul_split(mesh, ("q_heads", "head_dim", "embed"), (6, 16, 48), 2) == ("k", "tensor")
    assert matmul_split(mesh, ("mlp", "embed"), (82, 48), 1) == ("k", "tensor")
    assert matmul_split(mesh, ("embed", "mlp"), (48, 82), 1) == ("n", "tensor")
    assert matmul_split(mesh, ("embed", "kv_heads", "head_dim"), (48, 3, 16), 1) == (None, None)
    assert matmul_split(mesh, None, (48, 82), 1) == (None, None)
  with use_mesh(mesh, "replicated"):
    assert matmul_split(mesh, ("embed", "mlp"), (48, 82), 1) == (None, None)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize(
  "eq, axes, x_shape, w_shape",
  [
    ("BTD,DNH->BTNH", ("embed", "q_heads", "head_dim"), (3, 5, 48), (48, 6, 16)),
    ("BTNH,NHD->BTD", ("q_heads", "head_dim", "embed"), (3, 5, 6, 16), (6, 16, 48)),
    ("BTD,DNH->BTNH", ("embed", "kv_heads", "head_dim"), (3, 5, 48), (48, 3, 16)),
  ],
  ids=["columns", "rows", "whole"],
)
def test_the_quantized_matmul_per_shard_equals_the_reference(
  mesh, impl, eq, axes, x_shape, w_shape
):
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, x_shape)
  in_ndim = len(x_shape) - 2  # the contracted axes: x's after B, T
  q = quantize_weight(jax.random.normal(kw, w_shape), in_ndim, "int8")
  want = quantized_einsum(eq, x, q)
  with use_mesh(mesh, "fsdp_tp"):
    got = jax.jit(lambda x, q: quantized_einsum(eq, x, q, impl=impl, interpret=True, w_axes=axes))(
      x, q
    )
  # int8 codes: per-shard int32 sums are exact; a row split adds float32 partial products.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_paged_attention_per_kv_head_shard_equals_the_reference(mesh, impl):
  rng = np.random.default_rng(0)
  k_heads, pages, page_size, h, b = 4, 12, 4, 16, 3
  kp, vp = (jnp.asarray(rng.normal(size=(k_heads, pages, page_size, h)), jnp.float32) for _ in "kv")
  table = jnp.asarray(np.stack([rng.permutation(pages)[:3] for _ in range(b)]), jnp.int32)
  lengths = jnp.asarray([1, 7, 12], jnp.int32)
  q = jnp.asarray(rng.normal(size=(b, 1, 8, h)), jnp.float32)
  pos = (lengths - 1)[:, None]
  cache = PagedKV(kp, vp, table, lengths)
  want = paged_attention(q, cache, pos, impl="reference")
  with use_mesh(mesh, "fsdp_tp"):  # kv heads split over tensor = 2
    got = jax.jit(lambda q, c, p: paged_attention(q, c, p, impl=impl, interpret=True))(
      q, cache, pos
    )
  # As off the mesh (tests/models/kernel_select_test.py): the online softmax's summation order.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_the_grouped_matmul_on_a_mesh_equals_ragged_dot_with_gradients(mesh):
  kl, kr = jax.random.split(jax.random.key(1))
  lhs, rhs = jax.random.normal(kl, (37, 24)), jax.random.normal(kr, (3, 24, 40))
  sizes = jnp.asarray([10, 0, 20], jnp.int32)

  def loss(impl, interpret):
    return lambda a, b: jnp.sum(grouped_matmul(a, b, sizes, impl=impl, interpret=interpret) ** 2)

  want = jax.value_and_grad(loss("reference", False), (0, 1))(lhs, rhs)
  with use_mesh(mesh, "fsdp_tp"):
    got = jax.jit(jax.value_and_grad(loss("pallas_tpu", True), (0, 1)))(lhs, rhs)
  # float32 tile products against ragged_dot's: summation order only.
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "moe, context", [(False, True), (True, True), (False, False)], ids=["dense", "moe", "no_context"]
)
def test_the_engine_on_a_mesh_with_every_kernel_decodes_what_the_reference_does(mesh, moe, context):
  # no_context: driven outside `use_mesh`, the engine's programs take its own mesh and rules.
  cfg = ModelConfig.tiny().replace(head_dim=16)
  if moe:
    cfg = cfg.replace(num_experts=4, experts_per_token=2, moe_mlp_dim=22)
  graphdef, params = perturbed_model(cfg)
  qparams = quantize_params(params, "int8")
  kcfg = cfg.replace(
    attention_kernel="pallas_tpu", matmul_kernel="pallas_tpu", moe_kernel="pallas_tpu",
    kernel_interpret=True,
  )  # fmt: skip
  prompts = [[1, 5, 9, 17, 30], [1, 40, 41], [1, 100, 7, 8, 9, 10, 11]]
  requests = [
    Request(p, i, sampling=SamplingParams(temperature=1.0), max_new_tokens=6)
    for i, p in enumerate(prompts)
  ]
  runs = {}
  for name, c, m in [("ref", cfg, None), ("kernels", kcfg, mesh)]:
    engine = small_engine(c, mesh=m)
    driver = Driver(engine, steps_per_call=3, eos_id=None)
    with use_mesh(m, "fsdp_tp") if m is not None and context else contextlib.nullcontext():
      runs[name] = driver.run(qparams, requests, seed=0).finished
  for a, b in zip(*(sorted(runs[k], key=lambda x: x.request_id) for k in runs), strict=True):
    assert list(a.tokens) == list(b.tokens)
    # The off-mesh kernel test's bound: summation order of the row split's psum and the softmax.
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-5)
