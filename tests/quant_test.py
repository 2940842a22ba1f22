"""int8 quantization: numpy references for quantize and W8A8 einsum, quantize_params, rollouts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import apply, graphdef_of, greedy_rows, numpy_model, token_logprobs

from jaxrl.models import ModelConfig, Transformer
from jaxrl.models import lora as lora_lib
from jaxrl.models.linear import LoRA, project
from jaxrl.quant import (
  QArray,
  Quantizer,
  dequantize,
  int8_einsum,
  quantize_activations,
  quantize_int8,
  quantize_params,
)
from jaxrl.rollout.collect import left_pad
from jaxrl.rollout.driver import Driver, Request
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.reference import make_sampler, row_keys
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration

# Odd / prime sizes so a transposed axis shows; head_dim even for RoPE.
CFG = ModelConfig(
  vocab_size=67,
  num_layers=2,
  embed_dim=23,
  num_heads=6,
  num_kv_heads=2,
  head_dim=10,
  mlp_dim=37,
  rope_theta=1000.0,
  qk_norm=True,
  tie_embeddings=False,
  max_seq_len=64,
)
PROJECTIONS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}  # name: in_ndim
# The einsums of jaxrl.models.linear.project, with x's and W's shapes (B T D N K H F).
B, T, D, N, K, H, F = 3, 5, 23, 6, 2, 10, 37
EINSUMS = {
  "BTD,DNH->BTNH": ((B, T, D), (D, N, H)),
  "BTD,DKH->BTKH": ((B, T, D), (D, K, H)),
  "BTNH,NHD->BTD": ((B, T, N, H), (N, H, D)),
  "BTD,DF->BTF": ((B, T, D), (D, F)),
  "BTF,FD->BTD": ((B, T, F), (F, D)),
}


# ------------------------------------------------------------------------------ numpy reference


def np_quantize(x, axes):
  """Symmetric int8 over `axes` (kept as size 1): (int8 values, float32 scale)."""
  x = np.asarray(x, np.float32)
  scale = np.max(np.abs(x), axis=axes, keepdims=True) * np.float32(1 / 127)
  safe = np.where(scale > 0, scale, np.float32(1))
  return np.clip(np.round(x / safe), -127, 127).astype(np.int8), scale


def np_int8_einsum(eq, x, values, w_scale):
  """x quantized per row over the contracted axes, an exact integer einsum, then the rescale."""
  xs, ws = eq.split("->")[0].split(",")
  axes = tuple(i for i, c in enumerate(xs) if c in ws)
  xq, x_scale = np_quantize(x, axes)
  acc = np.einsum(eq, xq.astype(np.int64), np.asarray(values, np.int64))
  assert np.abs(acc).max() < 2**31  # what the int32 accumulator holds
  x_scale = np.squeeze(x_scale, axes)
  x_scale = x_scale.reshape(x_scale.shape + (1,) * (len(ws) - len(axes)))
  return acc.astype(np.float32) * x_scale * np.asarray(w_scale, np.float32)


def _rng_weights(shape, seed, zero_channel=True):
  w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
  if zero_channel:
    w[..., 0] = 0.0  # one all-zero output channel
  return w


# ------------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("shape,in_ndim", [((7, 3, 5), 1), ((3, 5, 7), 2), ((11, 13), 1)])
def test_quantize_int8_matches_numpy(shape, in_ndim):
  w = _rng_weights(shape, 0)
  q = jax.jit(quantize_int8, static_argnums=1)(jnp.asarray(w), in_ndim)
  values, scale = np_quantize(w, tuple(range(in_ndim)))
  assert q.values.dtype == jnp.int8 and q.scale.dtype == jnp.float32
  assert q.scale.shape == shape[in_ndim:]
  np.testing.assert_array_equal(np.asarray(q.values), values)
  np.testing.assert_array_equal(np.asarray(q.scale), scale.reshape(shape[in_ndim:]))
  assert np.all(np.abs(np.asarray(q.values)) <= 127)
  # Round to nearest: each element is off by at most half a step of its channel's scale (plus
  # the float32 rounding of w / scale, a few ulps).
  back = np.asarray(dequantize(q))
  assert np.all(np.abs(back - w) <= scale * 0.5 * (1 + 1e-6))
  # The zero channel: scale 0, values 0, dequantized exactly 0, nowhere NaN.
  assert np.all(np.asarray(q.scale)[..., 0] == 0) and np.all(back[..., 0] == 0)
  assert np.all(np.isfinite(back))


def test_quantize_int8_rejects_bad_in_ndim():
  with pytest.raises(ValueError, match="in_ndim"):
    quantize_int8(jnp.zeros((3, 4)), 2)


def test_quantize_activations_per_row():
  x = np.random.default_rng(1).normal(size=(3, 4, 2, 5)).astype(np.float32)
  x[1, 2] = 0.0  # an all-zero row (padding) quantizes to zeros
  values, scale = jax.jit(lambda x: quantize_activations(x, (-2, -1)))(jnp.asarray(x))
  ref_values, ref_scale = np_quantize(x, (2, 3))
  np.testing.assert_array_equal(np.asarray(values), ref_values)
  np.testing.assert_array_equal(np.asarray(scale), ref_scale[:, :, 0, 0])
  assert scale.shape == (3, 4) and np.all(np.asarray(values)[1, 2] == 0)


# -------------------------------------------------------------------------------- int8_einsum


@pytest.mark.parametrize("eq", list(EINSUMS))
def test_int8_einsum_matches_integer_reference_and_float(eq):
  x_shape, w_shape = EINSUMS[eq]
  rng = np.random.default_rng(2)
  x = rng.normal(size=x_shape).astype(np.float32)
  x[0, 1] = 0.0  # a zero row: output row exactly 0
  w = _rng_weights(w_shape, 3)
  in_ndim = len(x_shape) - 2
  q = quantize_int8(jnp.asarray(w), in_ndim)
  got = np.asarray(jax.jit(int8_einsum, static_argnums=0)(eq, jnp.asarray(x), q))
  assert got.dtype == np.float32 and got.shape == np.einsum(eq, x, w).shape
  # Same integer arithmetic and the same float32 rescale: equal up to float32 rounding.
  ref = np_int8_einsum(eq, x, np.asarray(q.values), np.asarray(q.scale))
  np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)
  assert np.all(got[0, 1] == 0)
  # Against the float einsum: with x = xq sx + ex, w = wq sw + ew, |ex| <= sx / 2 and
  # |ew| <= sw / 2, each product is off by at most sx/2 |wq sw| + |xq sx| sw/2 + sx sw / 4;
  # summed over the contracted axes (plus float32 rounding of the float einsum itself).
  xs, ws = eq.split("->")[0].split(",")
  axes = tuple(i for i, c in enumerate(xs) if c in ws)
  xq, sx = np_quantize(x, axes)
  x_hat, w_hat = xq * sx, np.asarray(dequantize(q))
  sw = np.broadcast_to(np.asarray(q.scale), w.shape)
  bound = (
    np.einsum(eq, sx / 2 + 0 * x, np.abs(w_hat))
    + np.einsum(eq, np.abs(x_hat), sw / 2)
    + np.einsum(eq, sx / 4 + 0 * x, sw)
  )
  exact = np.einsum(eq, x.astype(np.float64), w.astype(np.float64))
  slack = 1e-5 * np.einsum(eq, np.abs(x), np.abs(w))
  assert np.all(np.abs(got - exact) <= bound + slack)
  assert np.all(bound <= 0.05 * np.einsum(eq, np.abs(x), np.abs(w)) + 1e-30)  # bound is small


def test_int8_einsum_rejects_mismatched_weight():
  q = quantize_int8(jnp.ones((6, 10, 23)), 1)  # one input axis; "BTNH,NHD" contracts two
  with pytest.raises(ValueError, match="input axes"):
    int8_einsum("BTNH,NHD->BTD", jnp.ones((1, 1, 6, 10)), q)


# ---------------------------------------------------------------------------- quantize_params


@functools.cache
def _model():
  graphdef, params = numpy_model(CFG, 0)
  return graphdef, params, jax.jit(quantize_params)(params)


def _flat(params):
  return {path: v for path, v in nnx.to_flat_state(params)}


def test_quantize_params_replaces_exactly_the_dense_projections():
  _, params, qparams = _model()
  before, after = _flat(params), _flat(qparams)
  assert set(before) == set(after)
  quantized = {p for p, v in after.items() if isinstance(v.get_value(), QArray)}
  assert len(quantized) == CFG.num_layers * len(PROJECTIONS)
  assert {p[-1] for p in quantized} == set(PROJECTIONS)
  for path, v in after.items():
    w = before[path].get_value()
    assert type(v) is type(before[path]) and v.get_metadata() == before[path].get_metadata()
    if path in quantized:
      expect = quantize_int8(w, PROJECTIONS[path[-1]])
      np.testing.assert_array_equal(np.asarray(v.get_value().values), np.asarray(expect.values))
      np.testing.assert_array_equal(np.asarray(v.get_value().scale), np.asarray(expect.scale))
    else:  # embedding, head, norms: the same values
      np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(w))
  assert ("embed",) not in quantized and ("head",) not in quantized
  # Eager and jitted agree, and quantizing twice changes nothing.
  eager = _flat(quantize_params(params))
  again = _flat(quantize_params(qparams))
  for path in quantized:
    for other in (eager, again):
      np.testing.assert_array_equal(
        np.asarray(other[path].get_value().values), np.asarray(after[path].get_value().values)
      )


def test_quantizer_passes_unquantized_leaves_through_without_copying():
  # The loop's sync: only projection weights are recomputed; the embedding, head and norms are
  # the learner's own arrays (zero bytes copied), and the QArrays equal quantize_params'.
  _, params, qparams = _model()
  quantize = Quantizer()
  before, after, want = _flat(params), _flat(quantize(params)), _flat(qparams)
  assert list(after) == list(before)
  shared = 0
  for path, v in after.items():
    if isinstance(want[path].get_value(), QArray):
      for a, b in zip(v.get_value(), want[path].get_value(), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
      assert v.get_value() is before[path].get_value(), path
      shared += 1
  assert shared == len(before) - CFG.num_layers * len(PROJECTIONS) > 0
  # A second sync reuses the one compiled quantizer.
  quantize(params)
  assert len(quantize._jitted) == 1
  with pytest.raises(ValueError, match="allowed modes"):
    Quantizer("int4")


def test_quantize_params_rejects_unknown_mode():
  _, params, _ = _model()
  with pytest.raises(
    ValueError, match=r"allowed modes: \('int8', 'fp8', 'fp8_e5m2', 'fp8_block', 'fp4', 'nvfp4'\)"
  ):
    quantize_params(params, mode="int4")


def test_quantize_params_leaves_moe_experts_and_router_float():
  cfg = CFG.replace(num_experts=5, experts_per_token=2, moe_mlp_dim=13)
  _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  params = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), abstract)
  after = _flat(quantize_params(params))
  quantized = {p for p, v in after.items() if isinstance(v.get_value(), QArray)}
  assert {p[-2:] for p in quantized} == {("attn", n) for n in ("q", "k", "v", "o")}
  assert len(quantized) == 4 * cfg.num_layers
  for name in ("router", "gate", "up", "down"):
    assert after[("layers", 0, "mlp", name)].get_value().dtype == jnp.float32


# ------------------------------------------------------------------------------- forward parity


def _rms(x, w, eps):
  x = x.astype(np.float32)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w


def _rope(x, positions, theta):
  h = x.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, h, 2, dtype=np.float32) / h)
  ang = positions.astype(np.float32)[..., None] * inv_freq  # [B, T, H/2]
  cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
  x1, x2 = x[..., : h // 2], x[..., h // 2 :]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def np_forward(params, tokens, quantized: bool):
  """The model written out in numpy (float32; one unpadded causal batch). With `quantized`
  every projection is `np_int8_einsum` on the QArray values of `params`, else a float einsum."""
  flat = {path: v.get_value() for path, v in nnx.to_flat_state(params)}
  eps = np.float32(CFG.norm_eps)
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731

  def proj(eq, x, path):
    w = flat[path]
    if quantized:
      return np_int8_einsum(eq, x, np.asarray(w.values), np.asarray(w.scale))
    return np.einsum(eq, x, f32(w))

  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t), (b, t))
  causal = np.tril(np.ones((t, t), bool))
  x = f32(flat[("embed",)])[tokens]
  for i in range(CFG.num_layers):
    layer = lambda *p: ("layers", i, *p)  # noqa: E731, B023
    h = _rms(x, f32(flat[layer("attn_norm", "scale")]), eps)
    q = proj("BTD,DNH->BTNH", h, layer("attn", "q"))
    k = proj("BTD,DKH->BTKH", h, layer("attn", "k"))
    v = proj("BTD,DKH->BTKH", h, layer("attn", "v"))
    q = _rope(_rms(q, f32(flat[layer("attn", "q_norm", "scale")]), eps), positions, CFG.rope_theta)
    k = _rope(_rms(k, f32(flat[layer("attn", "k_norm", "scale")]), eps), positions, CFG.rope_theta)
    k, v = (np.repeat(a, CFG.num_heads // CFG.num_kv_heads, axis=2) for a in (k, v))
    s = np.einsum("BTNH,BSNH->BNTS", q, k) / np.float32(np.sqrt(CFG.head_dim))
    s = np.where(causal, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    out = np.einsum("BNTS,BSNH->BTNH", p, v).astype(np.float32)
    x = x + proj("BTNH,NHD->BTD", out, layer("attn", "o"))
    h = _rms(x, f32(flat[layer("mlp_norm", "scale")]), eps)
    g = proj("BTD,DF->BTF", h, layer("mlp", "gate"))
    u = proj("BTD,DF->BTF", h, layer("mlp", "up"))
    act = (g / (1 + np.exp(-g)) * u).astype(np.float32)
    x = x + proj("BTF,FD->BTD", act, layer("mlp", "down"))
  x = _rms(x, f32(flat[("final_norm", "scale")]), eps)
  return np.einsum("BTD,DV->BTV", x, f32(flat[("head",)]))


def _tokens(b=2, t=11, seed=4):
  return np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(b, t)).astype(np.int32)


def _logits(graphdef, params, tokens):
  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t), (b, t))
  return np.asarray(apply(graphdef, params, tokens, positions, np.ones((b, t), bool))[0])


def test_quantized_forward_matches_numpy_reference_and_stays_near_float():
  graphdef, params, qparams = _model()
  tokens = _tokens()
  float_logits, int8_logits = _logits(graphdef, params, tokens), _logits(graphdef, qparams, tokens)
  # The reference itself: its float path is the model.
  np.testing.assert_allclose(np_forward(params, tokens, False), float_logits, atol=1e-5, rtol=0)
  # The int8 model is the same forward with every projection an int8 x int8 -> int32 einsum.
  np.testing.assert_allclose(np_forward(qparams, tokens, True), int8_logits, atol=1e-5, rtol=0)
  # Near the float model (measured here: max |d logit| 0.052 = 0.066 logit std; argmax equal at
  # 21 of 22 positions), yet visibly not the float path (> 1e-3).
  gap = np.abs(int8_logits - float_logits).max()
  assert 1e-3 < gap <= 0.1 * float_logits.std(), (gap, float_logits.std())
  assert np.mean(np.argmax(int8_logits, -1) == np.argmax(float_logits, -1)) >= 0.9


def test_lora_adapters_stay_float_and_a_fresh_adapter_changes_nothing():
  lcfg = CFG.replace(lora_rank=3, lora_alpha=5.0)
  lgraphdef, lparams = numpy_model(lcfg, 0)  # B = 0: a fresh adapter
  qlora = quantize_params(lparams)
  adapter, base = lora_lib.split_lora(qlora)
  assert all(type(v) is nnx.LoRAParam for _, v in nnx.to_flat_state(adapter))
  assert all(v.get_value().dtype == jnp.float32 for _, v in nnx.to_flat_state(adapter))
  n_q = sum(isinstance(v.get_value(), QArray) for _, v in nnx.to_flat_state(base))
  assert n_q == lcfg.num_layers * len(PROJECTIONS)
  # The base model with the LoRA model's frozen weights, quantized the same way.
  bgraphdef = graphdef_of(CFG)
  base_params = lora_lib.split_lora(lparams)[1]
  tokens = _tokens()
  # The int8 rescale fuses into the residual add differently once an adapter term sits between
  # them (an FMA here, two roundings there), so whole-model logits agree to float32 ulps, as
  # sampler and learner must (<= 1e-5), not bit for bit; one projection is bit-exact below.
  got = _logits(lgraphdef, qlora, tokens)
  want = _logits(bgraphdef, quantize_params(base_params), tokens)
  assert np.abs(got - want).max() <= 1e-5
  # One projection with a fresh adapter is the int8 base projection exactly.
  path = ("layers", 0, "attn", "q")
  w, a, b = (
    _flat(qlora)[p].get_value()
    for p in (path, (*path[:-1], "q_lora", "a"), (*path[:-1], "q_lora", "b"))
  )
  assert not np.any(np.asarray(b)) and isinstance(w, QArray)
  x = jnp.asarray(np.random.default_rng(8).normal(size=(B, T, D)), jnp.float32)
  eq = "BTD,DNH->BTNH"

  def with_adapter(x, w, a, b):
    adapter = LoRA(jax.random.key(0), (D,), ("embed",), (N, H), ("q_heads", "head_dim"), lcfg)
    adapter.a[...], adapter.b[...] = a, b
    return project(eq, x, nnx.Param(w), adapter)

  np.testing.assert_array_equal(
    np.asarray(jax.jit(with_adapter)(x, w, a, b)),
    np.asarray(jax.jit(int8_einsum, static_argnums=0)(eq, x, w)),
  )


def test_project_adds_a_float_adapter_to_the_int8_base():
  lcfg = CFG.replace(lora_rank=3, lora_alpha=5.0)
  adapter = LoRA(jax.random.key(0), (D,), ("embed",), (N, H), ("q_heads", "head_dim"), lcfg)
  adapter.b[...] = jnp.asarray(np.random.default_rng(5).normal(size=(3, N, H)), jnp.float32)
  x = jnp.asarray(np.random.default_rng(6).normal(size=(B, T, D)), jnp.float32)
  q = quantize_int8(jnp.asarray(_rng_weights((D, N, H), 7)), 1)
  eq = "BTD,DNH->BTNH"
  got = np.asarray(project(eq, x, nnx.Param(q), adapter))
  a, b_ = np.asarray(adapter.a[...]), np.asarray(adapter.b[...])
  lora = adapter.scale * np.einsum("BTR,RNH->BTNH", np.einsum("BTD,DR->BTR", x, a), b_)
  ref = np_int8_einsum(eq, np.asarray(x), np.asarray(q.values), np.asarray(q.scale)) + lora
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- int8 rollouts

P, NEW, PAD = 8, 8, 0
PROMPTS = [[5, 9, 17], [40, 41, 42, 43, 44, 45, 46, 47], [10], [20, 7, 33, 3, 60]]
GREEDY = SamplingParams(temperature=0.0)
REF_S = P + NEW  # one [B, S] shape for the no-cache reference


@functools.cache
def _int8_reference():
  """(completions [B, NEW], learner logprobs of them [B, NEW]) under the quantized params."""
  graphdef, _, qparams = _model()
  return greedy_reference(graphdef, qparams)


def greedy_reference(graphdef, qparams):
  """The no-cache greedy completions of PROMPTS under `qparams` and their learner log-probs."""
  tokens = np.zeros((len(PROMPTS), REF_S), np.int32)
  for i, p in enumerate(PROMPTS):
    tokens[i, : len(p)] = p
  lengths = np.array([len(p) for p in PROMPTS], np.int32)
  out, gap = greedy_rows(graphdef, qparams, tokens, lengths, np.int32(NEW))
  assert float(jnp.min(gap)) > 1e-3, "argmax too close to a tie to compare two code paths"
  out = np.asarray(out)
  valid = np.arange(REF_S)[None] < (lengths + NEW)[:, None]
  logp = np.asarray(token_logprobs(graphdef, qparams, out, valid))
  completions = np.stack([out[b, k : k + NEW] for b, k in enumerate(lengths)])
  return completions, np.stack([logp[b, k : k + NEW] for b, k in enumerate(lengths)])


def test_int8_sampler_matches_no_cache_int8_reference():
  graphdef, _, qparams = _model()
  ref_tokens, ref_logp = _int8_reference()
  sample = make_sampler(
    graphdef, CFG, prompt_len=P, max_new_tokens=NEW, eos_id=-1, pad_id=PAD, sampling=GREEDY
  )
  tokens, mask = left_pad(PROMPTS, P, PAD)
  r = sample(qparams, jnp.asarray(tokens), jnp.asarray(mask), row_keys(jax.random.key(0), range(4)))
  np.testing.assert_array_equal(np.asarray(r.tokens), ref_tokens)
  assert np.abs(np.asarray(r.logprobs) - ref_logp).max() <= 1e-5


def test_int8_engine_matches_no_cache_int8_reference():
  graphdef, _, qparams = _model()
  ref_tokens, ref_logp = _int8_reference()
  engine = Engine(
    CFG,
    graphdef,
    max_concurrent_decodes=3,  # fewer slots than requests: one waits for a free slot
    num_pages=24,
    page_size=4,
    max_prefill_length=P,
    max_target_length=REF_S,
  )
  driver = Driver(engine, steps_per_call=4, eos_id=None)
  requests = [
    Request(prompt=p, request_id=i, sampling=GREEDY, max_new_tokens=NEW)
    for i, p in enumerate(PROMPTS)
  ]
  done = sorted(driver.run(qparams, requests, seed=0).finished, key=lambda c: c.request_id)
  np.testing.assert_array_equal(np.stack([c.tokens for c in done]), ref_tokens)
  assert np.abs(np.stack([c.logprobs for c in done]) - ref_logp).max() <= 1e-5
