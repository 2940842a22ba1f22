"""What a few minutes on one GPU should measure, in one run: decode against the HBM
roofline and HF `generate`, a GRPO train step's MFU, peak memory, compile times, TRL beside it.

  bash bench/device_rehearsal.sh            # on the GPU machine (writes $OUT or bench/results/)
  bash bench/device_rehearsal.sh --smoke    # here: the same code path at toy shapes on a CPU

Phases, in order, each in its own child process under its own time budget (a phase that fails or
overruns is recorded with its error or as timed out, with what it had measured so far, and the
next one runs; a phase never holds device memory another needs):

  bandwidth  the device's copy bandwidth (device_kernels.bandwidth_case: the best of a bf16 and a
             float32 2 GiB array scaled, and a float32 sum; bytes read + written per second)
  decode     a Qwen3-1.7B-shaped model in bfloat16 (random weights, made on the device) decoded
             greedily by the rollout engine through its Driver at each batch size: B prompts of
             P tokens, B slots, exactly N new tokens per row (no EOS), the Pallas (Triton) paged
             attention on a GPU, the jnp reference elsewhere. Seconds per decode step = the
             difference of the medians of runs of N and N_short new tokens over N - N_short
             (prefill cancels); the step's bytes = every weight once + the KV cache of the live
             positions (mean over the measured steps); roofline fraction = bytes / step seconds /
             the bandwidth phase's bytes per second
  train      one GRPO train step as the learner builds it (PolicyLoss: PPO clip 0.2, k3 KL with
             beta 0.04, token-mean; AdamW; make_train_step) on P prompts x G samples x (prompt +
             new) tokens, float32 master weights, bfloat16 compute, remat="full", scanned
             layers; MFU = model FLOPs / step seconds / the device's dense bf16 peak, with
             model FLOPs = tokens x (6 x N_matmul + 12 x L x heads x head_dim x T) (Kaplan's 6N
             plus PaLM's attention term over the full T x T square; recomputation by remat not
             counted; `hfu` counts it)
  export     the decode phase's weights (same preset, seed and init program) written as an HF
             checkpoint (jaxrl.models.hf.export_hf_checkpoint)
  hf         HF transformers `generate` on that checkpoint: torch, bfloat16, CUDA when there is
             one, the same prompts, batch sizes and lengths, timed the same way; jaxrl / HF ratios
  trl        TRL's GRPOTrainer, one train step on the same checkpoint and batch shape
             (bench/_trl_grpo_peer.py: reference log-probs, loss, backward, clip, AdamW), bf16
             autocast over float32 weights with gradient checkpointing on CUDA; skipped, with
             the reason, where trl is not importable

Per phase: its wall time, the device's peak bytes in use and limit (`memory_stats()`; None on a
CPU, where the process's peak RSS stands in), and the compile seconds of its programs (trace,
lowering, XLA; from the first call, `_compile_log.CompileLog`) against the steady calls.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import importlib.util
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

from _common import num_cores, qwen3_shaped, versions, write_report  # noqa: E402

from jaxrl.models.config import ModelConfig  # noqa: E402

DEFAULT_OUT = BENCH_DIR / "results" / "device_rehearsal.json"
PHASES = ("bandwidth", "decode", "train", "export", "hf", "trl")
# Seconds per phase on the GPU (each capped by what is left of --deadline); the smoke's are
# bounds against a hang only.
BUDGETS = {"bandwidth": 40, "decode": 150, "train": 150, "export": 50, "hf": 90, "trl": 80}
SMOKE_BUDGET_S = 240
MIN_PHASE_S = 15  # a phase with less time left than this is skipped, not started
SEED = 0
PAGE_SIZE = 16
TRL_TAG = "@@trl-grpo "  # bench/_trl_grpo_peer.py's answer prefix
# Dense bf16 peak FLOP/s by device kind (first substring that matches; datasheet numbers,
# without sparsity). None elsewhere (a CPU): no MFU.
PEAK_BF16_FLOPS = (
  ("H200", 989e12),
  ("H100 PCIe", 756e12),
  ("H100 NVL", 835e12),
  ("H100", 989e12),
  ("A100", 312e12),
)
TARGETS = {"decode_roofline_fraction_b64": 0.60, "decode_jaxrl_over_hf_b64": 3.0, "train_mfu": 0.35}


@dataclasses.dataclass(frozen=True)
class Settings:
  """The shapes every phase runs at (written once by the parent, read by each phase)."""

  smoke: bool
  prompt_len: int  # P
  new_tokens: int  # N: the decode's long run, and the train step's completion length
  short_tokens: int  # the decode's short run (its difference to N is the timed decode)
  batches: tuple[int, ...]  # decode batch sizes (slots = rows)
  steps_per_call: int  # engine decode steps per device call
  reps: int  # timed decode / generate runs per length
  prompts: int  # train: prompts per step
  group_size: int  # train: samples per prompt
  train_microbatches: int  # 0: auto (see train_microbatches())
  train_reps: int
  scan_layers: bool
  logits_chunk: int  # used only where ModelConfig has the field
  bandwidth_mib: int
  torch_threads: int

  @classmethod
  def make(cls, smoke: bool, **overrides) -> Settings:
    if smoke:
      base = dict(
        prompt_len=8,
        new_tokens=64,
        short_tokens=8,
        batches=(4, 8),
        steps_per_call=4,
        reps=3,
        prompts=2,
        group_size=2,
        train_microbatches=2,
        train_reps=1,
        logits_chunk=8,
        bandwidth_mib=16,
        torch_threads=1,
      )
    else:
      base = dict(
        prompt_len=256,
        new_tokens=512,
        short_tokens=128,
        batches=(64, 256),
        steps_per_call=8,
        reps=2,
        prompts=8,
        group_size=8,
        train_microbatches=0,
        train_reps=3,
        logits_chunk=4096,
        bandwidth_mib=2048,
        torch_threads=num_cores(),
      )
    base.update({k: v for k, v in overrides.items() if v is not None})
    return cls(smoke=smoke, scan_layers=True, **base)

  def model(self) -> ModelConfig:
    """The decode / export model: Qwen3-1.7B's shape (a 2-layer Qwen3 for the smoke), bfloat16
    weights and compute (the train phase makes float32 masters of the same shape)."""
    cfg = qwen3_shaped(2, 64, 4, 2, 128) if self.smoke else ModelConfig.qwen3_1p7b()
    return cfg.replace(dtype="bfloat16", param_dtype="bfloat16", max_seq_len=self.table_length())

  def table_length(self) -> int:
    """The engine's page-table width in positions: P + N (the Triton kernel's blocks tile any
    page count, `jaxrl.kernels.paged_attention._gpu_blocks`)."""
    return self.prompt_len + self.new_tokens

  def prompt_tokens(self, rows: int) -> np.ndarray:
    """[rows, P] int32 token ids in [3, V) (no pad / bos / eos), the same in every phase."""
    rng = np.random.default_rng(SEED)
    return rng.integers(3, self.model().vocab_size, (rows, self.prompt_len), dtype=np.int32)


# ------------------------------------------------------------------------------------- measuring


class Record(dict):
  """A phase's results, rewritten to its file after every measurement: a phase cut short by
  its budget keeps what it had measured."""

  def __init__(self, path: Path):
    super().__init__()
    self.path = path

  def save(self) -> None:
    tmp = self.path.with_suffix(".tmp")
    tmp.write_text(json.dumps(self, indent=1, default=_jsonable) + "\n")
    tmp.replace(self.path)


def _jsonable(x):
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)


def device_info() -> dict:
  import jax

  dev = jax.devices()[0]
  return {
    "backend": jax.default_backend(),
    "device_kind": dev.device_kind,
    "devices": jax.device_count(),
    "platform_version": getattr(dev.client, "platform_version", None),
  }


def peak_flops(device_kind: str, backend: str) -> float | None:
  """The device's dense bf16 FLOP/s from PEAK_BF16_FLOPS, or None (a CPU, an unknown GPU)."""
  if backend == "cpu":
    return None
  return next((f for name, f in PEAK_BF16_FLOPS if name in device_kind), None)


