"""HF transformers config translation: config.json <-> ModelConfig for each supported family
(Qwen3, Qwen2/2.5, Llama 3, Qwen3-MoE, Mixtral, Gemma 3 text), with the defaults each HF config
class assumes for keys a config.json leaves out. The weights' side is `jaxrl.models.hf`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.models.config import DTYPES, LAYER_TYPES, ModelConfig, RopeScaling, sliding_layer_types

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


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """A validated ModelConfig from an HF config.json dict (qwen3, qwen2 or llama). Its dtype and
  param_dtype are the checkpoint's own (a run's config.model.param_dtype, float32 by default,
  then keeps float32 master weights)."""
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
