"""LoRA: zero-B equals the base, adapter forward, merge, the adapter-free reference, sampling."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import apply, token_logprobs

from jaxrl.mesh import get_rules, make_mesh, param_shardings
from jaxrl.models import ModelConfig, make_model
from jaxrl.models import lora as lora_lib
from jaxrl.models.linear import project
from jaxrl.models.transformer import positions_from_mask
from jaxrl.rollout.collect import left_pad
from jaxrl.rollout.engine import Engine, request_key
from jaxrl.rollout.reference import make_sampler, row_keys
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration

R, ALPHA = 3, 5.0
BASE = ModelConfig.tiny().replace(num_layers=1)
CFG = BASE.replace(lora_rank=R, lora_alpha=ALPHA)


@functools.cache
def _models():
  return make_model(BASE, seed=0), make_model(CFG, seed=0)


@functools.cache
def _trained_like():
  """The LoRA model with every B drawn at random: what a trained adapter looks like."""
  _, (graphdef, params) = _models()
  rng = np.random.default_rng(1)

  def draw(path, v):
    if path[-1] != "b":
      return v
    return v.replace(jnp.asarray(0.3 * rng.normal(size=v.get_value().shape), jnp.float32))

  flat = {p: draw(p, v) for p, v in nnx.to_flat_state(params)}
  return graphdef, nnx.from_flat_state(flat)


def _batch(seed=0, b=3, t=13):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, BASE.vocab_size, size=(b, t)).astype(np.int32)
  valid = np.ones((b, t), bool)
  valid[1, :4] = False  # left padding
  return tokens, valid


def _logits(graphdef, params, tokens, valid):
  return np.asarray(apply(graphdef, params, tokens, positions_from_mask(valid), valid)[0])


def _flat(params):
  return {p: v.get_value() for p, v in nnx.to_flat_state(params)}


def test_zero_b_model_equals_base_and_base_init_is_unchanged():
  (g0, p0), (g1, p1) = _models()
  adapter, base = lora_lib.split_lora(p1)
  # Same seed, same base weights, bit for bit: the adapters use their own random stream.
  assert jax.tree.structure(base) == jax.tree.structure(p0)
  jax.tree.map(np.testing.assert_array_equal, _flat(base), _flat(p0))
  tokens, valid = _batch()
  np.testing.assert_array_equal(_logits(g1, p1, tokens, valid), _logits(g0, p0, tokens, valid))
  d, n, k, h, f = BASE.embed_dim, BASE.num_heads, BASE.num_kv_heads, BASE.head_dim, BASE.mlp_dim
  # q, k, v, o, gate, up, down: A [in, r] + B [r, out] each.
  want = R * ((d + n * h) + 2 * (d + k * h) + (n * h + d) + 2 * (d + f) + (f + d))
  assert lora_lib.adapter_param_count(p1) == want
  assert lora_lib.adapter_param_count(p0) == 0
  flat = dict(nnx.to_flat_state(adapter))
  assert all(isinstance(v, nnx.LoRAParam) for v in flat.values())
  o_a, o_b = flat[("layers", 0, "attn", "o_lora", "a")], flat[("layers", 0, "attn", "o_lora", "b")]
  assert o_a.get_value().shape == (n, h, R) and o_b.get_value().shape == (R, d)
  assert o_a.get_metadata()["axes"] == ("q_heads", "head_dim", "lora")
  for path, v in flat.items():
    x = np.asarray(v.get_value())
    if path[-1] == "b":
      assert not x.any(), path
    else:  # Kaiming-uniform: |A| <= 1 / sqrt(fan_in), and really random
      fan_in = np.prod(x.shape[:-1])
      assert 0 < np.abs(x).max() <= fan_in**-0.5 and x.std() > 0.4 * fan_in**-0.5, path


def test_lora_leaves_the_pinned_arith_small_init_unchanged():
  _, params = make_model(ModelConfig.arith_small().replace(lora_rank=4), seed=0)
  adapter, base = lora_lib.split_lora(params)
  leaves = jax.tree.leaves(base)
  assert len(leaves) == 46 and len(jax.tree.leaves(adapter)) == 4 * 7 * 2
  assert sum(float(np.asarray(x, np.float64).sum()) for x in leaves) == 1341.268843771179


@pytest.mark.parametrize(
  "eq, w_shape, a_shape, b_shape, x_shape",
  [
    ("BTD,DNH->BTNH", (5, 3, 4), (5, 2), (2, 3, 4), (2, 7, 5)),  # q
    ("BTNH,NHD->BTD", (3, 4, 5), (3, 4, 2), (2, 5), (2, 7, 3, 4)),  # o: two contracted dims
    ("BTF,FD->BTD", (6, 5), (6, 2), (2, 5), (2, 7, 6)),  # down
  ],
)
def test_project_adds_scaled_low_rank_path(eq, w_shape, a_shape, b_shape, x_shape):
  rng = np.random.default_rng(0)
  x, w, a, b = (rng.normal(size=s).astype(np.float32) for s in (x_shape, w_shape, a_shape, b_shape))
  adapter = type("Adapter", (), {})()  # a stand-in with the LoRA module's three attributes
  adapter.a, adapter.b, adapter.scale = nnx.LoRAParam(a), nnx.LoRAParam(b), 2.5
  got = project(eq, jnp.asarray(x), nnx.Param(w), adapter)
  # numpy reference: flatten the contracted dims, x W + scale (x A) B.
  n_in = len(a_shape) - 1
  xf = x.reshape(*x.shape[:2], -1)
  wf, af, bf = w.reshape(-1, *w.shape[n_in:]), a.reshape(-1, a.shape[-1]), b
  want = np.tensordot(xf, wf, axes=1) + 2.5 * np.tensordot(xf @ af, bf, axes=1)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_merge_equals_adapter_forward():
  graphdef, params = _trained_like()
  cfg0, merged = lora_lib.merge_lora(CFG, params)
  assert cfg0 == BASE
  (g0, p0), _ = _models()
  assert jax.tree.structure(merged) == jax.tree.structure(p0)
  tokens, valid = _batch(1)
  lora_logits = _logits(graphdef, params, tokens, valid)
  base_logits = _logits(g0, p0, tokens, valid)
  assert np.abs(lora_logits - base_logits).max() > 0.1  # the adapters matter here
  np.testing.assert_allclose(_logits(g0, merged, tokens, valid), lora_logits, atol=1e-5, rtol=0)
  # Merged q, by hand: W + alpha / r * A B.
  flat = _flat(params)
  path = ("layers", 0, "attn")
  a, b = flat[(*path, "q_lora", "a")], flat[(*path, "q_lora", "b")]
  want = flat[(*path, "q")] + ALPHA / R * np.einsum("DR,RNH->DNH", a, b)
  np.testing.assert_allclose(_flat(merged)[(*path, "q")], want, atol=1e-6)
  # Untargeted weights pass through merge untouched (the very same arrays).
  assert _flat(merged)[("embed",)] is flat[("embed",)]
  assert lora_lib.merge_lora(BASE, p0) == (BASE, p0)


def test_without_adapter_is_the_base_model_on_the_same_buffers():
  graphdef, params = _trained_like()
  ref = lora_lib.without_adapter(params)
  (g0, p0), _ = _models()
  tokens, valid = _batch(2)
  np.testing.assert_array_equal(
    _logits(graphdef, ref, tokens, valid), _logits(g0, p0, tokens, valid)
  )
  new, old = _flat(ref), _flat(params)
  assert new.keys() == old.keys()
  for path, x in new.items():
    if path[-1] == "b":
      assert x.shape == old[path].shape and not np.asarray(x).any()
    else:  # no second copy of the base (nor of A)
      assert x is old[path], path
      assert x.unsafe_buffer_pointer() == old[path].unsafe_buffer_pointer()


def test_adapters_shard_like_their_weights():
  _, (_, params) = _models()
  mesh = make_mesh(1, 4, 2)
  shardings = nnx.to_flat_state(param_shardings(params, mesh, "fsdp_tp"))
  specs = {p: v.get_value().spec for p, v in shardings}
  attn = ("layers", 0, "attn")
  # A keeps the weight's input axes (embed on fsdp), the rank is whole; B its output axes.
  assert tuple(specs[(*attn, "q_lora", "a")]) == ("fsdp", None)
  assert tuple(specs[(*attn, "q_lora", "b")]) == (None, "tensor", None)
  assert tuple(specs[(*attn, "o_lora", "a")]) == ("tensor", None, None)
  assert tuple(specs[(*attn, "o_lora", "b")]) == (None, "fsdp")
  assert ("lora", None) in get_rules("replicated")


def test_attention_only_lora_on_moe_model_merges():
  moe = BASE.replace(num_experts=4, experts_per_token=2, moe_mlp_dim=10)
  cfg = moe.replace(lora_rank=2, lora_targets=("q", "v"))
  g0, p0 = make_model(moe, seed=0)
  g1, p1 = make_model(cfg, seed=0)
  adapter, base = lora_lib.split_lora(p1)
  assert {p[-2] for p, _ in nnx.to_flat_state(adapter)} == {"q_lora", "v_lora"}
  jax.tree.map(np.testing.assert_array_equal, _flat(base), _flat(p0))
  rng = np.random.default_rng(4)
  p1 = nnx.from_flat_state(
    {
      p: v.replace(jnp.asarray(rng.normal(size=v.get_value().shape), jnp.float32))
      if p[-1] == "b"
      else v
      for p, v in nnx.to_flat_state(p1)
    }
  )
  tokens, valid = _batch(3)
  got = _logits(g1, p1, tokens, valid)
  assert np.abs(got - _logits(g0, p0, tokens, valid)).max() > 0.1
  merged_cfg, merged = lora_lib.merge_lora(cfg, p1)
  assert merged_cfg == moe
  np.testing.assert_allclose(_logits(g0, merged, tokens, valid), got, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(lora_rank=-1), r"model.lora_rank must be an int >= 0"),
    (dict(lora_rank=2.0), r"model.lora_rank must be an int >= 0"),
    (dict(lora_rank=2, lora_alpha=0.0), r"model.lora_alpha=0.0 must be > 0"),
    (dict(lora_targets=("q", "qkv")), r"unknown \['qkv'\]; allowed: \('q', 'k', 'v', 'o', 'gate'"),
    (dict(lora_targets="q"), r"model.lora_targets='q' must be a sequence"),
    (dict(lora_targets=("q", "q")), r"repeats a name"),
    (dict(lora_rank=2, lora_targets=()), r"needs at least one model.lora_targets"),
    (
      dict(lora_rank=2, num_experts=4, experts_per_token=2, moe_mlp_dim=8),
      r"MLP targets \['gate', 'up', 'down'\] but model.num_experts=4.*allowed here",
    ),
  ],
)
def test_bad_lora_config_names_field(kw, match):
  with pytest.raises(ValueError, match=match):
    BASE.replace(**kw)


def test_lora_targets_list_becomes_a_hashable_tuple():
  cfg = BASE.replace(lora_rank=2, lora_targets=["q", "o"])
  assert cfg.lora_targets == ("q", "o") and hash(cfg)


def test_sampler_logprobs_equal_learner_on_lora_model():
  graphdef, params = _trained_like()
  p, n = 8, 6
  toks, mask = left_pad([[1, 7, 8, 9], [1, 20], [1, 30, 31, 32, 33, 34, 35]], p, 0)
  sample = make_sampler(
    graphdef,
    CFG,
    prompt_len=p,
    max_new_tokens=n,
    eos_id=2,
    pad_id=0,
    sampling=SamplingParams(temperature=1.0),
  )
  r = sample(params, toks, mask, row_keys(jax.random.key(0), np.arange(3)))
  full = jnp.concatenate([r.prompt_tokens, r.tokens], axis=1)
  valid = jnp.concatenate([r.prompt_mask, r.mask], axis=1)
  learner = np.asarray(token_logprobs(graphdef, params, full, valid))[:, p:]
  m = np.asarray(r.mask)
  assert m.sum() > 6
  np.testing.assert_allclose(np.asarray(r.logprobs)[m], learner[m], atol=1e-5, rtol=0)


def test_engine_logprobs_equal_learner_on_lora_model():
  graphdef, params = _trained_like()
  s, n_new = 32, 7
  eng = Engine(
    CFG,
    graphdef,
    max_concurrent_decodes=2,
    num_pages=16,
    page_size=4,
    max_prefill_length=16,
    prefill_chunk_size=8,
    max_target_length=s,
  )
  prompt = [5, 9, 17, 40, 41, 42, 43, 44, 45, 46, 47]  # 11 tokens: a chunked prefill
  prefix, first = eng.prefill_prompt(
    params,
    prompt,
    sampler=SamplingParams(temperature=1.0),
    rng=request_key(0, 0)[None],
    max_new_tokens=n_new,
  )
  f = first.convert_to_numpy().get_result_at_slot(0)
  tokens, logps = [int(f.tokens[0])], [float(f.log_prob[0])]
  st = eng.insert(prefix, eng.init_decode_state(), 1)
  while len(tokens) < n_new:
    st, res = eng.generate_steps(params, st, 3)
    d = res.convert_to_numpy().get_result_at_slot(1)
    for i in np.flatnonzero(d.valid[:, 0]):
      tokens.append(int(d.tokens[i, 0]))
      logps.append(float(d.log_prob[i, 0]))
  eng.free_resource(1)
  seq = prompt + tokens
  padded = np.zeros((1, s), np.int32)
  padded[0, : len(seq)] = seq
  learner = token_logprobs(graphdef, params, padded, np.arange(s)[None] < len(seq))
  learner = np.asarray(learner)[0, len(prompt) : len(seq)]
  np.testing.assert_allclose(np.array(logps, np.float32), learner, atol=1e-5, rtol=0)
