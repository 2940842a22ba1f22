"""HF transformers interop: config translation, a weight-name table per family, safetensors I/O."""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl.kernels import KERNELS
from jaxrl.mesh import Rules, param_shardings, path_str
from jaxrl.models.config import DTYPES, LAYER_TYPES, ModelConfig, RopeScaling, sliding_layer_types
from jaxrl.models.lora import merge_lora
from jaxrl.models.transformer import Transformer

FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe", "mixtral", "gemma3_text")
_ARCHITECTURES = {
  "gemma3_text": "Gemma3ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "llama": "LlamaForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
  "mixtral": "MixtralForCausalLM",
}
# What each HF config class assumes when a key is absent from config.json.
_DEFAULT_MAX_POSITIONS = {
  "gemma3_text": 131_072,
  "qwen3": 32_768,
  "qwen2": 32_768,
  "llama": 2048,
  "qwen3_moe": 32_768,
  "mixtral": 4096 * 32,
}
# MoE config defaults of the HF config classes: (experts, experts per token, expert mlp dim,
# renormalise top-k). Mixtral has no separate expert size: its experts use intermediate_size.
_MOE_DEFAULTS = {"qwen3_moe": (128, 8, 768, False), "mixtral": (8, 2, None, True)}
_QWEN3_DEFAULT_HEAD_DIM = 128

# Weight transforms between an HF tensor and a jaxrl param of shape `shape`:
#   COPY    the same array;
#   LINEAR  HF nn.Linear weight [out, in]; jaxrl keeps the input dim first, the output dims split
#           ([D, N, H] for q, [D, F] for gate);
#   LINEAR2 the same with two input dims first (o: [N, H, D] <- HF [D, N*H]);
#   FLAT    a bias: HF [N*H] <-> jaxrl [N, H].
COPY, LINEAR, LINEAR2, FLAT = "copy", "linear", "linear2", "flat"
_LINEAR_IN_DIMS = {LINEAR: 1, LINEAR2: 2}

WeightRule = tuple[str, str, str]  # (HF tensor name, jaxrl param path, transform); {i} = layer
# An {e} (expert) in the HF name: that tensor is slice e of the leading (expert) axis of the
# jaxrl param, so per-expert HF tensors stack into one expert-major array, and split back.

_DECODER: tuple[WeightRule, ...] = (
  ("model.embed_tokens.weight", "embed", COPY),
  ("model.norm.weight", "final_norm/scale", COPY),
  ("lm_head.weight", "head", LINEAR),  # dropped for tied embeddings: the model has no `head`
  ("model.layers.{i}.input_layernorm.weight", "layers/{i}/attn_norm/scale", COPY),
  ("model.layers.{i}.post_attention_layernorm.weight", "layers/{i}/mlp_norm/scale", COPY),
  ("model.layers.{i}.self_attn.q_proj.weight", "layers/{i}/attn/q", LINEAR),
  ("model.layers.{i}.self_attn.k_proj.weight", "layers/{i}/attn/k", LINEAR),
  ("model.layers.{i}.self_attn.v_proj.weight", "layers/{i}/attn/v", LINEAR),
  ("model.layers.{i}.self_attn.o_proj.weight", "layers/{i}/attn/o", LINEAR2),
  ("model.layers.{i}.mlp.gate_proj.weight", "layers/{i}/mlp/gate", LINEAR),
  ("model.layers.{i}.mlp.up_proj.weight", "layers/{i}/mlp/up", LINEAR),
  ("model.layers.{i}.mlp.down_proj.weight", "layers/{i}/mlp/down", LINEAR),
)

_ATTENTION_ONLY = tuple(rule for rule in _DECODER if ".mlp." not in rule[0])
_QK_NORM: tuple[WeightRule, ...] = (
  ("model.layers.{i}.self_attn.q_norm.weight", "layers/{i}/attn/q_norm/scale", COPY),
  ("model.layers.{i}.self_attn.k_norm.weight", "layers/{i}/attn/k_norm/scale", COPY),
)


def _moe_rules(prefix: str, gate: str, up: str, down: str) -> tuple[WeightRule, ...]:
  return (
    (f"model.layers.{{i}}.{prefix}.gate.weight", "layers/{i}/mlp/router", LINEAR),
    (f"model.layers.{{i}}.{prefix}.experts.{{e}}.{gate}.weight", "layers/{i}/mlp/gate", LINEAR),
    (f"model.layers.{{i}}.{prefix}.experts.{{e}}.{up}.weight", "layers/{i}/mlp/up", LINEAR),
    (f"model.layers.{{i}}.{prefix}.experts.{{e}}.{down}.weight", "layers/{i}/mlp/down", LINEAR),
  )