def memory() -> dict:
  """The first device's peak and limit in bytes (None where it reports none: a CPU) and this
  process's peak resident set."""
  import jax

  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001  (a backend without memory stats)
    stats = {}
  return {
    "device_peak_bytes": stats.get("peak_bytes_in_use"),
    "device_bytes_limit": stats.get("bytes_limit"),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  }


def first_call(fn):
  """(fn()'s value, blocked until ready; its seconds; its compile log summary)."""
  import jax
  from _compile_log import CompileLog

  with CompileLog() as log:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    seconds = time.perf_counter() - t0
  return out, seconds, log.summary(top=4)


def step_seconds(long_s: float, short_s: float, n_long: int, n_short: int) -> tuple[float, str]:
  """Seconds per decode step from two whole calls: their difference over the extra steps, or,
  where noise makes that difference non-positive (a busy CPU at toy shapes), the long call over
  its steps (prefill included: an upper bound)."""
  diff = (long_s - short_s) / (n_long - n_short)
  if diff > 0:
    return diff, "difference"
  return long_s / n_long, "long_call_upper_bound"


# ----------------------------------------------------------------------------------------- phases


def phase_bandwidth(s: Settings, rec: Record, work: Path) -> None:
  from device_kernels import Run, bandwidth_case

  rec["device"] = device_info()
  run = Run(None, {})
  bw = bandwidth_case(run, s.bandwidth_mib, reps=3 if s.smoke else 10)
  row = run.rows[-1]
  if bw is None:
    raise RuntimeError(row.get("error", "copy bandwidth failed"))
  rec.update(bytes_per_s=bw, variants_bytes_per_s=row["variants_bytes_per_s"], mib=s.bandwidth_mib)


