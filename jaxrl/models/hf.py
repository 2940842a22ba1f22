"""HF transformers interop: a weight-name table per family and safetensors I/O (load straight into
shardings, export); the config translation is `jaxrl.models.hf_config`, re-exported here."""

from __future__ import annotations

import collections
import contextlib
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
from jaxrl.models.config import ModelConfig
from jaxrl.models.hf_config import (  # noqa: F401  (the module's public API before the split)
  FAMILIES,
  config_from_hf,
  config_to_hf,
  infer_model_type,
)
from jaxrl.models.lora import merge_lora
from jaxrl.models.transformer import Transformer

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


def _span(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
  """The [start, stop) range of C-order flat positions that the box `index` of an array of
  `shape` covers, when it is one contiguous range (leading dims of extent 1, then one partial
  dim, then whole dims); None otherwise."""
  bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
  extents = [b - a for a, b in bounds]
  partial = [i for i, (e, n) in enumerate(zip(extents, shape, strict=True)) if e != n]
  if partial and any(e != 1 for e in extents[: partial[-1]]):
    return None
  strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
  start = sum(a * st for (a, _), st in zip(bounds, strides, strict=True))
  return start, start + math.prod(extents)


def read_block(kind: str, lazy, slot: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
  """The block `index` of a jaxrl param of shape `slot`, read from its HF tensor through
  safetensors' lazy slice `lazy`: only the HF rows and columns (or the bias range) under that
  block, when they form one rectangle (every sharding of the rules tables); else the whole
  tensor, then cut."""
  block = tuple(b - a for a, b in (s.indices(n)[:2] for s, n in zip(index, slot, strict=True)))
  if kind == COPY:
    return lazy[index]
  if kind == FLAT:
    span = _span(index, slot)
    if span is not None:
      return lazy[span[0] : span[1]].reshape(block)
  else:
    n = _LINEAR_IN_DIMS[kind]
    cols, rows = _span(index[:n], slot[:n]), _span(index[n:], slot[n:])
    if cols is not None and rows is not None:
      return lazy[rows[0] : rows[1], cols[0] : cols[1]].T.reshape(block)
  return _to_jaxrl(kind, lazy[:], slot)[index]


def _put_param(shape, dtype, sharding, sources) -> jax.Array:
  """One param on `sharding` (None: the default device), each device's block read from its HF
  tensor(s) on its own (a process reads only its devices' blocks; devices holding the same block
  share one read). `sources`: {expert or None: (name, file, kind, lazy slice)}."""

  def block(index):
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    try:
      if None in sources:
        _, _, kind, lazy = sources[None]
        x = read_block(kind, lazy, shape, index)
      else:  # per-expert tensors stacked on the leading axis
        parts = []
        for e in range(*index[0].indices(shape[0])):
          _, _, kind, lazy = sources[e]
          parts.append(read_block(kind, lazy, shape[1:], index[1:]))
        x = np.stack(parts)
    except Exception as err:
      name, file = next(iter(sources.values()))[:2]
      raise CheckpointFileError(f"cannot read tensor {name} from {file}: {err}") from err
    return np.asarray(x).astype(dtype)

  if sharding is None:
    return jax.device_put(block(()))
  cache: dict[tuple, np.ndarray] = {}

  def cached(index):
    key = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=False))
    if key not in cache:
      cache[key] = block(index)
    return cache[key]

  return jax.make_array_from_callback(shape, sharding, cached)


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


class CheckpointFileError(ValueError):
  """A safetensors file of an HF checkpoint cannot be read (truncated, corrupt, not one)."""


def _safe_open(file):
  try:
    return safe_open(file, framework="numpy")
  except Exception as e:
    raise CheckpointFileError(
      f"cannot read safetensors file {file}: {e} (truncated or not a safetensors file?)"
    ) from e


def _checkpoint_files(path: Path) -> dict[str, str]:
  """HF tensor name -> the safetensors file that holds it."""
  if (path / _INDEX).exists():
    weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
    return {name: str(path / file) for name, file in weight_map.items()}
  if (path / _SINGLE).exists():
    with _safe_open(path / _SINGLE) as f:
      return {name: str(path / _SINGLE) for name in f.keys()}
  raise FileNotFoundError(f"{path} holds neither {_SINGLE} nor {_INDEX}")


def _names(names) -> str:
  names = sorted(names)
  return ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")


def hf_model_config(
  path: str | os.PathLike,
  *,
  dtype: str | None = None,
  param_dtype: str | None = None,
  lora: Mapping[str, Any] | None = None,
  execution: Mapping[str, Any] | None = None,
) -> ModelConfig:
  """The ModelConfig `load_hf_checkpoint(path, dtype=, param_dtype=, lora=, execution=)` builds,
  from config.json alone: no tensor is read, so a run can check it before loading any weight."""
  return _read_config(
    Path(path), dtype=dtype, param_dtype=param_dtype, lora=lora, execution=execution
  )[0]


