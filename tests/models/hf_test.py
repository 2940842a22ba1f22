"""HF interop tests: logits parity per family, export round trips, sharded load, bad input."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxrl.mesh import get_rules, make_mesh, param_shardings
from jaxrl.models import hf
from jaxrl.models.transformer import Transformer, positions_from_mask
from jaxrl.models.transformer import apply as _apply

# Jitted with the graphdef static: an eager forward dispatches op by op and is slow on CPU.
apply = jax.jit(_apply, static_argnums=0)

_LLAMA3_ROPE = dict(
  rope_type="llama3",
  rope_theta=500.0,
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  # Small, so that with head_dim 8 every frequency band (kept, smoothed, divided) occurs.
  original_max_position_embeddings=16,
)
_CLASSES = {
  "qwen3": transformers.Qwen3Config,
  "qwen2": transformers.Qwen2Config,
  "llama": transformers.LlamaConfig,
}
# (model_type, tie_word_embeddings, num_key_value_heads, extra HF config)
CASES = {
  "qwen3_gqa_tied": ("qwen3", True, 2, dict(head_dim=14)),
  "qwen3_mha": ("qwen3", False, 6, dict(head_dim=8)),
  "qwen2_bias": ("qwen2", False, 2, {}),
  "llama_llama3_rope": ("llama", False, 2, dict(rope_parameters=_LLAMA3_ROPE)),
  "llama_mha_tied": ("llama", True, 6, dict(rope_parameters=dict(rope_theta=1000.0))),
}


def _hf_model(case, seed=0):
  """A tiny random transformers model; every weight (norms and biases too) perturbed so a
  weight wired to the wrong place shows."""
  model_type, tie, kv, extra = CASES[case]
  cfg = _CLASSES[model_type](
    vocab_size=131,
    hidden_size=48,
    intermediate_size=82,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=kv,
    max_position_embeddings=128,
    tie_word_embeddings=tie,
    **extra,
  )
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval().float()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 131, size=(3, 37)).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  valid[1, :5] = False  # left padding
  valid[2, :1] = False
  return np.where(valid, tokens, 0), valid


def _hf_logits(model, tokens, valid):
  with torch.no_grad():
    return model(
      input_ids=torch.from_numpy(tokens).long(),
      attention_mask=torch.from_numpy(valid).long(),
      position_ids=torch.from_numpy(np.array(positions_from_mask(valid))).long(),
    ).logits.numpy()


def _jax_logits(graphdef, params, tokens, valid):
  logits, _ = apply(graphdef, params, tokens, positions_from_mask(valid), valid)
  return np.asarray(logits)


def _pure(params):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(params))


@pytest.mark.parametrize("case", list(CASES))
def test_load_matches_hf_logits(case, tmp_path):
  model = _hf_model(case)
  # One case as a sharded checkpoint (index json + several files).
  model.save_pretrained(tmp_path, max_shard_size="30KB" if case == "qwen2_bias" else "50GB")
  if case == "qwen2_bias":
    assert (tmp_path / "model.safetensors.index.json").exists()
  cfg, graphdef, params = hf.load_hf_checkpoint(tmp_path)
  assert cfg.tie_embeddings == CASES[case][1] and cfg.num_kv_heads == CASES[case][2]
  tokens, valid = _batch()
  ours = _jax_logits(graphdef, params, tokens, valid)
  ref = _hf_logits(model, tokens, valid)
  np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-4, rtol=0)
  if cfg.rope_scaling is not None:
    # The scaling must matter here, or this case would not test it.
    unscaled = cfg.replace(rope_scaling=None)
    plain_graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(unscaled, rngs=nnx.Rngs(0))))
    plain = _jax_logits(plain_graphdef, params, tokens, valid)
    assert np.abs(plain[valid] - ref[valid]).max() > 1e-2


@pytest.mark.parametrize("case", ["qwen3_gqa_tied", "qwen2_bias", "llama_llama3_rope"])
def test_export_reloads_in_transformers_and_jaxrl(case, tmp_path):
  model = _hf_model(case)
  model.save_pretrained(tmp_path / "src")
  cfg, graphdef, params = hf.load_hf_checkpoint(tmp_path / "src")
  # A small shard limit for one case, so the index-json path is exercised on export too.
  shard = 20_000 if case == "qwen2_bias" else 2**30
  hf.export_hf_checkpoint(cfg, params, tmp_path / "out", max_shard_bytes=shard)
  if case == "qwen2_bias":
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval().float()
  tokens, valid = _batch()
  np.testing.assert_allclose(
    _hf_logits(reloaded, tokens, valid)[valid],
    _hf_logits(model, tokens, valid)[valid],
    atol=1e-5,
    rtol=0,
  )
  cfg2, _, params2 = hf.load_hf_checkpoint(tmp_path / "out")
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, _pure(params2), _pure(params))


def test_sharded_load_places_each_param_and_matches_single_device(tmp_path):
  _hf_model("qwen2_bias").save_pretrained(tmp_path)
  mesh = make_mesh(1, 4, 2)
  rules = get_rules("fsdp_tp")
  cfg, graphdef, params = hf.load_hf_checkpoint(tmp_path, mesh=mesh, rules=rules)
  want = param_shardings(params, mesh, rules)
  flat_params = nnx.to_flat_state(params)
  flat_want = dict(nnx.to_flat_state(want))
  assert len(flat_params) == len(flat_want)
  specs = set()
  for path, var in flat_params:
    got = var.get_value().sharding
    assert got == flat_want[path].get_value(), path
    specs.add(got.spec)
  assert len(specs) > 2  # not everything replicated: the rules really split the weights
  _, _, single = hf.load_hf_checkpoint(tmp_path)
  tokens, valid = _batch()
  np.testing.assert_allclose(
    _jax_logits(graphdef, params, tokens, valid)[valid],
    _jax_logits(graphdef, single, tokens, valid)[valid],
    atol=1e-5,
    rtol=0,
  )


def _base_config(**kw):
  d = dict(
    model_type="llama",
    vocab_size=131,
    hidden_size=48,
    intermediate_size=82,
    num_hidden_layers=2,
    num_attention_heads=6,
  )
  d.update(kw)
  return d


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(model_type="gpt2"), "model_type='gpt2'"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0)), "rope type 'yarn'"),
    (dict(rope_scaling=dict(type="linear", factor=2.0)), "rope type 'linear'"),
    (dict(hidden_size=50), "hidden_size=50 is not divisible by num_attention_heads=6"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=64), "use_sliding_window"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_key_value_heads=4), "num_kv_heads"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters=dict(rope_type="llama3", factor=8.0)), "low_freq_factor"),
  ],
)
def test_bad_hf_config_names_field(kw, match):
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(_base_config(**kw))


def test_config_from_hf_reads_old_and_new_rope_layouts():
  # transformers < 5: theta at the top level, the scaling dict under `rope_scaling`.
  scaling = {k: v for k, v in _LLAMA3_ROPE.items() if k != "rope_theta"}
  old = hf.config_from_hf(_base_config(rope_theta=5e5, rope_scaling=scaling))
  new = hf.config_from_hf(_base_config(rope_parameters={**_LLAMA3_ROPE, "rope_theta": 5e5}))
  assert old == new and old.rope_theta == 5e5 and old.rope_scaling.original_max_position == 16
  assert hf.config_from_hf(hf.config_to_hf(new)) == new


def _edit_checkpoint(path, edit):
  tensors = load_file(path / "model.safetensors")
  edit(tensors)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
  "edit, match",
  [
    (
      lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
      "missing tensors: model.layers.1.self_attn.k_proj.weight",
    ),
    (
      lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}),
      "unexpected tensors: model.layers.0.mlp.extra.weight",
    ),
    (
      lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((82, 47), np.float32)}),
      r"model.layers.0.mlp.up_proj.weight has shape \(82, 47\); expected \(82, 48\)",
    ),
  ],
)
def test_bad_checkpoint_names_tensor(edit, match, tmp_path):
  _hf_model("llama_mha_tied").save_pretrained(tmp_path)
  _edit_checkpoint(tmp_path, edit)
  with pytest.raises(ValueError, match=match):
    hf.load_hf_checkpoint(tmp_path)