def phase_decode(s: Settings, rec: Record, work: Path) -> None:
  import jax

  from jaxrl.models.transformer import make_model

  rec["device"] = info = device_info()
  kernel = "pallas_gpu" if info["backend"] == "gpu" else "reference"
  cfg = s.model().replace(attention_kernel=kernel)
  (graphdef, params), init_s, init_log = first_call(lambda: make_model(cfg, seed=SEED))
  weight_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(params))
  bw_file = work / "bandwidth.json"
  bandwidth = json.loads(bw_file.read_text()).get("bytes_per_s") if bw_file.exists() else None
  rec.update(
    attention_kernel=kernel,
    init_s=init_s,
    init_compile=init_log,
    weight_bytes=weight_bytes,
    params=sum(x.size for x in jax.tree.leaves(params)),
    bandwidth_bytes_per_s=bandwidth,
    batches={},
  )
  rec.save()
  for b in s.batches:
    row = _decode_batch(s, cfg, graphdef, params, b, work)
    row["step_bytes"] = step_bytes = weight_bytes + row.pop("kv_bytes_per_step")
    if bandwidth:
      row["roofline_s_per_step"] = step_bytes / bandwidth
      row["roofline_fraction"] = row["roofline_s_per_step"] / row["s_per_step"]
    print(
      f"decode b={b}: {row['decode_tokens_per_s']:,.0f} tok/s per step "
      f"({row['s_per_step'] * 1e3:.3f} ms, {row['step_method']}), "
      f"{row['call_tokens_per_s']:,.0f} tok/s per call, roofline fraction "
      f"{row.get('roofline_fraction')}",
      flush=True,
    )
    rec["batches"][str(b)] = row
    rec["memory_after"] = memory()
    rec.save()
    gc.collect()


def _decode_batch(s: Settings, cfg, graphdef, params, b: int, work: Path) -> dict:
  """One batch size: an engine of b slots, its first (compiling) call, then `reps` runs of the
  short and the long length, interleaved. The KV bytes a measured step reads: every row's
  live positions, their mean over the measured steps."""
  from jaxrl.rollout.driver import Driver, Request
  from jaxrl.rollout.engine import Engine
  from jaxrl.rollout.kv_cache import pages_for
  from jaxrl.rollout.sampling import SamplingParams

  p, n, n_short = s.prompt_len, s.new_tokens, s.short_tokens
  engine = Engine(
    cfg,
    graphdef,
    max_concurrent_decodes=b,
    num_pages=b * pages_for(p + n, PAGE_SIZE),
    page_size=PAGE_SIZE,
    max_prefill_length=p,
    max_target_length=s.table_length(),
  )
  driver = Driver(engine, steps_per_call=s.steps_per_call, eos_id=None)  # no stop token
  greedy = SamplingParams(temperature=0.0)
  prompts = s.prompt_tokens(b)

  def run(m: int):
    reqs = [
      Request(prompt=row.tolist(), request_id=i, sampling=greedy, max_new_tokens=m)
      for i, row in enumerate(prompts)
    ]
    res = driver.run(params, reqs, seed=SEED)
    done = sorted(res.finished, key=lambda c: c.request_id)
    if len(done) != b or any(len(c.tokens) != m for c in done):
      raise RuntimeError(f"batch {b}: {len(done)} of {b} rows finished, not all with {m} tokens")
    return np.stack([c.tokens for c in done]), res.stats

  (tokens, _), first_s, compile_log = first_call(lambda: run(n))
  run(n_short)  # untimed: the first call of each length
  times, compiles = {n_short: [], n: []}, 0
  for _ in range(s.reps):
    for m in (n_short, n):
      t0 = time.perf_counter()
      _, stats = run(m)
      times[m].append(time.perf_counter() - t0)
      compiles += stats["compiles"]
  np.save(work / f"decode_tokens_b{b}.npy", tokens)
  long_s, short_s = statistics.median(times[n]), statistics.median(times[n_short])
  step_s, method = step_seconds(long_s, short_s, n, n_short)
  kv_per_position = (
    2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.compute_dtype.itemsize
  )
  live = p + (n + n_short) / 2  # positions each row attends to, mean over the measured steps
  return {
    "first_call_s": first_s,
    "compile": compile_log,
    "call_s": {str(k): v for k, v in times.items()},
    "long_call_s": long_s,
    "short_call_s": short_s,
    "s_per_step": step_s,
    "step_method": method,
    "decode_tokens_per_s": b / step_s,
    "call_tokens_per_s": b * n / long_s,
    "kv_bytes_per_step": b * live * kv_per_position,
    "page_table_positions": s.table_length(),
    "timed_run_compiles": compiles,  # programs compiled during the timed runs: 0 expected
    "engine_programs": engine.program_count,
    "decode_steps_last_run": stats["decode_steps"],
  }