# Gemma 3 names its four block norms differently: `post_attention_layernorm` is the norm on the
# attention output, and the pre-MLP norm (jaxrl `mlp_norm`) is `pre_feedforward_layernorm`.
_GEMMA3: tuple[WeightRule, ...] = (
  ("model.embed_tokens.weight", "embed", COPY),
  ("model.norm.weight", "final_norm/scale", COPY),
  ("lm_head.weight", "head", LINEAR),
  ("model.layers.{i}.input_layernorm.weight", "layers/{i}/attn_norm/scale", COPY),
  ("model.layers.{i}.post_attention_layernorm.weight", "layers/{i}/post_attn_norm/scale", COPY),
  ("model.layers.{i}.pre_feedforward_layernorm.weight", "layers/{i}/mlp_norm/scale", COPY),
  ("model.layers.{i}.post_feedforward_layernorm.weight", "layers/{i}/post_mlp_norm/scale", COPY),
  ("model.layers.{i}.self_attn.q_proj.weight", "layers/{i}/attn/q", LINEAR),
  ("model.layers.{i}.self_attn.k_proj.weight", "layers/{i}/attn/k", LINEAR),
  ("model.layers.{i}.self_attn.v_proj.weight", "layers/{i}/attn/v", LINEAR),
  ("model.layers.{i}.self_attn.o_proj.weight", "layers/{i}/attn/o", LINEAR2),
  ("model.layers.{i}.self_attn.q_norm.weight", "layers/{i}/attn/q_norm/scale", COPY),
  ("model.layers.{i}.self_attn.k_norm.weight", "layers/{i}/attn/k_norm/scale", COPY),
  ("model.layers.{i}.mlp.gate_proj.weight", "layers/{i}/mlp/gate", LINEAR),
  ("model.layers.{i}.mlp.up_proj.weight", "layers/{i}/mlp/up", LINEAR),
  ("model.layers.{i}.mlp.down_proj.weight", "layers/{i}/mlp/down", LINEAR),
)

WEIGHT_MAPS: dict[str, tuple[WeightRule, ...]] = {
  "gemma3_text": _GEMMA3,
  "llama": _DECODER,
  "qwen3": _DECODER
  + (
    ("model.layers.{i}.self_attn.q_norm.weight", "layers/{i}/attn/q_norm/scale", COPY),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers/{i}/attn/k_norm/scale", COPY),
  ),
  "qwen2": _DECODER
  + (
    ("model.layers.{i}.self_attn.q_proj.bias", "layers/{i}/attn/q_bias", FLAT),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers/{i}/attn/k_bias", FLAT),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers/{i}/attn/v_bias", FLAT),
  ),
  # Hub checkpoints (and transformers 5 `save_pretrained`) store one tensor per expert; in memory
  # transformers fuses them (experts.gate_up_proj), which is not a file format we need to read.
  "qwen3_moe": _ATTENTION_ONLY + _QK_NORM + _moe_rules("mlp", "gate_proj", "up_proj", "down_proj"),
  "mixtral": _ATTENTION_ONLY + _moe_rules("block_sparse_moe", "w1", "w3", "w2"),
}

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


