"""HF interop tests: logits parity per family, export round trips, sharded load, bad input."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from helpers import (
  apply,
  counting_hf_reads,
  distinct_block_elements,
  graphdef_of,
  hf_config_dict,
)
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jaxrl.mesh import get_rules, make_mesh, param_shardings
from jaxrl.models import hf
from jaxrl.models.config import PRESETS
from jaxrl.models.transformer import positions_from_mask

pytestmark = pytest.mark.integration

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
    plain_graphdef = graphdef_of(unscaled)
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


@pytest.mark.parametrize("case", ["qwen2", "moe"])
def test_sharded_load_reads_each_devices_block_once_and_nothing_else(case, tmp_path):
  # Every device's block is read from its own rows / columns of the HF tensor (biases and
  # per-expert tensors included), never the whole tensor then cut; devices holding the same block
  # (replication over the other axis) share one read. So a host reads only what its devices hold.
  model = _hf_model("qwen2_bias") if case == "qwen2" else _hf_moe("qwen3_moe_unnormed_tied")
  model.save_pretrained(tmp_path)
  mesh = make_mesh(1, 4, 2)
  with counting_hf_reads() as calls:
    _, _, params = hf.load_hf_checkpoint(tmp_path, mesh=mesh, rules=get_rules("fsdp_tp"))
  assert calls and all(read == size for read, size in calls), calls
  blocks = [distinct_block_elements(var.get_value()) for _, var in nnx.to_flat_state(params)]
  assert sum(read for read, _ in calls) == sum(blocks)
  assert sum(blocks) < 8 * sum(x.size for x in jax.tree.leaves(params))  # not one per device
  # The same params as the whole-tensor reads of an unsharded load.
  _, _, single = hf.load_hf_checkpoint(tmp_path)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
    hf.config_from_hf(hf_config_dict(**kw))


def test_config_from_hf_reads_old_and_new_rope_layouts():
  # transformers < 5: theta at the top level, the scaling dict under `rope_scaling`.
  scaling = {k: v for k, v in _LLAMA3_ROPE.items() if k != "rope_theta"}
  old = hf.config_from_hf(hf_config_dict(rope_theta=5e5, rope_scaling=scaling))
  new = hf.config_from_hf(hf_config_dict(rope_parameters={**_LLAMA3_ROPE, "rope_theta": 5e5}))
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


@pytest.mark.parametrize("cut", ["header", "data"])
def test_truncated_safetensors_names_the_file(cut, tmp_path):
  # A copy cut short (a full disk, an interrupted download): the error names the file.
  _hf_model("llama_mha_tied").save_pretrained(tmp_path)
  f = tmp_path / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[:40] if cut == "header" else data[: len(data) // 2])
  with pytest.raises(hf.CheckpointFileError, match=f"cannot read .*{f}"):
    hf.load_hf_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------- gemma 3

# (tie_word_embeddings, extra Gemma3TextConfig kwargs, jaxrl options whose removal must change
# the logits). Window 5 over 13 tokens, so the sliding layers really cut keys off; local and
# global RoPE bases differ, and the query scale is not head_dim**-0.5, so a mix-up shows.
GEMMA3_CASES = {
  "gemma3_tied": (
    True,
    {},
    [dict(layer_types=None, sliding_window=None), dict(rope_local_theta=None)],
  ),
  "gemma3_softcap_linear_rope": (
    False,
    dict(final_logit_softcapping=3.0, rope_scaling=dict(rope_type="linear", factor=4.0)),
    [dict(final_logit_softcap=None), dict(rope_scaling=None)],
  ),
}


def _hf_gemma3(case, seed=0):
  tie, extra, _ = GEMMA3_CASES[case]
  cfg = transformers.Gemma3TextConfig(
    vocab_size=131,
    hidden_size=48,
    intermediate_size=82,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=14,
    sliding_window=5,
    sliding_window_pattern=3,  # sliding, sliding, full, sliding
    rope_theta=1000.0,
    rope_local_base_freq=100.0,
    query_pre_attn_scalar=20,
    max_position_embeddings=128,
    tie_word_embeddings=tie,
    **extra,
  )
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval().float()
  with torch.no_grad():
    for p in model.parameters():  # the zero-centred norm weights too
      p.add_(0.1 * torch.randn_like(p))
  return model


def _gemma3_batch():
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 131, size=(3, 13)).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  valid[1, :4] = False  # left padding
  valid[2, :1] = False
  return np.where(valid, tokens, 0), valid


def _logits_with(cfg, params, tokens, valid, **overrides):
  """jaxrl logits of the same params under a changed config (to show an option matters)."""
  return _jax_logits(graphdef_of(cfg.replace(**overrides)), params, tokens, valid)


@pytest.mark.parametrize("case", list(GEMMA3_CASES))
def test_gemma3_load_matches_hf_logits(case, tmp_path):
  model = _hf_gemma3(case)
  model.save_pretrained(tmp_path)
  cfg, graphdef, params = hf.load_hf_checkpoint(tmp_path)
  assert cfg.layer_types == ("sliding_attention",) * 2 + ("full_attention", "sliding_attention")
  assert (cfg.sliding_window, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (5, 100.0, 20.0)
  tokens, valid = _gemma3_batch()
  ours = _jax_logits(graphdef, params, tokens, valid)
  ref = _hf_logits(model, tokens, valid)
  np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-4, rtol=0)
  # Each Gemma option must change the logits here, or this parity would not test it.
  for overrides in GEMMA3_CASES[case][2]:
    other = _logits_with(cfg, params, tokens, valid, **overrides)
    assert np.abs(other[valid] - ref[valid]).max() > 1e-2, overrides


def test_gemma3_export_reloads_in_transformers_and_jaxrl(tmp_path):
  model = _hf_gemma3("gemma3_softcap_linear_rope")
  model.save_pretrained(tmp_path / "src")
  cfg, _, params = hf.load_hf_checkpoint(tmp_path / "src")
  hf.export_hf_checkpoint(cfg, params, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval().float()
  assert type(reloaded).__name__ == "Gemma3ForCausalLM"
  tokens, valid = _gemma3_batch()
  np.testing.assert_allclose(
    _hf_logits(reloaded, tokens, valid)[valid],
    _hf_logits(model, tokens, valid)[valid],
    atol=1e-5,
    rtol=0,
  )
  cfg2, _, params2 = hf.load_hf_checkpoint(tmp_path / "out")
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, _pure(params2), _pure(params))


# google/gemma-3-1b-it config.json as published (transformers 4.50 layout: flat rope keys and
# an integer sliding_window_pattern instead of layer_types).
_GEMMA3_1B_HUB = {
  "architectures": ["Gemma3ForCausalLM"],
  "attention_bias": False,
  "attention_dropout": 0.0,
  "attn_logit_softcapping": None,
  "bos_token_id": 2,
  "cache_implementation": "hybrid",
  "eos_token_id": [1, 106],
  "final_logit_softcapping": None,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 1152,
  "initializer_range": 0.02,
  "intermediate_size": 6912,
  "max_position_embeddings": 32768,
  "model_type": "gemma3_text",
  "num_attention_heads": 4,
  "num_hidden_layers": 26,
  "num_key_value_heads": 1,
  "pad_token_id": 0,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000,
  "rope_scaling": None,
  "rope_theta": 1000000,
  "sliding_window": 512,
  "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16",
  "use_cache": True,
  "vocab_size": 262144,
}


def test_gemma3_hub_config_old_and_new_layouts_give_the_preset():
  from jaxrl.models.config import ModelConfig

  old = hf.config_from_hf(_GEMMA3_1B_HUB)
  # A checkpoint's config stores the weights as saved; the preset keeps float32 masters.
  assert old == ModelConfig.gemma3_1b().replace(param_dtype="bfloat16")
  # The same config through transformers 5 (nested per-layer-type rope_parameters, layer_types).
  new_dict = transformers.AutoConfig.for_model(**_GEMMA3_1B_HUB).to_dict()
  assert "full_attention" in new_dict["rope_parameters"]
  assert hf.config_from_hf(new_dict) == old
  assert hf.config_from_hf(hf.config_to_hf(old)) == old


def _gemma3_config(**kw):
  d = {k: v for k, v in _GEMMA3_1B_HUB.items() if k != "torch_dtype"}
  d.update(num_hidden_layers=4, vocab_size=131, hidden_size=48, intermediate_size=82)
  d.update(kw)
  return d


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "full_attention rope type 'yarn'"),
    (dict(rope_scaling=dict(rope_type="linear")), r"full_attention \(linear\) is missing 'factor'"),
    (
      dict(rope_parameters=dict(sliding_attention=dict(rope_type="linear", factor=2.0))),
      "sliding_attention rope type 'linear'",
    ),
    (dict(layer_types=["full_attention"] * 3), "layer_types has 3 entries"),
    (dict(layer_types=["full_attention"] * 3 + ["chunked_attention"]), "chunked_attention"),
    (dict(sliding_window=None), "set model.sliding_window"),
    (dict(final_logit_softcapping=-1.0), "final_logit_softcap"),
  ],
)
def test_bad_gemma3_hf_config_names_field(kw, match):
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(_gemma3_config(**kw))


def test_gemma_only_fields_refuse_other_families_and_vice_versa():
  from jaxrl.models.config import ModelConfig

  with pytest.raises(ValueError, match="model.post_norms=True need the Gemma 3 layout"):
    hf.config_to_hf(ModelConfig.tiny().replace(post_norms=True))
  gemma = hf.config_from_hf(_gemma3_config())
  for kw, match in [
    (dict(attn_logit_softcap=30.0), "model.attn_logit_softcap=30.0 has no gemma3_text"),
    (dict(mlp_activation="silu"), "model.mlp_activation='silu' does not fit gemma3_text"),
    (dict(qkv_bias=True), "model.qkv_bias=True does not fit gemma3_text"),
  ]:
    with pytest.raises(ValueError, match=match):
      hf.config_to_hf(gemma.replace(**kw))
  with pytest.raises(ValueError, match="does not match the config"):
    hf.config_to_hf(gemma, "llama")


# -------------------------------------------------------------------------------------------- MoE

# (model_type, tie_word_embeddings, num_key_value_heads, extra HF config). Odd expert counts and
# sizes; norm_topk_prob on in one Qwen3-MoE case, off (HF's default) in the other, whose 4 experts
# also split over fsdp=4.
MOE_CASES = {
  "qwen3_moe_gqa": (
    "qwen3_moe",
    False,
    2,
    dict(head_dim=14, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=22),
  ),
  "qwen3_moe_unnormed_tied": (
    "qwen3_moe",
    True,
    3,
    dict(num_experts=4, num_experts_per_tok=3, moe_intermediate_size=26),
  ),
  "mixtral_gqa": (
    "mixtral",
    False,
    2,
    dict(num_local_experts=5, num_experts_per_tok=2, rope_parameters=dict(rope_theta=1000.0)),
  ),
}
_MOE_CLASSES = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}
# What transformers 5 `save_pretrained` writes, and Hub checkpoints hold: one tensor per expert.
_FIRST_EXPERT = {
  "qwen3_moe": "model.layers.0.mlp.experts.0.gate_proj.weight",
  "mixtral": "model.layers.0.block_sparse_moe.experts.0.w1.weight",
}


def _hf_moe(case, seed=0):
  model_type, tie, kv, extra = MOE_CASES[case]
  cfg = _MOE_CLASSES[model_type](
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
  # The reference loop over experts: the default "grouped_mm" kernel rejects odd sizes on CPU.
  model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
  model = model.eval().float()
  with torch.no_grad():
    for p in model.parameters():  # the router too: HF initialises it to zeros (all ties)
      p.add_(0.1 * torch.randn_like(p))
  return model


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_load_matches_hf_logits(case, tmp_path):
  model_type, tie, _, extra = MOE_CASES[case]
  model = _hf_moe(case)
  model.save_pretrained(tmp_path)
  tensors = load_file(tmp_path / "model.safetensors")
  assert _FIRST_EXPERT[model_type] in tensors and not any("gate_up_proj" in n for n in tensors)
  cfg, graphdef, params = hf.load_hf_checkpoint(tmp_path)
  num_experts = extra.get("num_experts", extra.get("num_local_experts"))
  assert (cfg.num_experts, cfg.experts_per_token) == (num_experts, extra["num_experts_per_tok"])
  assert cfg.tie_embeddings == tie
  tokens, valid = _batch()
  ours = _jax_logits(graphdef, params, tokens, valid)
  ref = _hf_logits(model, tokens, valid)
  np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-4, rtol=0)
  if model_type == "qwen3_moe":
    # The top-k renormalisation must matter here, or this case would not test it.
    flipped = cfg.replace(norm_topk_prob=not cfg.norm_topk_prob)
    flipped_graphdef = graphdef_of(flipped)
    other = _jax_logits(flipped_graphdef, params, tokens, valid)
    assert np.abs(other[valid] - ref[valid]).max() > 1e-2


@pytest.mark.parametrize("case", ["qwen3_moe_gqa", "mixtral_gqa"])
def test_moe_export_reloads_in_transformers_and_jaxrl(case, tmp_path):
  model = _hf_moe(case)
  model.save_pretrained(tmp_path / "src")
  cfg, graphdef, params = hf.load_hf_checkpoint(tmp_path / "src")
  # Small shards for mixtral, so one layer's experts land in different files.
  shard = 20_000 if case == "mixtral_gqa" else 2**30
  hf.export_hf_checkpoint(cfg, params, tmp_path / "out", max_shard_bytes=shard)
  if case == "mixtral_gqa":
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    w1 = {f for n, f in index["weight_map"].items() if ".layers.0." in n and ".w1." in n}
    assert len(w1) > 1
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / "out", experts_implementation="eager"
  )
  reloaded = reloaded.eval().float()
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


def test_moe_sharded_load_places_each_param_and_matches_single_device(tmp_path):
  _hf_moe("qwen3_moe_unnormed_tied").save_pretrained(tmp_path)
  mesh = make_mesh(1, 4, 2)
  rules = get_rules("fsdp_tp")
  cfg, graphdef, params = hf.load_hf_checkpoint(tmp_path, mesh=mesh, rules=rules)
  want = dict(nnx.to_flat_state(param_shardings(params, mesh, rules)))
  flat_params = nnx.to_flat_state(params)
  assert len(flat_params) == len(want)
  for path, var in flat_params:
    assert var.get_value().sharding == want[path].get_value(), path
  # The 4 experts split over fsdp, the expert mlp dim (26) over tensor.
  mlp = params["layers"][0]["mlp"]
  assert mlp["gate"].get_value().sharding.spec == P("fsdp", None, "tensor")
  assert mlp["down"].get_value().sharding.spec == P("fsdp", "tensor", None)
  _, _, single = hf.load_hf_checkpoint(tmp_path)
  tokens, valid = _batch()
  np.testing.assert_allclose(
    _jax_logits(graphdef, params, tokens, valid)[valid],
    _jax_logits(graphdef, single, tokens, valid)[valid],
    atol=1e-5,
    rtol=0,
  )


# The config.json files of the Hub checkpoints (Qwen3-MoE's in the transformers 4 layout).
_QWEN3_30B_A3B = dict(
  model_type="qwen3_moe",
  vocab_size=151936,
  hidden_size=2048,
  intermediate_size=6144,
  num_hidden_layers=48,
  num_attention_heads=32,
  num_key_value_heads=4,
  head_dim=128,
  decoder_sparse_step=1,
  mlp_only_layers=[],
  moe_intermediate_size=768,
  norm_topk_prob=True,
  num_experts=128,
  num_experts_per_tok=8,
  max_position_embeddings=40960,
  rms_norm_eps=1e-06,
  rope_scaling=None,
  rope_theta=1000000.0,
  sliding_window=None,
  use_sliding_window=False,
  tie_word_embeddings=False,
  torch_dtype="bfloat16",
  attention_bias=False,
  hidden_act="silu",
)
_MIXTRAL_8X7B = dict(
  model_type="mixtral",
  vocab_size=32000,
  hidden_size=4096,
  intermediate_size=14336,
  num_hidden_layers=32,
  num_attention_heads=32,
  num_key_value_heads=8,
  num_local_experts=8,
  num_experts_per_tok=2,
  max_position_embeddings=32768,
  rms_norm_eps=1e-05,
  rope_theta=1000000.0,
  router_aux_loss_coef=0.02,
  sliding_window=None,
  tie_word_embeddings=False,
  torch_dtype="bfloat16",
  hidden_act="silu",
)


@pytest.mark.parametrize(
  "hub, preset", [(_QWEN3_30B_A3B, "qwen3_30b_a3b"), (_MIXTRAL_8X7B, "mixtral_8x7b")]
)
def test_moe_hub_configs_match_presets_and_round_trip(hub, preset):
  cfg = hf.config_from_hf(hub)
  # A checkpoint's config stores the weights as saved; the preset keeps float32 masters.
  assert cfg == PRESETS[preset]().replace(param_dtype="bfloat16")
  assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg
  assert hf.config_to_hf(cfg)["model_type"] == hub["model_type"]


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(model_type="qwen3_moe", mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(model_type="qwen3_moe", decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(model_type="qwen3_moe", num_experts=0), "num_experts=0"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5), "experts_per_token"),
    (dict(model_type="qwen3_moe", shared_expert_intermediate_size=8), "shared experts"),
    (dict(model_type="mixtral", sliding_window=64), "sliding_window=64"),
    (dict(model_type="mixtral", router_jitter_noise=0.1), "router_jitter_noise"),
  ],
)
def test_bad_moe_hf_config_names_field(kw, match):
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(hf_config_dict(**kw))


@pytest.mark.parametrize(
  "edit, match",
  [
    (
      lambda t: t.pop("model.layers.1.block_sparse_moe.experts.4.w3.weight"),
      "missing tensors: model.layers.1.block_sparse_moe.experts.4.w3.weight",
    ),
    (
      lambda t: t.update(
        {"model.layers.0.block_sparse_moe.experts.5.w1.weight": np.zeros((82, 48), np.float32)}
      ),
      "unexpected tensors: model.layers.0.block_sparse_moe.experts.5.w1.weight",
    ),
    (
      lambda t: t.update(
        {"model.layers.0.block_sparse_moe.experts.2.w2.weight": np.zeros((48, 81), np.float32)}
      ),
      r"experts.2.w2.weight has shape \(48, 81\); expected \(48, 82\).*\(expert 2\)",
    ),
  ],
)
def test_bad_moe_checkpoint_names_tensor(edit, match, tmp_path):
  _hf_moe("mixtral_gqa").save_pretrained(tmp_path)
  _edit_checkpoint(tmp_path, edit)
  with pytest.raises(ValueError, match=match):
    hf.load_hf_checkpoint(tmp_path)


def test_lora_load_adds_fresh_adapters_and_export_merges_them(tmp_path):
  from jaxrl.models.lora import split_lora
  from jaxrl.models.transformer import make_model

  model = _hf_model("qwen3_gqa_tied")
  model.save_pretrained(tmp_path / "src")
  cfg0, graphdef0, params0 = hf.load_hf_checkpoint(tmp_path / "src")
  lora = dict(lora_rank=3, lora_alpha=6.0, lora_targets=("q", "o", "down"))
  cfg, graphdef, params = hf.load_hf_checkpoint(tmp_path / "src", lora=lora, lora_seed=1)
  assert cfg == cfg0.replace(**lora)
  adapter, base = split_lora(params)
  jax.tree.map(np.testing.assert_array_equal, _pure(base), _pure(params0))
  # The adapters are those of a fresh LoRA model of the same seed (A random, B zero) ...
  _, fresh = make_model(cfg, seed=1)
  jax.tree.map(np.testing.assert_array_equal, _pure(adapter), _pure(split_lora(fresh)[0]))
  tokens, valid = _batch()
  base_logits = _jax_logits(graphdef0, params0, tokens, valid)
  # ... so the loaded LoRA model is the checkpoint's model.
  np.testing.assert_array_equal(_jax_logits(graphdef, params, tokens, valid), base_logits)

  # As after training: B nonzero. Export merges it; transformers then computes base + adapter.
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.3 * rng.normal(size=x.shape).astype(x.dtype) if p[-2].key == "b" else x,
    params,
  )
  ours = _jax_logits(graphdef, params, tokens, valid)
  assert np.abs(ours - base_logits)[valid].max() > 0.1
  hf.export_hf_checkpoint(cfg, params, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval().float()
  np.testing.assert_allclose(_hf_logits(reloaded, tokens, valid)[valid], ours[valid], atol=1e-4)
  cfg2, graphdef2, params2 = hf.load_hf_checkpoint(tmp_path / "out")
  assert cfg2 == cfg0
  np.testing.assert_allclose(_jax_logits(graphdef2, params2, tokens, valid), ours, atol=1e-5)

  with pytest.raises(ValueError, match=r"lora= has \['rank'\]; allowed: lora_rank"):
    hf.load_hf_checkpoint(tmp_path / "src", lora=dict(rank=2))


def test_lora_sharded_load_places_adapters_by_their_axes(tmp_path):
  _hf_model("qwen3_mha").save_pretrained(tmp_path)
  mesh = make_mesh(1, 4, 2)
  _, _, params = hf.load_hf_checkpoint(tmp_path, mesh=mesh, rules="fsdp_tp", lora=dict(lora_rank=2))
  attn = params["layers"][0]["attn"]
  # q's A [D, r]: embed on fsdp, the rank whole; B [r, N, H]: heads on tensor.
  assert attn["q_lora"]["a"].get_value().sharding.spec == P("fsdp", None)
  assert attn["q_lora"]["b"].get_value().sharding.spec == P(None, "tensor", None)
  assert attn["q"].get_value().sharding.spec == P("fsdp", "tensor", None)


@pytest.mark.parametrize(
  "family, case",
  [
    ("dense", "qwen3_gqa_tied"),
    ("dense", "llama_llama3_rope"),
    ("gemma3", "gemma3_softcap_linear_rope"),
    ("moe", "qwen3_moe_gqa"),
  ],
)
@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_layers_match_hf_logits(family, case, remat, tmp_path):
  """HF parity holds when the same loaded params run as one scanned (and rematerialised) stack."""
  model = {"dense": _hf_model, "gemma3": _hf_gemma3, "moe": _hf_moe}[family](case)
  model.save_pretrained(tmp_path)
  cfg, _, params = hf.load_hf_checkpoint(tmp_path)
  assert not cfg.scan_layers  # the loader's layout is per layer; scanning is a run-time choice
  tokens, valid = _gemma3_batch() if family == "gemma3" else _batch()
  ours = _logits_with(cfg, params, tokens, valid, scan_layers=True, remat=remat)
  ref = _hf_logits(model, tokens, valid)
  np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-4, rtol=0)