def _read_config(
  path: Path, *, dtype, param_dtype=None, lora, execution
) -> tuple[ModelConfig, dict]:
  try:
    hf_config = json.loads((path / "config.json").read_text())
  except FileNotFoundError as e:
    raise CheckpointFileError(f"{path} is not an HF checkpoint directory: no config.json") from e
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointFileError(f"{path / 'config.json'} is not valid JSON: {e}") from e
  cfg = config_from_hf(hf_config)
  if dtype is not None:
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
  if param_dtype is not None:
    cfg = cfg.replace(param_dtype=param_dtype)
  if lora:
    bad = sorted(set(lora) - {"lora_rank", "lora_alpha", "lora_targets"})
    if bad:
      raise ValueError(
        f"load_hf_checkpoint lora= has {bad}; allowed: lora_rank, lora_alpha, lora_targets"
      )
    cfg = cfg.replace(**lora)
  if execution:
    allowed = ("scan_layers", "remat", "logits_chunk", *KERNELS, "kernel_interpret")
    bad = sorted(set(execution) - set(allowed))
    if bad:
      raise ValueError(f"load_hf_checkpoint execution= has {bad}; allowed: {allowed}")
    cfg = cfg.replace(**execution)
  return cfg, hf_config


def load_hf_checkpoint(
  path: str | os.PathLike,
  *,
  mesh: jax.sharding.Mesh | None = None,
  rules: Rules | str | None = None,
  dtype: str | None = None,
  param_dtype: str | None = None,
  lora: Mapping[str, Any] | None = None,
  lora_seed: int = 0,
  execution: Mapping[str, Any] | None = None,
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
  """Reads an HF checkpoint directory (config.json + safetensors, single or sharded).

  With `mesh` and `rules` each device's block of a param is read from the file on its own
  (`jax.make_array_from_callback`; only the HF rows and columns under it, `read_block`), so no
  device, and no process of a multi-process run, holds or reads more of the model than its
  devices keep. `dtype` overrides the checkpoint's compute and storage dtype alike;
  `param_dtype` then sets the storage alone: dtype="bfloat16", param_dtype="float32" reads a
  bfloat16 checkpoint into float32 master weights that compute in bfloat16.
  `lora` ({"lora_rank": r, "lora_alpha": ..., "lora_targets": ...}, ModelConfig fields) adds
  fresh adapters to the loaded base: A drawn from `lora_seed`, B zero, so logits are the base's.
  `execution` ({"scan_layers": ..., "remat": ..., "logits_chunk": ..., and the kernel choices of
  `jaxrl.kernels.KERNELS` with "kernel_interpret"}) sets how the forward runs; the params are the
  same either way.
  """
  path = Path(path)
  if (mesh is None) != (rules is None):
    raise ValueError("load_hf_checkpoint needs both mesh= and rules=, or neither")
  cfg, hf_config = _read_config(
    path, dtype=dtype, param_dtype=param_dtype, lora=lora, execution=execution
  )
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
  # target param -> its tensors: [(expert or None, HF name)], experts in order
  tensors: dict[str, list[tuple[int | None, str]]] = collections.defaultdict(list)
  for name, (target, _, expert) in plan.items():
    tensors[target].append((expert, name))
  loaded = {}
  with contextlib.ExitStack() as stack:
    opened = {file: stack.enter_context(_safe_open(file)) for file in sorted(set(files.values()))}
    for target, entries in tensors.items():
      var = targets[target]
      shape, dtype = tuple(var.get_value().shape), var.get_value().dtype
      sources = {}
      for expert, name in sorted(entries, key=lambda e: -1 if e[0] is None else e[0]):
        kind = plan[name][1]
        slot = shape if expert is None else shape[1:]
        try:
          lazy = opened[files[name]].get_slice(name)
          hf_shape = tuple(lazy.get_shape())
        except Exception as e:
          raise CheckpointFileError(f"cannot read tensor {name} from {files[name]}: {e}") from e
        if hf_shape != _hf_shape(kind, slot):
          where = "" if expert is None else f" (expert {expert})"
          raise ValueError(
            f"checkpoint tensor {name} has shape {hf_shape}; expected {_hf_shape(kind, slot)} "
            f"for jaxrl param {target} {shape}{where}"
          )
        sources[expert] = (name, files[name], kind, lazy)
      loaded[target] = _put_param(shape, dtype, shardings.get(target), sources)
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