def train_microbatches(s: Settings, chunked: bool) -> int:
  """Micro-batches of the train step: as set, else one where the log-prob head is chunked
  (its logits are then small), else 4 rows each (without chunking a row's float32 logits and
  log-softmax over Qwen3's 151,936-token vocabulary take about 1.9 GB each)."""
  rows = s.prompts * s.group_size
  if s.train_microbatches:
    return s.train_microbatches
  return 1 if chunked else max(1, rows // 4)


def train_flops(cfg: ModelConfig, rows: int, length: int) -> dict:
  """Model FLOPs of one train step (forward + backward) over rows x length tokens: 6 x the
  matmul params per token (q, k, v, o, gate, up, down and the output head; norms and the
  embedding lookup left out) plus PaLM's attention term 12 x L x heads x head_dim x T per token
  (the full T x T square). `remat_flops`: what remat="full" recomputes (one more forward of
  the blocks, without the head)."""
  d, h, layers = cfg.embed_dim, cfg.head_dim, cfg.num_layers
  per_layer = d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * cfg.mlp_dim
  matmul = layers * per_layer + cfg.vocab_size * d
  tokens = rows * length
  attention = 12 * layers * cfg.num_heads * h * length * tokens
  return {
    "matmul_params": matmul,
    "tokens": tokens,
    "dense_flops": 6 * matmul * tokens,
    "attention_flops": attention,
    "model_flops": 6 * matmul * tokens + attention,
    "remat_flops": 2 * layers * per_layer * tokens + attention // 3,
    "formula": "tokens x (6 x N_matmul + 12 x L x heads x head_dim x T); remat: + one forward "
    "of the blocks",
  }


def phase_train(s: Settings, rec: Record, work: Path) -> None:
  import jax

  from jaxrl.models.transformer import make_model

  rec["device"] = info = device_info()
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  chunked = "logits_chunk" in fields
  extra = {"logits_chunk": s.logits_chunk} if chunked else {}
  cfg = s.model().replace(
    param_dtype="float32", dtype="bfloat16", remat="full", scan_layers=s.scan_layers, **extra
  )
  rows, length = s.prompts * s.group_size, s.prompt_len + s.new_tokens
  micro = train_microbatches(s, chunked)
  rec.update(
    param_dtype=cfg.param_dtype,
    dtype=cfg.dtype,
    remat=cfg.remat,
    scan_layers=cfg.scan_layers,
    logits_chunk=extra.get("logits_chunk"),
    logits_chunk_available=chunked,
    rows=rows,
    length=length,
    num_microbatches=micro,
  )
  (graphdef, params), init_s, init_log = first_call(lambda: make_model(cfg, seed=SEED))
  rec.update(init_s=init_s, init_compile=init_log)
  rec.save()
  step, state, batch = _grpo_step(s, cfg, graphdef, params, micro)
  del params
  (state, metrics), first_s, compile_log = first_call(lambda: step(state, batch))
  rec.update(first_step_s=first_s, compile=compile_log, memory_after_first=memory())
  rec.save()
  times = []
  for _ in range(s.train_reps):
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(step(state, batch))
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  flops = train_flops(cfg, rows, length)
  peak = peak_flops(info["device_kind"], info["backend"])
  rec.update(
    step_s=step_s,
    steps_s=times,
    flops=flops,
    peak_flops=peak,
    achieved_flops_per_s=flops["model_flops"] / step_s,
    mfu=None if peak is None else flops["model_flops"] / step_s / peak,
    hfu=None if peak is None else (flops["model_flops"] + flops["remat_flops"]) / step_s / peak,
    metrics={k: float(v) for k, v in jax.device_get(metrics).items()},
  )
  print(
    f"train: step {step_s:.3f} s, {rec['achieved_flops_per_s'] / 1e12:.2f} TFLOP/s, "
    f"MFU {rec['mfu']}, first step {first_s:.1f} s",
    flush=True,
  )


def _grpo_step(s: Settings, cfg, graphdef, params, micro: int):
  """(step, state, batch): the learner's pieces on a fixed synthetic rollout. Behaviour and
  reference log-probs are -log V (a random init's logits are near zero), so the ratios and
  the KL stay finite."""
  import jax.numpy as jnp

  from jaxrl.config import KLConfig, PolicyLossConfig
  from jaxrl.rl.advantages import ESTIMATORS
  from jaxrl.rl.batch import from_rollout
  from jaxrl.rl.objectives import PolicyLoss
  from jaxrl.rl.train_step import init_state, make_optimizer, make_train_step
  from jaxrl.rollout.types import Rollout

  rows, n = s.prompts * s.group_size, s.new_tokens
  loss = PolicyLoss(
    graphdef,
    loss=PolicyLossConfig(name="ppo_clip", aggregation="token-mean", eps_low=0.2, eps_high=0.2),
    kl=KLConfig(beta=0.04, estimator="k3"),
    max_tokens=n,
  )
  opt = make_optimizer(learning_rate=1e-6, warmup_steps=0, total_steps=10**6, schedule="constant")
  step = make_train_step(opt, loss, num_microbatches=micro)
  state = init_state(params, opt)
  rng = np.random.default_rng(SEED + 1)
  prompts = np.repeat(s.prompt_tokens(s.prompts), s.group_size, axis=0)
  completions = rng.integers(3, cfg.vocab_size, (rows, n), dtype=np.int32)
  flat = np.float32(-math.log(cfg.vocab_size))
  rollout = Rollout(
    prompt_tokens=prompts,
    prompt_mask=np.ones(prompts.shape, bool),
    tokens=completions,
    mask=np.ones((rows, n), bool),
    logprobs=np.full((rows, n), flat, np.float32),
    versions=np.zeros((rows, n), np.int32),
    lengths=np.full((rows,), n, np.int32),
    truncated=np.ones((rows,), bool),
    finish_reason=np.full((rows,), 2, np.int32),
  )
  rewards = rng.random((s.prompts, s.group_size)).astype(np.float32)
  advantages = np.asarray(ESTIMATORS.get("grpo")(rewards), np.float32).reshape(-1)
  ref = jnp.full((rows, prompts.shape[1] + n), flat, jnp.float32)
  return step, state, from_rollout(rollout, advantages, ref_logprobs=ref)


def phase_export(s: Settings, rec: Record, work: Path) -> None:
  import jax

  from jaxrl.models.hf import export_hf_checkpoint
  from jaxrl.models.transformer import make_model

  cfg = s.model()
  (_, params), init_s, _ = first_call(lambda: make_model(cfg, seed=SEED))
  t0 = time.perf_counter()
  export_hf_checkpoint(cfg, jax.device_get(params), work / "checkpoint")
  files = list((work / "checkpoint").iterdir())
  rec.update(
    init_s=init_s,
    export_s=time.perf_counter() - t0,
    bytes=sum(f.stat().st_size for f in files),
    files=sorted(f.name for f in files),
  )


def phase_hf(s: Settings, rec: Record, work: Path) -> None:
  import torch
  from decode_throughput import prefix_agreement
  from transformers import AutoModelForCausalLM

  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.set_num_threads(s.torch_threads)
  t0 = time.perf_counter()
  model = AutoModelForCausalLM.from_pretrained(work / "checkpoint", dtype=torch.bfloat16)
  model = model.to(device=device, dtype=torch.bfloat16).eval()  # bf16 whatever `dtype=` did
  rec.update(
    device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
    dtype="bfloat16",
    load_s=time.perf_counter() - t0,
    torch_threads=torch.get_num_threads(),
    attn_implementation=getattr(model.config, "_attn_implementation", None),
    batches={},
  )
  rec.save()
  for b in s.batches:
    ids = torch.as_tensor(s.prompt_tokens(b), dtype=torch.long, device=device)

    def generate(m: int, ids=ids) -> np.ndarray:
      with torch.inference_mode():
        out = model.generate(
          input_ids=ids,
          attention_mask=torch.ones_like(ids),
          max_new_tokens=m,
          min_new_tokens=m,
          do_sample=False,
          use_cache=True,
          eos_token_id=None,
          pad_token_id=0,
        )
      return out[:, ids.shape[1] :].cpu().numpy().astype(np.int32)  # .cpu() waits for the GPU

    t0 = time.perf_counter()
    generate(s.short_tokens)  # untimed: CUDA kernels' first launches
    warm_s = time.perf_counter() - t0
    times, tokens = {s.short_tokens: [], s.new_tokens: []}, None
    for _ in range(s.reps):
      for m in times:
        t0 = time.perf_counter()
        tokens = generate(m)
        times[m].append(time.perf_counter() - t0)
    long_s, short_s = (
      statistics.median(times[s.new_tokens]),
      statistics.median(times[s.short_tokens]),
    )
    step_s, method = step_seconds(long_s, short_s, s.new_tokens, s.short_tokens)
    row = {
      "warmup_s": warm_s,
      "call_s": {str(k): v for k, v in times.items()},
      "long_call_s": long_s,
      "short_call_s": short_s,
      "s_per_step": step_s,
      "step_method": method,
      "decode_tokens_per_s": b / step_s,
      "call_tokens_per_s": b * s.new_tokens / long_s,
    }
    jaxrl_tokens = work / f"decode_tokens_b{b}.npy"
    if jaxrl_tokens.exists():  # same weights, same greedy argmax; bf16 rounding forks rows
      row["greedy_agreement_vs_jaxrl"] = prefix_agreement(np.load(jaxrl_tokens), tokens)
    if device == "cuda":
      row["cuda_peak_bytes"] = rec["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    rec["batches"][str(b)] = row
    rec.save()
    print(
      f"hf b={b}: {row['decode_tokens_per_s']:,.0f} tok/s per step, "
      f"{row['call_tokens_per_s']:,.0f} tok/s per call",
      flush=True,
    )


def phase_trl(s: Settings, rec: Record, work: Path) -> None:
  """bench/_trl_grpo_peer.py in a child on this interpreter: ready, two train steps (the first
  warms up), quit."""
  import torch

  from jaxrl.rl.advantages import ESTIMATORS

  cuda = torch.cuda.is_available()
  rows, n = s.prompts * s.group_size, s.new_tokens
  rng = np.random.default_rng(SEED + 1)
  rewards = rng.random((s.prompts, s.group_size)).astype(np.float32)
  request = {
    "checkpoint": str(work / "checkpoint"),
    "prompts": s.prompt_tokens(s.prompts).tolist(),
    "group_size": s.group_size,
    "new_tokens": n,
    "completions": rng.integers(3, s.model().vocab_size, (rows, n)).tolist(),
    "advantages": np.asarray(ESTIMATORS.get("grpo")(rewards)).reshape(-1).tolist(),
    "eos_id": -1,
    "beta": 0.04,
    "epsilon": 0.2,
    "learning_rate": 1e-6,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "threads": s.torch_threads,
    "use_cpu": not cuda,
    "bf16": cuda,
    "gradient_checkpointing": cuda,
  }
  path = work / "trl_request.json"
  path.write_text(json.dumps(request))
  cmd = [sys.executable, str(BENCH_DIR / "_trl_grpo_peer.py"), str(path)]
  proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  rec.update(device="cuda" if cuda else "cpu", bf16_autocast=cuda, gradient_checkpointing=cuda)
  try:
    ready = _ask(proc, "ready")
    rec.update(versions=ready["versions"], notes=ready["notes"])
    rec.save()
    for key in ("first_step_s", "step_s"):  # the first warms up (CUDA, allocator, autotuning)
      answer = _ask(proc, "train")
      rec.update({key: answer["seconds"], "cuda_peak_bytes": answer.get("cuda_peak_bytes")})
      rec.save()
  finally:
    if proc.poll() is None:
      proc.stdin.write("quit\n")
      proc.stdin.close()
      proc.wait(timeout=60)
  # Its train command runs the reference forward too: one more forward of the model FLOPs.
  flops = train_flops(s.model(), rows, s.prompt_len + n)["model_flops"] * 4 // 3
  kind = torch.cuda.get_device_name() if cuda else "cpu"
  peak = peak_flops(kind, "gpu" if cuda else "cpu")
  rec.update(model_flops=flops, mfu=None if peak is None else flops / rec["step_s"] / peak)


def _ask(proc, command: str) -> dict:
  proc.stdin.write(command + "\n")
  proc.stdin.flush()
  for line in proc.stdout:  # the child's own prints pass through; answers are tagged
    if line.startswith(TRL_TAG):
      return json.loads(line[len(TRL_TAG) :])
    print(line, end="")
  proc.wait()
  raise RuntimeError(f"TRL peer exited ({proc.returncode}) before answering {command!r}")


PHASE_FNS = {
  "bandwidth": phase_bandwidth,
  "decode": phase_decode,
  "train": phase_train,
  "export": phase_export,
  "hf": phase_hf,
  "trl": phase_trl,
}
# Phases that run torch, not JAX: their JAX (imported with jaxrl) stays on the CPU, so that it
# takes none of the GPU's memory.
TORCH_PHASES = ("hf", "trl")


def run_phase(name: str, work: Path) -> int:
  """The child's side: one phase, its record saved as it goes, its error recorded."""
  s = Settings(**json.loads((work / "settings.json").read_text()))
  s = dataclasses.replace(s, batches=tuple(s.batches))
  rec = Record(work / f"{name}.json")
  t0 = time.perf_counter()
  try:
    PHASE_FNS[name](s, rec, work)
    code = 0
  except Exception as err:  # noqa: BLE001  (recorded; the parent goes on to the next phase)
    rec["error"] = f"{type(err).__name__}: {err}"[:3000]
    rec["traceback"] = traceback.format_exc()[-4000:]
    print(rec["traceback"], flush=True)
    code = 1
  rec["phase_s"] = time.perf_counter() - t0
  if name not in TORCH_PHASES:
    rec["memory"] = memory()
  else:  # torch's CUDA peak (the TRL peer's own process reports its own); RSS of this process
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rec["memory"] = {"device_peak_bytes": rec.get("cuda_peak_bytes"), "peak_rss_bytes": rss}
  rec.save()
  return code


# ------------------------------------------------------------------------------------ the parent


def spawn(name: str, work: Path, budget: float, log_path: Path) -> dict:
  """Run one phase in a child process (its own session, so a timeout ends it and its children)
  with its output echoed and logged; its status, wall time and the tail of its output."""
  env = dict(os.environ)
  if name in TORCH_PHASES:
    env["JAX_PLATFORMS"] = "cpu"
  cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", name, "--work", str(work)]
  t0 = time.perf_counter()
  tail = collections.deque(maxlen=30)
  with open(log_path, "w") as log:
    proc = subprocess.Popen(
      cmd,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=env,
      start_new_session=True,
    )

    def pump():
      for line in proc.stdout:
        print(f"[{name}] {line}", end="", flush=True)
        log.write(line)
        tail.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
      proc.wait(timeout=budget)
      status = "ok" if proc.returncode == 0 else "error"
    except subprocess.TimeoutExpired:
      status = "timeout"
      os.killpg(proc.pid, signal.SIGTERM)
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=10)
  out = {
    "status": status,
    "wall_s": time.perf_counter() - t0,
    "budget_s": budget,
    "returncode": proc.returncode,
  }
  if status != "ok":
    out["log_tail"] = "".join(tail)[-3000:]
  return out


def trl_missing() -> str | None:
  """Why the TRL phase cannot run here, or None."""
  missing = [m for m in ("trl", "datasets", "accelerate") if importlib.util.find_spec(m) is None]
  if not missing:
    return None
  why = f"not importable here: {', '.join(missing)}"
  log = os.environ.get("DEVICE_REHEARSAL_TRL_LOG")
  if log and Path(log).exists():
    why += f"; the install from wheels said: {Path(log).read_text()[-800:]}"
  return why


def summarize(phases: dict) -> dict:
  """The headline numbers against the targets: per-batch decode throughput, roofline fraction
  and jaxrl / HF ratios, the train step's MFU, each phase's peak memory and compile seconds."""
  dec, hf = phases.get("decode", {}), phases.get("hf", {})
  out = {"decode": {}, "targets": TARGETS}
  for b, row in dec.get("batches", {}).items():
    d = {
      k: row.get(k)
      for k in ("decode_tokens_per_s", "call_tokens_per_s", "roofline_fraction", "s_per_step")
    }
    peer = hf.get("batches", {}).get(b)
    if peer:
      d["hf_decode_tokens_per_s"] = peer["decode_tokens_per_s"]
      d["hf_call_tokens_per_s"] = peer["call_tokens_per_s"]
      d["jaxrl_over_hf_step"] = row["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
      d["jaxrl_over_hf_call"] = row["call_tokens_per_s"] / peer["call_tokens_per_s"]
    out["decode"][b] = d
  train = phases.get("train", {})
  out["train"] = {k: train.get(k) for k in ("step_s", "mfu", "hfu", "achieved_flops_per_s")}
  out["trl"] = {k: phases.get("trl", {}).get(k) for k in ("step_s", "mfu")}
  b64 = out["decode"].get("64", {})  # the decode targets are set at batch 64 (None without it)
  out["met"] = {
    "decode_roofline_fraction_b64": _at_least(b64.get("roofline_fraction"), 0.60),
    "decode_jaxrl_over_hf_b64": _at_least(b64.get("jaxrl_over_hf_call"), 3.0),
    "train_mfu": _at_least(out["train"]["mfu"], 0.35),
  }
  out["peak_memory"] = {name: p.get("memory") for name, p in phases.items() if "memory" in p}
  compile_s = {}
  for name, p in phases.items():
    for key, c in _compile_logs(p):
      compile_s[f"{name}/{key}"] = c["xla_compile_s"] + c["lower_s"] + c["trace_s"]
  out["compile_s"] = compile_s
  return out


def _at_least(value, target):
  return None if value is None else bool(value >= target)


def _compile_logs(phase: dict):
  for key in ("init_compile", "compile"):
    if isinstance(phase.get(key), dict):
      yield key, phase[key]
  for b, row in phase.get("batches", {}).items():
    if isinstance(row.get("compile"), dict):
      yield f"b{b}", row["compile"]


def print_table(phases: dict, summary: dict) -> None:
  gib = 2**30
  print(
    f"\n{'phase':10} {'status':8} {'wall s':>7} {'budget':>7} {'peak dev GiB':>12} "
    f"{'peak RSS GiB':>12}"
  )
  for name, p in phases.items():
    mem = p.get("memory") or {}
    dev = mem.get("device_peak_bytes")
    rss = mem.get("peak_rss_bytes")
    print(
      f"{name:10} {p['status']:8} {p.get('wall_s', 0):7.1f} {p.get('budget_s', 0):7.0f} "
      f"{'-' if dev is None else f'{dev / gib:.2f}':>12} "
      f"{'-' if rss is None else f'{rss / gib:.2f}':>12}"
    )
  for b, d in summary["decode"].items():
    print(
      f"decode b={b}: {_fmt(d.get('decode_tokens_per_s'))} tok/s/step, "
      f"{_fmt(d.get('call_tokens_per_s'))} tok/s/call, roofline {_fmt(d.get('roofline_fraction'))}"
      f", jaxrl/HF {_fmt(d.get('jaxrl_over_hf_call'))} per call, "
      f"{_fmt(d.get('jaxrl_over_hf_step'))} per step"
    )
  t = summary["train"]
  print(
    f"train: step {_fmt(t['step_s'])} s, MFU {_fmt(t['mfu'])} (HFU {_fmt(t['hfu'])}); "
    f"TRL step {_fmt(summary['trl']['step_s'])} s, MFU {_fmt(summary['trl']['mfu'])}"
  )
  print(f"targets {summary['targets']}: met {summary['met']}")
  print("compile s: " + ", ".join(f"{k} {v:.1f}" for k, v in summary["compile_s"].items()))


def _fmt(x) -> str:
  if x is None:
    return "-"
  return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--smoke", action="store_true", help="toy shapes on a CPU (checks the script)")
  ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON report")
  ap.add_argument("--phases", default=",".join(PHASES), help=f"a comma list of {PHASES}")
  ap.add_argument("--deadline", type=float, default=450.0, help="seconds for all phases")
  ap.add_argument("--budget", default="", help="per-phase seconds, e.g. decode=200,train=120")
  ap.add_argument("--batches", default=None, help="decode batch sizes, e.g. 64,256")
  ap.add_argument("--train-microbatches", type=int, default=None, help="0: auto")
  ap.add_argument("--phase", help=argparse.SUPPRESS)  # a child: run this phase only
  ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.phase:
    return run_phase(args.phase, args.work)
  phases = [p for p in args.phases.split(",") if p]
  if not phases or set(phases) - set(PHASES):
    ap.error(f"--phases {args.phases!r}: a comma list of {PHASES}")
  budgets = dict(BUDGETS) if not args.smoke else dict.fromkeys(PHASES, SMOKE_BUDGET_S)
  for item in filter(None, args.budget.split(",")):
    name, _, sec = item.partition("=")
    if name not in PHASES or not sec.replace(".", "", 1).isdigit():
      ap.error(f"--budget entry {item!r}: phase=seconds, phase one of {PHASES}")
    budgets[name] = float(sec)
  batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else None
  s = Settings.make(args.smoke, batches=batches, train_microbatches=args.train_microbatches)
  return orchestrate(s, phases, budgets, args.deadline, args.out)


def orchestrate(s: Settings, phases, budgets: dict, deadline_s: float, out: Path) -> int:
  """Each phase in turn in a child, under min(its budget, what is left of the deadline); the
  report rewritten after each."""
  end = time.monotonic() + deadline_s
  logs = out.parent / f"{out.stem}_logs"
  logs.mkdir(parents=True, exist_ok=True)
  results: dict[str, dict] = {}
  vers = versions(
    (
      "jax",
      "jaxlib",
      "jax-cuda12-plugin",
      "jax-cuda13-plugin",
      "flax",
      "torch",
      "transformers",
      "trl",
      "accelerate",
      "datasets",
    )
  )
  with tempfile.TemporaryDirectory(prefix="device_rehearsal_") as tmp:
    work = Path(tmp)
    (work / "settings.json").write_text(json.dumps(dataclasses.asdict(s)))
    for name in phases:
      left = end - time.monotonic()
      why = trl_missing() if name == "trl" else None
      if why is not None:  # a peer not installed here: not a failure of the run
        results[name] = {"status": "skipped", "reason": why}
      elif left < MIN_PHASE_S:
        results[name] = {"status": "not_run", "reason": f"{left:.0f} s of the deadline left"}
      else:
        budget = min(budgets[name], left)
        print(f"=== {name} (budget {budget:.0f} s)", flush=True)
        results[name] = spawn(name, work, budget, logs / f"{name}.log")
        path = work / f"{name}.json"
        if path.exists():
          results[name] |= json.loads(path.read_text())
        if "error" in results[name] and results[name]["status"] == "ok":
          results[name]["status"] = "error"
      summary = summarize(results)
      device = next(
        (p["device"] for p in results.values() if isinstance(p.get("device"), dict)), {}
      )
      write_report(
        out,
        "device_rehearsal",
        dataclasses.asdict(s),
        results,
        device=device,
        versions=vers,
        summary=summary,
        budgets=budgets,
        deadline_s=deadline_s,
      )
  print_table(results, summary)
  bad = [n for n, p in results.items() if p["status"] not in ("ok", "skipped")]
  if bad:
    print(f"phases not ok: {bad}")
  return 1 if bad else 0


if __name__ == "__main__":
  raise SystemExit(main())
