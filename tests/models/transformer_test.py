"""Model tests: HF Qwen3 logits parity, cache vs no cache, padding invariance, config errors,
scanned and rematerialised blocks against the unrolled loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from families import FAMILIES, family_model, family_prompts
from flax import nnx
from helpers import apply, decode_through_cache, graphdef_of, perturbed_model

from jaxrl.models import ModelConfig
from jaxrl.models.config import REMAT_POLICIES
from jaxrl.models.transformer import (
  apply_with_routing,
  make_model,
  positions_from_mask,
  token_logprobs,
)

pytestmark = pytest.mark.integration


def _hf_qwen3(cfg: ModelConfig, params):
  """A transformers Qwen3 model carrying our weights, mapped by the library's rules table."""
  import torch
  import transformers

  from jaxrl.models import hf

  hf_cfg = transformers.Qwen3Config.from_dict(hf.config_to_hf(cfg, "qwen3"))
  model = transformers.Qwen3ForCausalLM(hf_cfg).eval().float()
  sd = hf.to_hf_state_dict(cfg, params, "qwen3")
  missing, unexpected = model.load_state_dict(
    {k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, strict=False
  )
  assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
  return model, torch


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_hf_qwen3_with_left_padding(tie):
  cfg = ModelConfig.tiny().replace(tie_embeddings=tie, rope_theta=1000.0)
  graphdef, params = perturbed_model(cfg)
  model, torch = _hf_qwen3(cfg, params)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, cfg.vocab_size, size=(3, 11)).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  valid[1, :4] = False  # left padding
  valid[2, :1] = False
  tokens = np.where(valid, tokens, 0)
  logits, _ = apply(graphdef, params, tokens, positions_from_mask(valid), valid)
  with torch.no_grad():
    ref = model(
      input_ids=torch.from_numpy(tokens).long(),
      attention_mask=torch.from_numpy(valid).long(),
      position_ids=torch.from_numpy(np.array(positions_from_mask(valid))).long(),
    ).logits.numpy()
  np.testing.assert_allclose(np.asarray(logits)[valid], ref[valid], atol=1e-4, rtol=0)


def test_cached_decoding_equals_full_forward():
  cfg = ModelConfig.tiny()
  graphdef, params = perturbed_model(cfg)
  b, t = 2, 9
  tokens = jax.random.randint(jax.random.key(3), (b, t), 3, cfg.vocab_size)
  valid = jnp.ones((b, t), bool).at[1, :3].set(False)
  full, _ = apply(graphdef, params, tokens, positions_from_mask(valid), valid)

  p = 5  # prefill the first p tokens, then feed the rest one at a time
  cached = decode_through_cache(graphdef, params, cfg, tokens, valid, p)
  np.testing.assert_allclose(np.asarray(cached)[valid], np.asarray(full)[valid], atol=1e-5)


def test_left_padding_does_not_change_logits():
  cfg = ModelConfig.tiny()
  graphdef, params = perturbed_model(cfg)
  seq = jax.random.randint(jax.random.key(1), (1, 6), 3, cfg.vocab_size)
  valid = jnp.ones((1, 6), bool)
  plain, _ = apply(graphdef, params, seq, positions_from_mask(valid), valid)
  padded = jnp.concatenate([jnp.zeros((1, 4), seq.dtype), seq], axis=1)
  pvalid = jnp.concatenate([jnp.zeros((1, 4), bool), valid], axis=1)
  out, _ = apply(graphdef, params, padded, positions_from_mask(pvalid), pvalid)
  np.testing.assert_allclose(np.asarray(out[:, 4:]), np.asarray(plain), atol=1e-5)


def test_token_logprobs_match_log_softmax_by_hand():
  cfg = ModelConfig.tiny()
  graphdef, params = perturbed_model(cfg)
  tokens = jnp.array([[5, 9, 17, 4]])
  valid = jnp.ones_like(tokens, bool)
  logp, ent = token_logprobs(graphdef, params, tokens, valid, temperature=0.7, with_entropy=True)
  logits, _ = apply(graphdef, params, tokens, positions_from_mask(valid), valid)
  z = np.asarray(logits[0], np.float64) / 0.7
  lsm = (
    z
    - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - z.max(-1, keepdims=True)
  )
  expect = [0.0] + [lsm[j - 1, int(tokens[0, j])] for j in range(1, 4)]
  np.testing.assert_allclose(np.asarray(logp[0]), expect, atol=1e-5)
  h = -(np.exp(lsm) * lsm).sum(-1)
  np.testing.assert_allclose(np.asarray(ent[0, 1:]), h[:3], atol=1e-4)