# ---------------------------------------------------------------------------------------- config


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """A validated ModelConfig from an HF config.json dict (qwen3, qwen2 or llama)."""
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise ValueError(f"hf config model_type={model_type!r} is not supported; allowed: {FAMILIES}")
  if model_type == "gemma3_text":
    return _gemma3_from_hf(hf)

  def need(key):
    if hf.get(key) is None:
      raise ValueError(f"hf config ({model_type}) is missing {key!r}")
    return hf[key]

  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hf config hidden_act={hf['hidden_act']!r} is not supported; allowed: silu")
  hidden, heads = need("hidden_size"), need("num_attention_heads")
  head_dim = hf.get("head_dim")
  if head_dim is None and model_type == "qwen3":
    head_dim = _QWEN3_DEFAULT_HEAD_DIM
  elif head_dim is None:
    if hidden % heads:
      raise ValueError(
        f"hf config hidden_size={hidden} is not divisible by num_attention_heads={heads} "
        "and head_dim is absent"
      )
    head_dim = hidden // heads
  # Qwen2 always has q/k/v biases; in Qwen3 and Llama `attention_bias` also adds one to o_proj.
  if model_type != "qwen2" and hf.get("attention_bias", False):
    raise ValueError(f"hf config attention_bias=True is not supported for {model_type}")
  if hf.get("mlp_bias", False):
    raise ValueError(f"hf config mlp_bias=True is not supported for {model_type}")
  if hf.get("use_sliding_window", False):
    raise ValueError(
      f"hf config use_sliding_window=True (sliding_window={hf.get('sliding_window')}) is not "
      "supported; only full attention is"
    )
  layer_types = set(hf.get("layer_types") or ())
  if layer_types - {"full_attention"}:
    raise ValueError(f"hf config layer_types={sorted(layer_types)}; allowed: full_attention")
  max_positions = hf.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type]
  rope_theta, rope_scaling = _rope_from_hf(hf, max_positions)
  dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  if dtype not in DTYPES:
    raise ValueError(f"hf config dtype={dtype!r} is not supported; allowed: {DTYPES}")
  moe = _moe_from_hf(hf, model_type)
  try:
    return ModelConfig(
      vocab_size=need("vocab_size"),
      num_layers=need("num_hidden_layers"),
      embed_dim=hidden,
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=head_dim,
      mlp_dim=need("intermediate_size"),
      rope_theta=float(rope_theta),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qk_norm=model_type in ("qwen3", "qwen3_moe"),
      qkv_bias=model_type == "qwen2",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      rope_scaling=rope_scaling,
      max_seq_len=max_positions,
      dtype=dtype,
      param_dtype=dtype,
      **moe,
    )
  except ValueError as e:
    raise ValueError(f"hf config ({model_type}) is inconsistent: {e}") from e


