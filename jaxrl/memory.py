"""What a run holds per device, estimated before any weight exists, and the device's budget.

`estimate(cfg, model_cfg, mesh, rules)` counts, per device, from the model's abstract shapes and
the mesh's shardings: the params (model.param_dtype), their gradient (float32 accumulators, plus
one micro-batch's in the param dtype when there are several), AdamW's two moments, the frozen
copies a run keeps (the KL reference, the sampler's compute-dtype copy, a PPO critic with its
own gradient and moments, a distillation teacher), one learner micro-batch's activations (as
model.remat keeps them, and the [tokens x vocab] logits unless model.logits_chunk bounds them)
and the engine's KV pages. The activation terms are a model of what XLA keeps, not a
measurement; the run records its measured peak beside the estimate (summary.json "memory").

`device_budget(cfg)` is memory.device_gb, or what the device reports: an accelerator's
`memory_stats()["bytes_limit"]`; a CPU's share of the host's available memory.
"""

from __future__ import annotations

import dataclasses
import math
import resource

import jax
import numpy as np
from flax import nnx

from jaxrl.config import Config, ConfigError
from jaxrl.mesh import param_shardings
from jaxrl.models.config import ModelConfig
from jaxrl.rollout.kv_cache import pages_for

GiB = 2**30
# Log-softmax over the logits on the backward pass keeps about three [tokens, V] float32
# buffers live at once (the logits, their log-softmax, the cotangent).
_LOGIT_BUFFERS = 3


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per device of each part (insertion order is the table's), the budget (None: unknown),
  and the KV pages the estimate counted."""

  parts: dict[str, int]
  budget: int | None
  kv_pages: int
  notes: dict[str, str] = dataclasses.field(default_factory=dict)

  @property
  def total(self) -> int:
    return sum(self.parts.values())

  @property
  def fits(self) -> bool:
    return self.budget is None or self.total <= self.budget

  def table(self) -> str:
    rows = []
    for name, b in self.parts.items():
      rows.append(f"  {name:<22} {_gib(b):>10}  {self.notes.get(name, '')}".rstrip())
    budget = "unknown" if self.budget is None else _gib(self.budget)
    rows.append(f"  {'total':<22} {_gib(self.total):>10}  of {budget} per device")
    return "\n".join(rows)

  def as_dict(self) -> dict:
    return {"parts": dict(self.parts), "total": self.total, "budget": self.budget}


def _gib(b: int) -> str:
  for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
    if b >= size:
      return f"{b / size:.2f} {unit}"
  return f"{b} B"


def device_budget(cfg: Config, devices=None) -> int | None:
  """Bytes a device of this run may use: memory.device_gb, else the device's own limit."""
  if cfg.memory.device_gb:
    return int(cfg.memory.device_gb * GiB)
  devices = jax.local_devices() if devices is None else devices
  local = [d for d in devices if d.process_index == jax.process_index()] or devices
  if local[0].platform == "cpu":  # the run's devices of this process share the host's memory
    avail = _meminfo("MemAvailable")
    return None if avail is None else avail // len(local)
  stats = local[0].memory_stats()
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  return None


def _meminfo(field: str) -> int | None:
  try:
    for line in open("/proc/meminfo").read().splitlines():
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def peak_bytes() -> dict:
  """The measured peak so far: the process's RSS on a CPU, each local accelerator's
  peak_bytes_in_use (the largest) elsewhere."""
  out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
  peaks = []
  for d in jax.local_devices():
    stats = d.memory_stats() if d.platform != "cpu" else None
    if stats and "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  if peaks:
    out["peak_device_bytes"] = max(peaks)
  return out


def _per_device(model_cfg: ModelConfig, mesh, rules) -> tuple[dict, dict]:
  """{path: (elements on one device, ndim)} of the model's params, and of its LoRA adapters."""
  from jaxrl.models.transformer import Transformer

  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
  shardings = param_shardings(abstract, mesh, rules)
  sizes, lora = {}, {}
  flat_s = dict(nnx.to_flat_state(shardings))
  for path, var in nnx.to_flat_state(abstract):
    value = var.get_value()
    sharding = flat_s[path].get_value()
    shape = sharding.shard_shape(value.shape) if hasattr(sharding, "shard_shape") else value.shape
    entry = (int(np.prod(shape)), value.ndim)
    (lora if isinstance(var, nnx.LoRAParam) else sizes)[path] = entry
  return sizes, lora


def _batch_shards(mesh, rules) -> int:
  """Devices a batch's rows are split over: the product of the mesh axes "batch" maps to."""
  from jaxrl.mesh import named_sharding

  axes = named_sharding(mesh, ("batch",), rules).spec[0]
  if axes is None:
    return 1
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def _activations(model_cfg: ModelConfig, tokens: int, length: int) -> int:
  """One micro-batch's activations kept for the backward pass, on one device: `tokens` rows x
  positions, sequences of `length`. Per block and token, in the compute dtype: the residual
  stream, norms and projections (q, k, v, attention output, gate, up, their product), plus the
  attention's float32 scores and probabilities over `length` keys; with remat 'full' (or the
  policy that keeps only weight-shaped products) each block keeps its input and one block's
  working set is remade at a time; with 'dots_saveable' the matmul outputs are kept."""
  m, item = model_cfg, np.dtype(model_cfg.dtype).itemsize
  d, f, h = m.embed_dim, (m.moe_mlp_dim * m.experts_per_token or m.mlp_dim), m.head_dim
  n, k = m.num_heads, m.num_kv_heads
  proj = 6 * d + 2 * n * h + 2 * k * h + 4 * f
  scores = 2 * n * length * 4 // item  # in units of the compute dtype
  block = tokens * (proj + scores) * item
  if m.remat == "none":
    return m.num_layers * block
  if m.remat == "dots_saveable":
    dots = tokens * (2 * n * h + 2 * k * h + 2 * d + 2 * f + n * length) * item
    return m.num_layers * dots + block
  return m.num_layers * tokens * d * item + block


def estimate(
  cfg: Config, model_cfg: ModelConfig, mesh, rules, *, teacher_cfg=None
) -> MemoryEstimate:
  """The per-device estimate of a run (see the module docstring), with the budget and, under
  rl.rollout.kv_fraction, the KV pages sized from it."""
  rl, ro = cfg.rl, cfg.rl.rollout
  sizes, lora = _per_device(model_cfg, mesh, rules)
  p_item = np.dtype(model_cfg.param_dtype).itemsize
  c_item = np.dtype(model_cfg.dtype).itemsize
  elements = sum(n for n, _ in sizes.values()) + sum(n for n, _ in lora.values())
  trained = sum(n for n, _ in lora.values()) if lora else elements
  matrices = sum(n for n, nd in sizes.values() if nd >= 2)
  parts, notes = {}, {}
  parts["params"] = elements * p_item
  notes["params"] = f"{model_cfg.param_dtype}, {_count(elements)} per device"
  micro = max(rl.num_microbatches, cfg.sft.num_microbatches if cfg.sft.steps else 1)
  parts["gradients"] = trained * 4 + (trained * p_item if micro > 1 else 0)
  parts["optimizer"] = 2 * trained * p_item
  notes["optimizer"] = "AdamW's two moments" + (" (LoRA adapters)" if lora else "")
  # Inside the update: the float32 update, and one new tree beside the old params and moments
  # (a non-finite update keeps the old ones). XLA's memory analysis of a Qwen3-0.6B step in
  # float32 masters: 8.9 GiB of temporaries = gradients + these two trees + logits + the rest.
  parts["update"] = trained * 4 + trained * p_item
  notes["update"] = "the update, and a new tree beside the old"
  if cfg.checkpoint.async_save:
    parts["checkpoint copy"] = elements * p_item + 2 * trained * p_item
    notes["checkpoint copy"] = "host copy of the state while it is written (async_save)"
  cast = model_cfg.param_dtype != model_cfg.dtype
  if rl.kl.beta > 0:
    if lora:
      parts["reference"] = sum(n for n, _ in lora.values()) * (c_item if cast else p_item)
    else:
      parts["reference"] = matrices * (c_item if cast else p_item) + (elements - matrices) * p_item
  if cast or ro.quantize != "none":
    per = 1 if ro.quantize != "none" else c_item
    parts["sampler copy"] = matrices * per
    notes["sampler copy"] = (
      "quantized" if ro.quantize != "none" else f"matrices in {model_cfg.dtype}"
    )
  if rl.advantage == "gae":
    parts["critic"] = elements * p_item + trained * 4 + 2 * trained * p_item
  if teacher_cfg is not None:
    t_sizes, _ = _per_device(teacher_cfg, mesh, rules)
    parts["teacher"] = (
      sum(n for n, _ in t_sizes.values()) * np.dtype(teacher_cfg.param_dtype).itemsize
    )
  # One learner micro-batch on one device: RL's, or the warm-start's when larger.
  length = rl.max_prompt_len + rl.max_new_tokens
  shards = _batch_shards(mesh, rules)
  rows_dev = max(1, math.ceil(rl.prompts_per_step * rl.group_size / rl.num_microbatches / shards))
  if cfg.sft.steps:
    sft_rows = max(1, math.ceil(cfg.sft.batch_size / cfg.sft.num_microbatches / shards))
    rows_dev = max(rows_dev, sft_rows)
  tokens = rows_dev * length
  parts["activations"] = _activations(model_cfg, tokens, length)
  notes["activations"] = f"remat={model_cfg.remat}, {rows_dev} x {length} tokens per micro-batch"
  if model_cfg.remat != "none":
    plain = _activations(model_cfg.replace(remat="none"), tokens, length)
    notes["activations"] += f" (without remat: {_gib(plain)})"
  chunk = model_cfg.logits_chunk
  logit_tokens = min(chunk, tokens) if chunk else tokens
  parts["logits"] = _LOGIT_BUFFERS * logit_tokens * model_cfg.vocab_size * 4
  notes["logits"] = f"{logit_tokens} tokens x {model_cfg.vocab_size} float32" + (
    " (chunked)" if chunk else ""
  )
  # The engine: its slots' KV pages and one decode step's logits.
  groups = rl.prompts_per_step
  if rl.partial.enabled:
    groups = math.ceil(rl.partial.over_provision * rl.prompts_per_step)
  slots = ro.slots or max(groups * rl.group_size, cfg.eval.num_examples)
  per_seq = pages_for(length, ro.page_size)
  kv_item = 1 if ro.kv_dtype == "fp8" else c_item
  tensor = mesh.shape.get("tensor", 1)
  kv_heads = (
    max(1, model_cfg.num_kv_heads // tensor)
    if model_cfg.num_kv_heads % tensor == 0
    else model_cfg.num_kv_heads
  )
  page_bytes = ro.page_size * model_cfg.num_layers * 2 * kv_heads * model_cfg.head_dim * kv_item
  parts["engine logits"] = slots * model_cfg.vocab_size * 4
  budget = device_budget(cfg, list(mesh.devices.flat))
  wanted = slots * per_seq
  if ro.kv_fraction > 0:
    if budget is None:
      raise ConfigError(
        "config.rl.rollout.kv_fraction sizes the KV pages from the device's memory, which this "
        "device does not report; set memory.device_gb"
      )
    left = budget - sum(parts.values())
    kv_pages = min(wanted, int(ro.kv_fraction * max(left, 0)) // page_bytes)
    if kv_pages < per_seq:
      raise ConfigError(
        f"config.rl.rollout.kv_fraction={ro.kv_fraction} leaves {_gib(max(left, 0))} per device "
        f"for KV pages: {kv_pages} pages of {_gib(page_bytes)}, fewer than one sequence of "
        f"{length} tokens needs ({per_seq}); raise kv_fraction or memory.device_gb, or lower "
        "the learner's share (model.remat, model.logits_chunk, rl.num_microbatches)"
      )
    notes["kv pages"] = f"{kv_pages} pages from kv_fraction={ro.kv_fraction} (all slots: {wanted})"
  else:
    kv_pages = ro.num_pages or wanted
    notes["kv pages"] = f"{kv_pages} pages of {ro.page_size} tokens"
  parts["kv pages"] = kv_pages * page_bytes
  return MemoryEstimate(parts=parts, budget=budget, kv_pages=kv_pages, notes=notes)


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def check(est: MemoryEstimate) -> None:
  """A ConfigError naming every part and what to change, when the estimate exceeds the budget."""
  if est.fits:
    return
  raise ConfigError(
    f"this run needs an estimated {_gib(est.total)} per device, more than the "
    f"{_gib(est.budget)} it has (memory.device_gb, or the device's own):\n{est.table()}\n"
    "To fit: model.remat='full' (activations), model.logits_chunk (logits), more "
    "rl.num_microbatches, fewer rl.rollout.slots or rl.rollout.num_pages / kv_fraction (KV "
    "pages), model.lora_rank (gradients and optimizer), rl.kl.beta=0 (the reference), more "
    "devices over mesh.fsdp; memory.check=False runs it anyway"
  )