def test_params_carry_logical_axes():
  _, params = make_model(ModelConfig.tiny())
  flat = nnx.to_flat_state(params)
  for path, var in flat:
    axes = var.get_metadata().get("axes")
    assert axes is not None and len(axes) == var.get_value().ndim, path


def test_default_init_is_unchanged_by_optional_params():
  # Pinned: per-family options (qkv_bias, rope_scaling) must not shift the RNG stream when off,
  # or every seeded run and stored reference result would silently change.
  _, params = make_model(ModelConfig.arith_small(), seed=0)
  leaves = jax.tree.leaves(params)
  assert len(leaves) == 46
  assert sum(float(np.asarray(x, np.float64).sum()) for x in leaves) == 1341.268843771179


@pytest.mark.parametrize(
  "kw, field",
  [
    (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
    (dict(head_dim=7), "head_dim"),
    (dict(embed_dim=0), "embed_dim"),
    (dict(dtype="int8"), "dtype"),
    (dict(remat="sometimes"), "model.remat='sometimes'; allowed: .*dots_saveable"),
    (dict(scan_layers="yes"), "model.scan_layers must be True or False"),
  ],
)
def test_bad_model_config_names_field(kw, field):
  with pytest.raises(ValueError, match=field):
    ModelConfig.tiny().replace(**kw)


def _gemma_tiny() -> ModelConfig:
  """Gemma-3-shaped tiny model: window 3, a global layer between two sliding ones."""
  return ModelConfig.tiny().replace(
    num_layers=3,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    sliding_window=3,
    rope_theta=1000.0,
    rope_local_theta=50.0,
    query_pre_attn_scalar=20.0,
    mlp_activation="gelu_tanh",
    zero_centered_norms=True,
    post_norms=True,
    scale_embeddings=True,
    final_logit_softcap=5.0,
    attn_logit_softcap=2.0,
  )


def test_sliding_window_cached_decoding_equals_full_forward():

  cfg = _gemma_tiny()
  graphdef, params = perturbed_model(cfg)
  b, t, p = 2, 13, 4  # prefill p tokens, then decode one at a time, well past the window
  tokens = jax.random.randint(jax.random.key(5), (b, t), 3, cfg.vocab_size)
  valid = jnp.ones((b, t), bool).at[1, :3].set(False)
  pos = positions_from_mask(valid)
  full, _ = apply(graphdef, params, tokens, pos, valid)
  # The window must matter here, or the cache would not test it.
  unwindowed = cfg.replace(layer_types=None, sliding_window=None)
  other_graphdef = graphdef_of(unwindowed)
  other, _ = apply(other_graphdef, params, tokens, pos, valid)
  assert np.abs(np.asarray(other - full)[np.asarray(valid)]).max() > 1e-2

  cached = decode_through_cache(graphdef, params, cfg, tokens, valid, p)
  np.testing.assert_allclose(np.asarray(cached)[valid], np.asarray(full)[valid], atol=1e-5)


def test_gemma_options_add_no_random_draws():
  # Zero-centred norms and post-norms are constants: the random params match the plain model's.
  _, plain = make_model(ModelConfig.tiny())
  _, gemma = make_model(ModelConfig.tiny().replace(zero_centered_norms=True, post_norms=True))
  flat_gemma = dict(nnx.to_flat_state(gemma))
  for path, var in nnx.to_flat_state(plain):
    if "norm" in str(path):
      np.testing.assert_array_equal(flat_gemma[path].get_value(), 0.0)
    else:
      np.testing.assert_array_equal(flat_gemma[path].get_value(), var.get_value())
  assert ("layers", 0, "post_attn_norm", "scale") in flat_gemma


@pytest.mark.parametrize(
  "kw, field",
  [
    (dict(layer_types=("full_attention",)), "model.layer_types has 1 entries"),
    (dict(layer_types=("full_attention", "local")), r"model.layer_types has \['local'\]"),
    (dict(layer_types=("sliding_attention", "full_attention")), "set model.sliding_window"),
    (dict(sliding_window=4), "model.sliding_window=4 is set but"),
    (
      dict(layer_types=("sliding_attention", "full_attention"), sliding_window=0),
      "model.sliding_window must be a positive int",
    ),
    (dict(rope_local_theta=0.0), "model.rope_local_theta"),
    (dict(query_pre_attn_scalar=-1.0), "model.query_pre_attn_scalar"),
    (dict(final_logit_softcap=0.0), "model.final_logit_softcap"),
    (dict(attn_logit_softcap=-2.0), "model.attn_logit_softcap"),
    (dict(mlp_activation="relu"), "model.mlp_activation='relu'"),
  ],
)
def test_bad_gemma_config_names_field(kw, field):
  with pytest.raises(ValueError, match=field):
    ModelConfig.tiny().replace(**kw)


def test_layer_types_from_a_list_stay_hashable():
  cfg = ModelConfig.tiny().replace(
    layer_types=["sliding_attention", "full_attention"], sliding_window=4
  )
  assert cfg.layer_types == ("sliding_attention", "full_attention") and hash(cfg)
  assert [cfg.layer_window(i) for i in range(2)] == [4, None]


def test_gemma3_1b_preset_shape():
  import math

  from jaxrl.models.transformer import Transformer

  cfg = ModelConfig.gemma3_1b()
  assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
  assert cfg.layer_rope(0) == (10_000.0, None) and cfg.layer_rope(5) == (1_000_000.0, None)

  def count(num_layers):  # every block has the same params, sliding or not
    small = cfg.replace(num_layers=num_layers, layer_types=cfg.layer_types[:num_layers])
    model = nnx.eval_shape(lambda: Transformer(small, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

  one, two = count(1), count(2)
  # By hand: embed 262144*1152, per layer q/o 2*1152*4*256, k/v 2*1152*256, mlp 3*1152*6912,
  # 4 block norms of 1152 and q/k norms of 256; final norm 1152. The Hub reports the same.
  assert one + 25 * (two - one) == 999_885_952


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_decoding_equals_full_forward_per_family(family):
  cfg, graphdef, params = family_model(family)
  b, t, p = 3, 13, 4  # decode runs well past Gemma's window of 5
  tokens = jnp.asarray(np.array(family_prompts(family, [t] * b)), jnp.int32)
  valid = jnp.ones((b, t), bool).at[1, :3].set(False).at[2, :6].set(False)  # left padding
  full, _ = apply(graphdef, params, tokens, positions_from_mask(valid), valid)
  cached = decode_through_cache(graphdef, params, cfg, tokens, valid, p)
  np.testing.assert_allclose(np.asarray(cached)[valid], np.asarray(full)[valid], atol=1e-5, rtol=0)


# --- scan_layers and remat --------------------------------------------------------------------


def _graphdef(cfg: ModelConfig, **overrides) -> nnx.GraphDef:
  """The graphdef of `cfg` with `overrides`; the params of `cfg` fit it unchanged."""
  return graphdef_of(cfg.replace(**overrides))


def _gemma_pattern_model():
  """Five Gemma-style layers, sliding and global mixed irregularly (no period divides 5), each
  with its own window and RoPE base; RoPE scaling on the global layers only."""
  from jaxrl.models import RopeScaling

  cfg = family_model("gemma3")[0].replace(
    num_layers=5,
    layer_types=("sliding_attention", "sliding_attention", "full_attention")
    + (
      "sliding_attention",
      "full_attention",
    ),
    rope_scaling=RopeScaling("linear", 4.0),
  )
  # The tolerance below is stated at init's scale.
  return (cfg, *perturbed_model(cfg, seed=5, from_init=True))


def _lora_model():
  cfg = family_model("qwen3")[0].replace(num_layers=3, lora_rank=3)
  return (cfg, *perturbed_model(cfg, seed=6))  # the B factors perturbed away from zero


_SCAN_MODELS = {
  **{f: lambda f=f: family_model(f) for f in ("qwen3", "llama", "qwen2", "gemma3", "qwen3_moe")},
  "gemma_pattern": _gemma_pattern_model,
  "qwen3_lora": _lora_model,
}


def _rows(cfg, b=3, t=13, seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(b, t)), jnp.int32)
  valid = jnp.ones((b, t), bool).at[1, :3].set(False).at[2, :6].set(False)
  return tokens, valid


@pytest.mark.parametrize("model", list(_SCAN_MODELS))
def test_scan_layers_equals_the_unrolled_forward(model):
  cfg, graphdef, params = _SCAN_MODELS[model]()
  tokens, valid = _rows(cfg)
  args = (tokens, positions_from_mask(valid), valid)
  unrolled, _ = apply(graphdef, params, *args)
  scanned, _ = apply(_graphdef(cfg, scan_layers=True), params, *args)
  # Dense, MoE and LoRA come out bit-identical. In the Gemma models XLA:CPU fuses the
  # zero-centred norms and the embedding scale differently inside the scan body than across
  # unrolled layers: a few float32 ulps at the logits' scale, so there 1e-6 of max |logits|.
  scale = float(np.abs(unrolled).max()) if cfg.zero_centered_norms else 1.0
  np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), atol=1e-6 * scale, rtol=0)
  if cfg.num_experts:  # the routing comes back per layer, as from the loop
    routing = jax.jit(apply_with_routing, static_argnums=0)
    want = routing(graphdef, params, *args)[2]
    got = routing(_graphdef(cfg, scan_layers=True), params, *args)[2]
    np.testing.assert_array_equal(got["experts"], want["experts"])
    np.testing.assert_allclose(got["router_logits"], want["router_logits"], atol=1e-6, rtol=0)
    assert got["experts"].shape[0] == cfg.num_layers