def _moe_from_hf(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
  """The ModelConfig MoE fields of an HF config; every layer must be a plain top-k MoE layer."""
  if model_type not in _MOE_DEFAULTS:
    return {}
  experts, top_k, moe_dim, renorm = _MOE_DEFAULTS[model_type]
  # transformers 5 writes `num_local_experts` for both; older Qwen3-MoE files `num_experts`.
  experts = hf.get("num_local_experts", hf.get("num_experts", experts))
  for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
    if hf.get(key):
      raise ValueError(f"hf config {key}={hf[key]} (shared experts) is not supported")
  if model_type == "qwen3_moe":
    if hf.get("mlp_only_layers"):
      raise ValueError(
        f"hf config mlp_only_layers={hf['mlp_only_layers']} is not supported; allowed: [] "
        "(every layer a MoE layer)"
      )
    if hf.get("decoder_sparse_step", 1) != 1:
      raise ValueError(
        f"hf config decoder_sparse_step={hf['decoder_sparse_step']} is not supported; allowed: 1"
      )
    moe_dim = hf.get("moe_intermediate_size", moe_dim)
    renorm = bool(hf.get("norm_topk_prob", renorm))
  else:
    if hf.get("sliding_window") is not None:
      raise ValueError(
        f"hf config sliding_window={hf['sliding_window']} is not supported for mixtral; "
        "allowed: null (full attention)"
      )
    if hf.get("router_jitter_noise", 0.0):
      raise ValueError(
        f"hf config router_jitter_noise={hf['router_jitter_noise']} is not supported; allowed: 0"
      )
    moe_dim = hf.get("intermediate_size")
  if not experts:
    raise ValueError(f"hf config ({model_type}) has num_experts={experts!r}; it must be > 0")
  return dict(
    num_experts=experts,
    experts_per_token=hf.get("num_experts_per_tok", top_k),
    moe_mlp_dim=moe_dim,
    norm_topk_prob=renorm,
  )


def _rope_from_hf(hf: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
  # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` plus an
  # optional `rope_scaling` dict whose type key is `rope_type` or, older still, `type`.
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("hf config partial_rotary_factor != 1 is not supported")
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise ValueError(f"hf config rope type {kind!r} is not supported; allowed: default, llama3")
  for key in ("factor", "low_freq_factor", "high_freq_factor"):
    if key not in params:
      raise ValueError(f"hf config rope_parameters (llama3) is missing {key!r}")
  try:
    scaling = RopeScaling(
      kind="llama3",
      factor=float(params["factor"]),
      low_freq_factor=float(params["low_freq_factor"]),
      high_freq_factor=float(params["high_freq_factor"]),
      original_max_position=int(
        hf.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_positions
      ),
    )
  except ValueError as e:
    raise ValueError(f"hf config rope_parameters: {e}") from e
  return theta, scaling


# ---------------------------------------------------------------------------------------- gemma 3

# Gemma3TextConfig defaults, for keys a config.json leaves out.
_GEMMA3_DEFAULTS = dict(
  head_dim=256,
  query_pre_attn_scalar=256,
  sliding_window=4096,
  sliding_window_pattern=6,
  rope_theta=1_000_000.0,
  rope_local_base_freq=10_000.0,
)
_GEMMA3_ACTIVATION = "gelu_pytorch_tanh"


def _gemma3_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """ModelConfig of a `gemma3_text` config (Gemma3ForCausalLM, e.g. google/gemma-3-1b-it)."""
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
  for key in (*required, "num_attention_heads"):
    if hf.get(key) is None:
      raise ValueError(f"hf config (gemma3_text) is missing {key!r}")
  act = hf.get("hidden_activation") or _GEMMA3_ACTIVATION
  if act != _GEMMA3_ACTIVATION:
    raise ValueError(
      f"hf config hidden_activation={act!r} is not supported; allowed: {_GEMMA3_ACTIVATION}"
    )
  for key in ("attention_bias", "use_bidirectional_attention"):
    if hf.get(key):
      raise ValueError(f"hf config {key}={hf[key]!r} is not supported for gemma3_text")
  if hf.get("attn_logit_softcapping") is not None:
    # transformers' Gemma3 reads the key but never applies it (Gemma 2 did): refuse to guess.
    raise ValueError(
      f"hf config attn_logit_softcapping={hf['attn_logit_softcapping']} is not supported for "
      "gemma3_text (transformers ignores it there); allowed: null"
    )
  num_layers = hf["num_hidden_layers"]
  layer_types = hf.get("layer_types")
  if layer_types is None:
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
    layer_types = sliding_layer_types(
      num_layers, pattern or _GEMMA3_DEFAULTS["sliding_window_pattern"]
    )
  window = hf.get("sliding_window", _GEMMA3_DEFAULTS["sliding_window"])
  if "sliding_attention" not in layer_types:
    window = None  # unused by every layer; ModelConfig keeps it only where some layer slides
  theta, local_theta, scaling = _gemma3_rope_from_hf(hf)
  dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  if dtype not in DTYPES:
    raise ValueError(f"hf config dtype={dtype!r} is not supported; allowed: {DTYPES}")
  try:
    return ModelConfig(
      vocab_size=hf["vocab_size"],
      num_layers=num_layers,
      embed_dim=hf["hidden_size"],
      num_heads=hf["num_attention_heads"],
      num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
      head_dim=hf.get("head_dim") or _GEMMA3_DEFAULTS["head_dim"],
      mlp_dim=hf["intermediate_size"],
      rope_theta=theta,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qk_norm=True,
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      rope_scaling=scaling,
      max_seq_len=hf.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS["gemma3_text"],
      dtype=dtype,
      param_dtype=dtype,
      layer_types=tuple(layer_types),
      sliding_window=window,
      rope_local_theta=local_theta,
      query_pre_attn_scalar=float(
        hf.get("query_pre_attn_scalar") or _GEMMA3_DEFAULTS["query_pre_attn_scalar"]
      ),
      mlp_activation="gelu_tanh",
      zero_centered_norms=True,
      post_norms=True,
      scale_embeddings=True,
      final_logit_softcap=hf.get("final_logit_softcapping"),
    )
  except ValueError as e:
    raise ValueError(f"hf config (gemma3_text) is inconsistent: {e}") from e


def _gemma3_rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, float, RopeScaling | None]:
  """(global theta, local theta, global scaling). transformers >= 5 nests `rope_parameters` by
  layer type; older files have `rope_theta`, `rope_local_base_freq` and a `rope_scaling` dict
  that applies to the global layers only."""
  params = hf.get("rope_parameters") or {}
  if set(params) & set(LAYER_TYPES):
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
  else:
    full, local = dict(params or hf.get("rope_scaling") or {}), {}
  theta = full.get("rope_theta", hf.get("rope_theta", _GEMMA3_DEFAULTS["rope_theta"]))
  local_theta = local.get(
    "rope_theta", hf.get("rope_local_base_freq", _GEMMA3_DEFAULTS["rope_local_base_freq"])
  )
  for name, p in (("full_attention", full), ("sliding_attention", local)):
    if p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
      raise ValueError(
        f"hf config rope_parameters.{name}.partial_rotary_factor != 1 is not supported"
      )
  local_kind = local.get("rope_type", local.get("type", "default"))
  if local_kind != "default":
    raise ValueError(
      f"hf config rope_parameters.sliding_attention rope type {local_kind!r} is not supported; "
      "allowed: default"
    )
  kind = full.get("rope_type", full.get("type", "default"))
  if kind == "default":
    return float(theta), float(local_theta), None
  if kind != "linear":
    raise ValueError(
      f"hf config rope_parameters.full_attention rope type {kind!r} is not supported; "
      "allowed: default, linear"
    )
  if "factor" not in full:
    raise ValueError("hf config rope_parameters.full_attention (linear) is missing 'factor'")
  try:
    scaling = RopeScaling(kind="linear", factor=float(full["factor"]))
  except ValueError as e:
    raise ValueError(f"hf config rope_parameters.full_attention: {e}") from e
  return float(theta), float(local_theta), scaling


def _gemma_only_fields(cfg: ModelConfig) -> list[str]:
  """The Gemma-3-only options `cfg` sets, as `model.<field>=<value>` strings."""
  values = dict(
    post_norms=cfg.post_norms,
    scale_embeddings=cfg.scale_embeddings,
    sliding_window=cfg.sliding_window,
    rope_local_theta=cfg.rope_local_theta,
    query_pre_attn_scalar=cfg.query_pre_attn_scalar,
    final_logit_softcap=cfg.final_logit_softcap,
    attn_logit_softcap=cfg.attn_logit_softcap,
  )
  out = [f"model.{k}={v!r}" for k, v in values.items() if v not in (None, False)]
  if cfg.mlp_activation != "silu":
    out.append(f"model.mlp_activation={cfg.mlp_activation!r}")
  return out


def _check_gemma3(cfg: ModelConfig) -> str:
  """'gemma3_text' if `cfg` is expressible as a transformers Gemma3 config, else a named error."""
  want = dict(
    post_norms=True, scale_embeddings=True, qk_norm=True, qkv_bias=False, mlp_activation="gelu_tanh"
  )
  for name, value in want.items():
    if getattr(cfg, name) != value:
      raise ValueError(
        f"model.{name}={getattr(cfg, name)!r} does not fit gemma3_text (the only HF family with "
        f"model.zero_centered_norms=True), which needs {value!r}"
      )
  if getattr(cfg, "num_experts", 0):
    raise ValueError(f"model.num_experts={cfg.num_experts} does not fit gemma3_text (dense)")
  if cfg.attn_logit_softcap is not None:
    raise ValueError(
      f"model.attn_logit_softcap={cfg.attn_logit_softcap} has no gemma3_text equivalent "
      "(transformers' Gemma3 ignores attn_logit_softcapping)"
    )
  if cfg.rope_scaling is not None and cfg.rope_scaling.kind != "linear":
    raise ValueError(
      f"model.rope_scaling.kind={cfg.rope_scaling.kind!r} does not fit gemma3_text; allowed: linear"
    )
  return "gemma3_text"


def _gemma3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling is not None:
    full.update(rope_type="linear", factor=cfg.rope_scaling.factor)
  local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
  # HF scales scores by query_pre_attn_scalar**-0.5; head_dim gives jaxrl's default scale.
  scalar = cfg.query_pre_attn_scalar or cfg.head_dim
  layer_types = cfg.layer_types or ("full_attention",) * cfg.num_layers
  return {
    "architectures": [_ARCHITECTURES["gemma3_text"]],
    "model_type": "gemma3_text",
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.embed_dim,
    "intermediate_size": cfg.mlp_dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_activation": _GEMMA3_ACTIVATION,
    "max_position_embeddings": cfg.max_seq_len,
    "rms_norm_eps": cfg.norm_eps,
    "tie_word_embeddings": cfg.tie_embeddings,
    "rope_parameters": {"full_attention": full, "sliding_attention": local},
    # transformers' config class types this as int and checks it.
    "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
    "layer_types": list(layer_types),
    # Some positive window is required by the config class even where no layer slides.
    "sliding_window": cfg.sliding_window or cfg.max_seq_len,
    "final_logit_softcapping": cfg.final_logit_softcap,
    "attn_logit_softcapping": None,
    "attention_bias": False,
    "use_bidirectional_attention": False,
    "dtype": cfg.param_dtype,
  }


def infer_model_type(cfg: ModelConfig) -> str:
  """The HF family whose architecture `cfg` describes."""
  if cfg.zero_centered_norms:
    return _check_gemma3(cfg)
  gemma_only = _gemma_only_fields(cfg)
  if gemma_only:
    raise ValueError(
      f"{', '.join(gemma_only)} need the Gemma 3 layout (model.zero_centered_norms=True): "
      "no other HF family has them"
    )
  if cfg.qk_norm and cfg.qkv_bias:
    raise ValueError("model.qk_norm and model.qkv_bias together match no HF family (qwen3/qwen2)")
  if cfg.num_experts:
    if cfg.qkv_bias:
      raise ValueError("model.qkv_bias with model.num_experts > 0 matches no HF family")
    return "qwen3_moe" if cfg.qk_norm else "mixtral"
  return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def config_to_hf(cfg: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
  """The config.json dict (transformers >= 5 layout) for `cfg`."""
  model_type = model_type or infer_model_type(cfg)
  if model_type not in FAMILIES:
    raise ValueError(f"model_type={model_type!r} is not supported; allowed: {FAMILIES}")
  if infer_model_type(cfg) != model_type:
    raise ValueError(
      f"model_type={model_type!r} does not match the config (qk_norm={cfg.qk_norm}, "
      f"qkv_bias={cfg.qkv_bias}, num_experts={cfg.num_experts}), which is "
      f"{infer_model_type(cfg)!r}"
    )
  if model_type == "gemma3_text":
    return _gemma3_to_hf(cfg)
  if model_type == "mixtral" and not cfg.norm_topk_prob:
    raise ValueError("model.norm_topk_prob=False has no mixtral equivalent (it renormalises)")
  rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    rope.update(
      rope_type=s.kind,
      factor=s.factor,
      low_freq_factor=s.low_freq_factor,
      high_freq_factor=s.high_freq_factor,
      original_max_position_embeddings=s.original_max_position,
    )
  out = {
    "architectures": [_ARCHITECTURES[model_type]],
    "model_type": model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.embed_dim,
    "intermediate_size": cfg.mlp_dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_seq_len,
    "rms_norm_eps": cfg.norm_eps,
    "tie_word_embeddings": cfg.tie_embeddings,
    "rope_parameters": rope,
    "dtype": cfg.param_dtype,
  }
  if model_type == "qwen2":
    out["use_sliding_window"] = False
  else:
    out["attention_bias"] = False
  if model_type == "llama":
    out["mlp_bias"] = False
  if model_type == "qwen3_moe":
    out.update(
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.experts_per_token,
      moe_intermediate_size=cfg.moe_mlp_dim,
      norm_topk_prob=cfg.norm_topk_prob,
      decoder_sparse_step=1,
      mlp_only_layers=[],
      use_sliding_window=False,
    )
  if model_type == "mixtral":
    del out["attention_bias"]
    out.update(
      intermediate_size=cfg.moe_mlp_dim,
      num_local_experts=cfg.num_experts,
      num_experts_per_tok=cfg.experts_per_token,
      sliding_window=None,
    )
  return out


# --------------------------------------------------------------------------------------- weights


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  if kind == COPY:
    return shape
  if kind == FLAT:
    return (math.prod(shape),)
  n = _LINEAR_IN_DIMS[kind]
  return (math.prod(shape[n:]), math.prod(shape[:n]))


def _to_jaxrl(kind: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  return w if kind == COPY else w.reshape(shape) if kind == FLAT else w.T.reshape(shape)


def _to_hf(kind: str, x: np.ndarray) -> np.ndarray:
  if kind == COPY:
    return x
  if kind == FLAT:
    return x.reshape(-1)
  n = _LINEAR_IN_DIMS[kind]
  return np.ascontiguousarray(x.reshape(math.prod(x.shape[:n]), -1).T)


def weight_plan(
  cfg: ModelConfig, params: nnx.State, weight_map: tuple[WeightRule, ...]
) -> dict[str, tuple[str, str, int | None]]:
  """HF tensor name -> (jaxrl param path, transform, expert) for every param of the model.

  `expert` is None, or the index into the param's leading expert axis that an {e} rule's tensor
  fills. Rules whose param the model lacks (`lm_head` when tied) are dropped; a param no rule
  covers is an error in the table, so it raises. LoRA adapters are not HF tensors: skipped.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
  paths = {path_str(p) for p, v in leaves if not isinstance(v, nnx.LoRAParam)}
  plan = {}
  for hf_name, path, kind in weight_map:
    layers = range(cfg.num_layers) if "{i}" in hf_name else [None]
    experts = range(cfg.num_experts) if "{e}" in hf_name else [None]
    for i in layers:
      target = path.format(i=i)
      if target in paths:
        for e in experts:
          plan[hf_name.format(i=i, e=e)] = (target, kind, e)
  uncovered = paths - {target for target, _, _ in plan.values()}
  if uncovered:
    raise ValueError(f"no HF weight rule for params {sorted(uncovered)}")
  return plan


def _checkpoint_files(path: Path) -> dict[str, str]:
  """HF tensor name -> the safetensors file that holds it."""
  if (path / _INDEX).exists():
    weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
    return {name: str(path / file) for name, file in weight_map.items()}
  if (path / _SINGLE).exists():
    with safe_open(path / _SINGLE, framework="numpy") as f:
      return {name: str(path / _SINGLE) for name in f.keys()}
  raise FileNotFoundError(f"{path} holds neither {_SINGLE} nor {_INDEX}")


def _names(names) -> str:
  names = sorted(names)
  return ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")


def load_hf_checkpoint(
  path: str | os.PathLike,
  *,
  mesh: jax.sharding.Mesh | None = None,
  rules: Rules | str | None = None,
  dtype: str | None = None,
  lora: Mapping[str, Any] | None = None,
  lora_seed: int = 0,
  execution: Mapping[str, Any] | None = None,
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
  """Reads an HF checkpoint directory (config.json + safetensors, single or sharded).

  With `mesh` and `rules` each tensor goes straight to its own sharding as it is read, so the
  whole model never sits on one device. `dtype` overrides the checkpoint's param/compute dtype.
  `lora` ({"lora_rank": r, "lora_alpha": ..., "lora_targets": ...}, ModelConfig fields) adds
  fresh adapters to the loaded base: A drawn from `lora_seed`, B zero, so logits are the base's.
  `execution` ({"scan_layers": ..., "remat": ..., and the kernel choices of
  `jaxrl.kernels.KERNELS` with "kernel_interpret"}) sets how the forward runs; the params are the
  same either way.
  """
  path = Path(path)
  if (mesh is None) != (rules is None):
    raise ValueError("load_hf_checkpoint needs both mesh= and rules=, or neither")
  hf_config = json.loads((path / "config.json").read_text())
  cfg = config_from_hf(hf_config)
  if dtype is not None:
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
  if lora:
    bad = sorted(set(lora) - {"lora_rank", "lora_alpha", "lora_targets"})
    if bad:
      raise ValueError(
        f"load_hf_checkpoint lora= has {bad}; allowed: lora_rank, lora_alpha, lora_targets"
      )
    cfg = cfg.replace(**lora)
  if execution:
    allowed = ("scan_layers", "remat", *KERNELS, "kernel_interpret")
    bad = sorted(set(execution) - set(allowed))
    if bad:
      raise ValueError(f"load_hf_checkpoint execution= has {bad}; allowed: {allowed}")
    cfg = cfg.replace(**execution)
  model_type = hf_config["model_type"]
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  plan = weight_plan(cfg, abstract, WEIGHT_MAPS[model_type])
  files = _checkpoint_files(path)
  present = set(files)
  if cfg.tie_embeddings:
    # Some exporters also write the tied head; it is the embedding again, so skip it.
    present.discard("lm_head.weight")
  missing, unexpected = set(plan) - present, present - set(plan)
  if missing:
    raise ValueError(f"checkpoint {path} is missing tensors: {_names(missing)}")
  if unexpected:
    raise ValueError(f"checkpoint {path} has unexpected tensors: {_names(unexpected)}")

  leaves = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=_is_variable)[0]
  targets = {path_str(p): v for p, v in leaves}
  shardings = {}
  if mesh is not None:
    sharded = param_shardings(abstract, mesh, rules)
    for p, v in jax.tree_util.tree_flatten_with_path(sharded, is_leaf=_is_variable)[0]:
      shardings[path_str(p)] = v.get_value()
  loaded = {}
  # Per-expert tensors fill a host buffer that goes to its devices once its last expert is read.
  stacks: dict[str, np.ndarray] = {}
  pending = collections.Counter(target for target, _, e in plan.values() if e is not None)
  by_file: dict[str, list[str]] = {}
  for name in plan:
    by_file.setdefault(files[name], []).append(name)
  for file, names in by_file.items():
    with safe_open(file, framework="numpy") as f:
      for name in names:
        target, kind, expert = plan[name]
        var = targets[target]
        shape = tuple(var.get_value().shape)
        slot = shape if expert is None else shape[1:]
        w = f.get_tensor(name)
        if w.shape != _hf_shape(kind, slot):
          where = "" if expert is None else f" (expert {expert})"
          raise ValueError(
            f"checkpoint tensor {name} has shape {w.shape}; expected {_hf_shape(kind, slot)} "
            f"for jaxrl param {target} {shape}{where}"
          )
        x = _to_jaxrl(kind, w, slot).astype(var.get_value().dtype)
        if expert is not None:
          stacks.setdefault(target, np.empty(shape, x.dtype))[expert] = x
          pending[target] -= 1
          if pending[target]:
            continue
          x = stacks.pop(target)
        loaded[target] = jax.device_put(x, shardings.get(target))
  if cfg.lora_rank:
    loaded.update(_init_adapters(cfg, lora_seed, shardings))
  params = jax.tree_util.tree_map_with_path(
    lambda p, v: v.replace(value=loaded[path_str(p)]), abstract, is_leaf=_is_variable
  )
  return cfg, graphdef, params


def _init_adapters(cfg: ModelConfig, seed: int, shardings) -> dict[str, jax.Array]:
  """Freshly initialised LoRA params, by path, each on its sharding (if any)."""

  def init():
    return nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=seed)), nnx.LoRAParam)

  # One jitted init: the base weights it would also draw are not outputs, so XLA drops them.
  abstract = jax.eval_shape(init)
  paths = [
    path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract, is_leaf=_is_variable)[0]
  ]
  out_shardings = None
  if shardings:
    out_shardings = jax.tree_util.tree_unflatten(
      jax.tree.structure(abstract), [shardings[p] for p in paths]
    )
  adapters = jax.jit(init, out_shardings=out_shardings)()
  return dict(zip(paths, jax.tree.leaves(adapters), strict=True))


def to_hf_state_dict(
  cfg: ModelConfig, params: nnx.State, model_type: str | None = None
) -> dict[str, np.ndarray]:
  """HF tensor name -> numpy array in HF layout, gathered to host (LoRA merged into the base)."""
  cfg, params = merge_lora(cfg, params)
  model_type = config_to_hf(cfg, model_type)["model_type"]
  values = {
    path_str(p): v.get_value()
    for p, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
  }
  plan = weight_plan(cfg, params, WEIGHT_MAPS[model_type])
  host: dict[str, np.ndarray] = {}  # each param gathered once, however many experts it holds
  out = {}
  for name, (target, kind, expert) in plan.items():
    if target not in host:
      host[target] = np.asarray(jax.device_get(values[target]))
    out[name] = _to_hf(kind, host[target] if expert is None else host[target][expert])
  return out


def export_hf_checkpoint(
  cfg: ModelConfig,
  params: nnx.State,
  out_dir: str | os.PathLike,
  *,
  model_type: str | None = None,
  max_shard_bytes: int = 4 * 2**30,
) -> None:
  """Writes config.json and safetensors that `transformers` loads (sharded above the threshold).

  A LoRA model is merged first (`jaxrl.models.lora.merge_lora`): the checkpoint is the plain
  model W + (alpha / r) A B, loadable anywhere without adapter support.
  Everything is written to a temporary directory first, so a failure leaves `out_dir` untouched.
  """
  if max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0")
  cfg, params = merge_lora(cfg, params)
  hf_config = config_to_hf(cfg, model_type)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, w in to_hf_state_dict(cfg, params, hf_config["model_type"]).items():
    if shards[-1] and size + w.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = w
    size += w.nbytes
  out_dir = Path(out_dir)
  out_dir.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
    tmp = Path(tmp)
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if len(shards) == 1:
      save_file(shards[0], tmp / _SINGLE, metadata={"format": "pt"})
    else:
      weight_map, total = {}, 0
      for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, tmp / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        total += sum(w.nbytes for w in shard.values())
      index = {"metadata": {"total_size": total}, "weight_map": weight_map}
      (tmp / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    out_dir.mkdir(exist_ok=True)
    # Drop weights of an earlier export so a stale file cannot shadow (or mix with) this one.
    for old in out_dir.glob("model*.safetensors*"):
      old.unlink()
    for file in tmp.iterdir():
      shutil.move(str(file), out_dir / file.name)
