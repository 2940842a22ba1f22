"""HF transformers interop: config translation, a weight-name table per family, safetensors I/O."""

from __future__ import annotations

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

from jaxrl.mesh import Rules, param_shardings
from jaxrl.models.config import _DTYPES, ModelConfig, RopeScaling
from jaxrl.models.transformer import Transformer

FAMILIES = ("qwen3", "qwen2", "llama")
_ARCHITECTURES = {
  "qwen3": "Qwen3ForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "llama": "LlamaForCausalLM",
}
# What each HF config class assumes when a key is absent from config.json.
_DEFAULT_MAX_POSITIONS = {"qwen3": 32_768, "qwen2": 32_768, "llama": 2048}
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

WEIGHT_MAPS: dict[str, tuple[WeightRule, ...]] = {
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
}

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


# ---------------------------------------------------------------------------------------- config


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """A validated ModelConfig from an HF config.json dict (qwen3, qwen2 or llama)."""
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise ValueError(f"hf config model_type={model_type!r} is not supported; allowed: {FAMILIES}")

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
  if dtype not in _DTYPES:
    raise ValueError(f"hf config dtype={dtype!r} is not supported; allowed: {_DTYPES}")
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
      qk_norm=model_type == "qwen3",
      qkv_bias=model_type == "qwen2",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      rope_scaling=rope_scaling,
      max_seq_len=max_positions,
      dtype=dtype,
      param_dtype=dtype,
    )
  except ValueError as e:
    raise ValueError(f"hf config ({model_type}) is inconsistent: {e}") from e


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


def infer_model_type(cfg: ModelConfig) -> str:
  """The HF family whose architecture `cfg` describes."""
  if cfg.qk_norm and cfg.qkv_bias:
    raise ValueError("model.qk_norm and model.qkv_bias together match no HF family (qwen3/qwen2)")
  return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def config_to_hf(cfg: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
  """The config.json dict (transformers >= 5 layout) for `cfg`."""
  model_type = model_type or infer_model_type(cfg)
  if model_type not in FAMILIES:
    raise ValueError(f"model_type={model_type!r} is not supported; allowed: {FAMILIES}")
  if infer_model_type(cfg) != model_type:
    raise ValueError(
      f"model_type={model_type!r} does not match the config (qk_norm={cfg.qk_norm}, "
      f"qkv_bias={cfg.qkv_bias}), which is {infer_model_type(cfg)!r}"
    )
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
  return out


# --------------------------------------------------------------------------------------- weights


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


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
) -> dict[str, tuple[str, str]]:
  """HF tensor name -> (jaxrl param path, transform) for every param of the model.

  Rules whose param the model lacks (`lm_head` when tied) are dropped; a param no rule covers is
  an error in the table, so it raises.
  """
  paths = {
    _path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
  }
  plan = {}
  for hf_name, path, kind in weight_map:
    layers = range(cfg.num_layers) if "{i}" in hf_name else [None]
    for i in layers:
      target = path.format(i=i)
      if target in paths:
        plan[hf_name.format(i=i)] = (target, kind)
  uncovered = paths - {target for target, _ in plan.values()}
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
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
  """Reads an HF checkpoint directory (config.json + safetensors, single or sharded).

  With `mesh` and `rules` each tensor goes straight to its own sharding as it is read, so the
  whole model never sits on one device. `dtype` overrides the checkpoint's param/compute dtype.
  """
  path = Path(path)
  if (mesh is None) != (rules is None):
    raise ValueError("load_hf_checkpoint needs both mesh= and rules=, or neither")
  hf_config = json.loads((path / "config.json").read_text())
  cfg = config_from_hf(hf_config)
  if dtype is not None:
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
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
  targets = {_path_str(p): v for p, v in leaves}
  shardings = {}
  if mesh is not None:
    sharded = param_shardings(abstract, mesh, rules)
    for p, v in jax.tree_util.tree_flatten_with_path(sharded, is_leaf=_is_variable)[0]:
      shardings[_path_str(p)] = v.get_value()
  loaded = {}
  by_file: dict[str, list[str]] = {}
  for name in plan:
    by_file.setdefault(files[name], []).append(name)
  for file, names in by_file.items():
    with safe_open(file, framework="numpy") as f:
      for name in names:
        target, kind = plan[name]
        var = targets[target]
        shape = tuple(var.get_value().shape)
        w = f.get_tensor(name)
        if w.shape != _hf_shape(kind, shape):
          raise ValueError(
            f"checkpoint tensor {name} has shape {w.shape}; expected {_hf_shape(kind, shape)} "
            f"for jaxrl param {target} {shape}"
          )
        x = _to_jaxrl(kind, w, shape).astype(var.get_value().dtype)
        loaded[target] = jax.device_put(x, shardings.get(target))
  params = jax.tree_util.tree_map_with_path(
    lambda p, v: v.replace(value=loaded[_path_str(p)]), abstract, is_leaf=_is_variable
  )
  return cfg, graphdef, params


def to_hf_state_dict(
  cfg: ModelConfig, params: nnx.State, model_type: str | None = None
) -> dict[str, np.ndarray]:
  """HF tensor name -> numpy array in HF layout, gathered to host."""
  model_type = config_to_hf(cfg, model_type)["model_type"]
  values = {
    _path_str(p): v.get_value()
    for p, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
  }
  plan = weight_plan(cfg, params, WEIGHT_MAPS[model_type])
  return {
    name: _to_hf(kind, np.asarray(jax.device_get(values[target])))
    for name, (target, kind) in plan.items()
  }


def export_hf_checkpoint(
  cfg: ModelConfig,
  params: nnx.State,
  out_dir: str | os.PathLike,
  *,
  model_type: str | None = None,
  max_shard_bytes: int = 4 * 2**30,
) -> None:
  """Writes config.json and safetensors that `transformers` loads (sharded above the threshold).

  Everything is written to a temporary directory first, so a failure leaves `out_dir` untouched.
  """
  if max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0")
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