def test_scan_layers_and_remat_keep_the_param_layout_and_init():
  cfg = ModelConfig.tiny().replace(num_layers=3)
  _, base = make_model(cfg, seed=2)
  _, other = make_model(cfg.replace(scan_layers=True, remat="full"), seed=2)
  assert jax.tree.structure(other) == jax.tree.structure(base)
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(other), strict=True):
    np.testing.assert_array_equal(a, b)
  assert ("layers", 2, "attn", "q") in dict(nnx.to_flat_state(other))  # per layer, as stored


def test_scan_layers_config_still_decodes_through_the_cache_as_the_full_forward():
  # A cached call (the sampler's) runs the layers as a loop even with scan_layers=True; it must
  # agree with the scanned learner forward.
  cfg, _, params = family_model("gemma3")
  graphdef = _graphdef(cfg, scan_layers=True, remat="full")
  tokens, valid = _rows(cfg)
  full, _ = apply(graphdef, params, tokens, positions_from_mask(valid), valid)
  cached = decode_through_cache(graphdef, params, cfg, tokens, valid, 4)
  np.testing.assert_allclose(np.asarray(cached)[valid], np.asarray(full)[valid], atol=1e-5, rtol=0)


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(graphdef, params, tokens, valid):
  def loss(p):
    logp = token_logprobs(graphdef, p, tokens, valid)
    mask = valid.at[:, 0].set(False)
    return -jnp.sum(jnp.where(mask, logp, 0.0)) / jnp.sum(mask)

  return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize("model", ["gemma3", "qwen3_moe"])
@pytest.mark.parametrize("scan", [False, True])
def test_remat_leaves_loss_and_gradients_unchanged(model, scan):
  cfg, graphdef, params = family_model(model)
  tokens, valid = _rows(cfg, seed=1)
  ref_loss, ref_grads = _loss_and_grads(graphdef, params, tokens, valid)
  base = _graphdef(cfg, scan_layers=scan)
  loss, grads = _loss_and_grads(base, params, tokens, valid) if scan else (ref_loss, ref_grads)
  # Scanning computes the same maths (the gradient per layer, split back from the stack).
  np.testing.assert_allclose(loss, ref_loss, atol=1e-6, rtol=0)
  for want, got in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads), strict=True):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  for policy in REMAT_POLICIES[1:]:
    r_loss, r_grads = _loss_and_grads(
      _graphdef(cfg, scan_layers=scan, remat=policy), params, tokens, valid
    )
    np.testing.assert_array_equal(r_loss, loss, err_msg=policy)  # the same forward, recomputed
    assert jax.tree.structure(r_grads) == jax.tree.structure(grads)
    for want, got in zip(jax.tree.leaves(grads), jax.tree.leaves(r_grads), strict=True):
      np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=policy)
