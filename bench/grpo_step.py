"""One GRPO step: jaxrl vs Tunix's GRPOLearner vs TRL's GRPOTrainer on CPU; where jaxrl's goes.

Every peer trains the same random-weight Qwen3-shaped model (built once with jaxrl, exported to
safetensors, loaded by each peer) with the same GRPO settings: P prompts x G samples x N new
tokens, beta = 0.04 (k3 KL to a frozen reference), PPO clip 0.2, token-mean loss, AdamW with the
same learning rate, betas and weight decay, gradient clipping at 1.0. Two measurements:

  train  the train step alone on fixed completions (the same tokens and advantages for every
         peer): reference log-probs, then policy forward + backward + optimizer update, each as
         its library runs them after a rollout
  full   the whole step: rollout (temperature 1, exactly N tokens per row), reward, advantages,
         reference log-probs and the update

The first call of each kind is the first step including compilation (jaxrl and Tunix); the
timed calls after it are interleaved (one call per peer per repetition, order rotated), as
decode_throughput.py does. `--profile` adds jaxrl's FLOPs (XLA cost analysis), the time per HLO
op category from a jax.profiler trace, and the machine's matmul rate at the step's shapes.

  .venv/bin/python bench/grpo_step.py                     # all peers, train + full, profile
  .venv/bin/python bench/grpo_step.py --quick             # sanity run
  .venv/bin/python bench/grpo_step.py --peers jaxrl --kinds train --profile
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH_DIR))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import MODELS, machine, num_cores, versions  # noqa: E402
from _compile_log import CompileLog  # noqa: E402

from jaxrl.models.hf import export_hf_checkpoint  # noqa: E402
from jaxrl.models.transformer import make_model, token_logprobs  # noqa: E402
from jaxrl.rl import batch as batch_lib  # noqa: E402
from jaxrl.rl import objectives  # noqa: E402
from jaxrl.rl.advantages import ESTIMATORS  # noqa: E402
from jaxrl.rl.train_step import init_state, make_optimizer, make_train_step  # noqa: E402
from jaxrl.rollout.collect import to_rollout  # noqa: E402
from jaxrl.rollout.driver import Driver, Request  # noqa: E402
from jaxrl.rollout.engine import Engine  # noqa: E402
from jaxrl.rollout.kv_cache import pages_for  # noqa: E402
from jaxrl.rollout.sampling import SamplingParams  # noqa: E402
from jaxrl.rollout.types import Rollout  # noqa: E402

CHILDREN = {
  "tunix": (BENCH_DIR / ".venv-tunix" / "bin" / "python", BENCH_DIR / "_tunix_grpo_peer.py"),
  "trl": (BENCH_DIR / ".venv-trl" / "bin" / "python", BENCH_DIR / "_trl_grpo_peer.py"),
}
TAGS = {"tunix": "@@tunix-grpo ", "trl": "@@trl-grpo "}  # prefixes of the children's answers
DEFAULT_OUT = BENCH_DIR / "results" / "grpo_step.json"
KINDS = ("train", "full")
KINDS_COLD_FIRST = ("full", "train")  # the first call of a peer is its cold first step
PAD_ID = 0
NO_EOS = -1  # never sampled (byte ids are in [0, 259)): every completion has exactly N tokens
SEED = 0


def parity_reward(tokens: np.ndarray) -> np.ndarray:
  """[B, N] completion tokens -> [B] share of even ids (any cheap reward would do: it is the
  same function in every peer, and its time is noise next to the step)."""
  return np.mean(tokens % 2 == 0, axis=1).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Workload:
  """What every peer trains on: one checkpoint, one prompt batch, one set of fixed completions."""

  cfg: object
  graphdef: object
  params: object
  checkpoint: Path
  prompts: np.ndarray  # [P, L] int32, no padding
  group_size: int
  completions: np.ndarray  # [P * G, N] int32: the train measurement's fixed completions
  advantages: np.ndarray  # [P * G] float32: GRPO advantages of parity_reward on them
  beta: float
  epsilon: float
  learning_rate: float
  weight_decay: float
  grad_clip: float
  threads: int


@dataclasses.dataclass
class Peer:
  """A built peer. `call(kind)` runs one step of that kind and returns (seconds, info)."""

  call: Callable[[str], tuple[float, dict]]
  notes: str = ""
  close: Callable[[], None] = lambda: None
  extra: dict = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------------------ jaxrl


def jaxrl_source() -> dict:
  """Where the jaxrl that ran comes from: its directory, commit and uncommitted changes."""
  import jaxrl

  root = Path(jaxrl.__file__).resolve().parent.parent

  def git(*a):
    r = subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None

  dirty = git("status", "--porcelain", "--", "jaxrl")
  return {"path": str(root), "commit": git("rev-parse", "HEAD"), "jaxrl_dirty": bool(dirty)}


def grpo_loss(w: Workload):
  """jaxrl's GRPO loss: PPO clip, k3 KL to the reference, token-mean.

  Older versions of jaxrl have `GRPOLoss(graphdef, policy_loss=, eps_low=, beta=, ...)`, newer
  ones `PolicyLoss(graphdef, loss=PolicyLossConfig, kl=KLConfig)`; this builds whichever the
  checkout has, with the same settings.
  """
  if hasattr(objectives, "PolicyLoss"):
    from jaxrl.config import KLConfig, PolicyLossConfig

    loss = PolicyLossConfig(
      name="ppo_clip", aggregation="token-mean", eps_low=w.epsilon, eps_high=w.epsilon
    )
    return objectives.PolicyLoss(w.graphdef, loss=loss, kl=KLConfig(beta=w.beta, estimator="k3"))
  return objectives.GRPOLoss(
    w.graphdef,
    policy_loss="ppo_clip",
    eps_low=w.epsilon,
    eps_high=w.epsilon,
    beta=w.beta,
    kl_estimator="k3",
    aggregation="token-mean",
  )


class JaxrlStep:
  """jaxrl's GRPO step from its public pieces, assembled as jaxrl.rl.loop does it."""

  def __init__(self, w: Workload):
    self.w = w
    b, n = w.completions.shape
    self.loss = grpo_loss(w)
    self.opt = make_optimizer(
      learning_rate=w.learning_rate,
      warmup_steps=0,
      total_steps=10**6,
      weight_decay=w.weight_decay,
      grad_clip=w.grad_clip,
      schedule="constant",
    )
    self.step_fn = make_train_step(self.opt, self.loss)
    # A copy each: the step donates its state; the reference stays frozen.
    self.state = init_state(jax.tree.map(jnp.copy, w.params), self.opt)
    self.ref_params = jax.tree.map(jnp.copy, w.params)
    self.ref_logprobs = jax.jit(lambda p, t, v: token_logprobs(w.graphdef, p, t, v))
    rows = np.repeat(w.prompts, w.group_size, axis=0)
    self.rows = rows
    # The fixed rollout's behaviour log-probs (the sampler's, in a real step): the initial
    # policy's, computed once outside the timing.
    # A jit of its own, so that the reference forward's compile stays in the cold first step.
    full = np.concatenate([rows, w.completions], axis=1)
    behaviour = jax.jit(lambda p, t, v: token_logprobs(w.graphdef, p, t, v))
    logp = np.asarray(behaviour(w.params, full, np.ones(full.shape, bool)))
    self.fixed = Rollout(
      prompt_tokens=rows,
      prompt_mask=np.ones(rows.shape, bool),
      tokens=w.completions,
      mask=np.ones((b, n), bool),
      logprobs=logp[:, rows.shape[1] :],
      versions=np.zeros((b, n), np.int32),
      lengths=np.full((b,), n, np.int32),
      truncated=np.ones((b,), bool),
      finish_reason=np.full((b,), 2, np.int32),
    )
    # The rollout: what collect.GroupSampler builds (one engine slot per sample, pages for all),
    # with the driver's EOS off (GroupSampler always stops on its first eos id), so every row
    # samples exactly N tokens, as in the other peers.
    p = w.prompts.shape[1]
    self.engine = Engine(
      w.cfg,
      w.graphdef,
      max_concurrent_decodes=b,
      num_pages=b * pages_for(p + n, 16),
      page_size=16,
      max_prefill_length=p,
      max_target_length=p + n,
    )
    self.driver = Driver(self.engine, steps_per_call=8, eos_id=None)
    self.steps = 0

  def update(self, rollout: Rollout, advantages) -> dict:
    """Reference log-probs, the TrainBatch, the jitted step; metrics fetched once (as the loop)."""
    full = jnp.concatenate([rollout.prompt_tokens, rollout.tokens], axis=1)
    valid = jnp.concatenate([rollout.prompt_mask, rollout.mask], axis=1)
    ref = self.ref_logprobs(self.ref_params, full, valid)
    batch = batch_lib.from_rollout(rollout, advantages, ref_logprobs=ref)
    self.state, metrics = self.step_fn(self.state, batch)
    self.steps += 1
    return {k: float(v) for k, v in jax.device_get(metrics).items()}

  def train(self) -> dict:
    self.update(self.fixed, self.w.advantages)
    return {}

  def full(self) -> dict:
    g = self.w.group_size
    n = self.w.completions.shape[1]
    requests = [
      Request(
        prompt=prompt.tolist(),
        request_id=i * g + j,
        group_id=i,
        sampling=SamplingParams(temperature=1.0),
        max_new_tokens=n,
      )
      for i, prompt in enumerate(self.w.prompts)
      for j in range(g)
    ]
    result = self.driver.run(
      self.state.params, requests, policy_version=self.steps, seed=self.steps
    )
    done = sorted(result.finished, key=lambda c: c.request_id)
    rollout = to_rollout(done, prompt_len=self.rows.shape[1], max_new_tokens=n, pad_id=PAD_ID)
    rewards = parity_reward(np.asarray(rollout.tokens))
    adv = np.asarray(ESTIMATORS.get("grpo")(rewards.reshape(-1, g))).reshape(-1)
    self.update(rollout, adv)
    return {"lengths": np.asarray(rollout.lengths).tolist()}


def run_jaxrl(w: Workload) -> Peer:
  step = JaxrlStep(w)

  def call(kind: str):
    compile_log = CompileLog() if step.steps == 0 else None  # the cold first step
    t0 = time.perf_counter()
    with compile_log or contextlib.nullcontext():
      info = step.train() if kind == "train" else step.full()
    if compile_log:
      info["compile"] = compile_log.summary()
    return time.perf_counter() - t0, {**info, "steps": step.steps}

  notes = (
    "PolicyLoss / GRPOLoss (ppo_clip, k3, token-mean) + make_optimizer(constant) + "
    "make_train_step; reference log-probs by a jitted token_logprobs, batch by "
    "batch.from_rollout (as jaxrl.rl.loop); full = engine Driver (continuous batching, one slot "
    "per sample, as GroupSampler) + to_rollout + reward + grpo advantages + the same update"
  )
  return Peer(call, notes=notes, extra={"jaxrl_step": step})


# --------------------------------------------------------------------------------------- children


def run_child(name: str, w: Workload) -> Peer:
  """A peer in its own venv: a child process that builds the trainer, then runs one step per
  command line and answers with its own timing (the pipe is not measured)."""
  python, script = CHILDREN[name]
  if not python.exists():
    raise FileNotFoundError(f"{python} is missing; create the {name} venv first (bench/README.md)")
  tmp = tempfile.TemporaryDirectory()
  request = Path(tmp.name) / "request.json"
  request.write_text(
    json.dumps(
      {
        "checkpoint": str(w.checkpoint),
        "prompts": w.prompts.tolist(),
        "group_size": w.group_size,
        "new_tokens": w.completions.shape[1],
        "completions": w.completions.tolist(),
        "advantages": w.advantages.tolist(),
        "eos_id": NO_EOS,
        "beta": w.beta,
        "epsilon": w.epsilon,
        "learning_rate": w.learning_rate,
        "weight_decay": w.weight_decay,
        "grad_clip": w.grad_clip,
        "threads": w.threads,
      }
    )
  )
  proc = subprocess.Popen(
    [str(python), str(script), str(request)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    cwd=str(BENCH_DIR),
    env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")},
  )
  tag = TAGS[name]

  def ask(command: str) -> dict:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    for line in proc.stdout:  # the child's own prints are skipped; answers are tagged
      if line.startswith(tag):
        return json.loads(line[len(tag) :])
    proc.wait()
    raise RuntimeError(
      f"{name} peer failed (exit {proc.returncode}):\n{proc.stderr.read()[-4000:]}"
    )

  ready = ask("ready")
  _VERSIONS.update(ready.get("versions", {}))

  def call(kind: str):
    answer = ask(kind)
    return answer.pop("seconds"), answer

  def close():
    if proc.poll() is None:
      proc.stdin.write("quit\n")
      proc.stdin.close()
      proc.wait(timeout=120)
    tmp.cleanup()

  return Peer(call, notes=ready["notes"], close=close)


PEERS: dict[str, Callable[[Workload], Peer]] = {
  "jaxrl": run_jaxrl,
  "tunix": lambda w: run_child("tunix", w),
  "trl": lambda w: run_child("trl", w),
}
_VERSIONS: dict[str, str] = {}


# ------------------------------------------------------------------------------------ profiling


def op_categories(hlo_text: str) -> dict[str, tuple[str, str, str]]:
  """HLO instruction name -> (category, pass, "shape jax-op-name") for the ops of a compiled CPU
  executable.

  Category from what the op computes (for a fusion, the body of its fused computation; XLA:CPU
  runs both dots and reductions as YNNPACK fusions, so the name alone does not tell): matmul
  (a dot inside), reduce, copy/transpose (a root that moves data), gather/scatter, elementwise
  (the rest). Pass from the op's jax name: backward (`transpose(jvp(...))`), forward
  (`jvp(...)`), or other (the loss's and the optimizer's reductions and updates, metrics, and
  everything in the reference forward, which has no jvp).
  """
  bodies, current = {}, None
  for line in hlo_text.splitlines():
    head = re.match(r"\s*%?([\w.\-]+) \(.*\) -> .* \{$", line)
    if head and not line.lstrip().startswith("ENTRY"):
      current = head.group(1)
      bodies[current] = []
    elif line.strip() == "}":
      current = None
    elif current is not None:
      bodies[current].append(line)
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ([^=]*?)\b([a-z\-]+)\(", line)
    if not m:
      continue
    name, shape, op = m.groups()
    calls = re.search(r"calls=%?([\w.\-]+)", line)
    body = "\n".join(bodies.get(calls.group(1), [])) if calls else ""
    root = next((b for b in bodies.get(calls.group(1), []) if "ROOT" in b), "") if calls else ""
    if op in ("dot", "convolution") or re.search(r"= [^=]*\b(dot|convolution)\(", body):
      cat = "matmul"
    elif op == "reduce" or re.search(r"= [^=]*\breduce(-window)?\(", body):
      cat = "reduce"
    elif op in ("gather", "scatter") or re.search(r"\b(gather|scatter)\(", body):
      cat = "gather/scatter"
    elif op in ("copy", "transpose") or re.search(r"\b(copy|transpose)\(", root):
      cat = "copy/transpose"
    elif op in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
      continue
    else:
      cat = "elementwise"
    meta = re.search(r'op_name="([^"]*)"', line)
    jax_name = meta.group(1) if meta else ""
    if "transpose(jvp" in jax_name:
      phase = "backward"
    elif "jvp(" in jax_name:
      phase = "forward"
    else:
      phase = "other"
    out[name] = (cat, phase, f"{shape.strip()} {jax_name}")
  return out


def trace_ops(fn: Callable[[], None], calls: int, workdir: str) -> dict[str, dict[str, float]]:
  """Seconds per HLO module and op, summed over `calls` traced calls of `fn` on all threads and
  divided by `calls`. Ops that run at once on several cores count once per core: core-time."""
  jax.profiler.start_trace(workdir)
  for _ in range(calls):
    fn()
  jax.profiler.stop_trace()
  path = sorted(glob.glob(f"{workdir}/**/*.xplane.pb", recursive=True))[-1]
  data = jax.profiler.ProfileData.from_file(path)
  per_op = collections.defaultdict(collections.Counter)
  for plane in data.planes:
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):
        continue
      for ev in line.events:
        module = dict(ev.stats).get("hlo_module")
        if module is None:  # thread-pool and executor bookkeeping, not an op
          continue
        per_op[module][ev.name] += ev.duration_ns * 1e-9 / calls
  return per_op


def breakdown(per_op: dict[str, float], cats: dict[str, tuple[str, str, str]]) -> dict:
  """Core-seconds by category/pass, the ten most expensive ops, and each category's top three."""
  table = collections.Counter()
  by_cat = collections.defaultdict(list)
  for name, s in per_op.items():
    cat, phase, _ = cats.get(name, ("unmapped", "other", ""))
    table[f"{cat}/{phase}"] += s
    by_cat[cat].append((s, name))

  def row(name, s):
    cat, phase, what = cats.get(name, ("unmapped", "other", ""))
    return {"op": name, "core_s": s, "category": f"{cat}/{phase}", "hlo": what}

  top = sorted(per_op.items(), key=lambda kv: -kv[1])[:10]
  return {
    "core_s": sum(per_op.values()),
    "by_category": {k: v for k, v in sorted(table.items(), key=lambda kv: -kv[1])},
    "top_ops": [row(k, v) for k, v in top],
    "top_by_category": {
      c: [row(n, s) for s, n in sorted(v, reverse=True)[:3]] for c, v in by_cat.items()
    },
  }


def matmul_rate(shapes: list[tuple[int, int, int]], reps: int = 10) -> float:
  """GFLOP/s of XLA float32 matmuls [M, K] x [K, N] at the given shapes, run back to back in one
  jitted program (the machine's attainable rate at the step's shapes; compare the step's)."""
  keys = jax.random.split(jax.random.key(1), 2 * len(shapes))
  xs = [jax.random.normal(keys[2 * i], (m, k)) for i, (m, k, _) in enumerate(shapes)]
  ws = [jax.random.normal(keys[2 * i + 1], (k, n)) for i, (_, k, n) in enumerate(shapes)]

  @jax.jit
  def chain(xs, ws):
    return [x @ w for x, w in zip(xs, ws, strict=True)]

  jax.block_until_ready(chain(xs, ws))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(chain(xs, ws))
    times.append(time.perf_counter() - t0)
  flops = sum(2 * m * k * n for m, k, n in shapes)
  return flops / statistics.median(times) / 1e9


def profile_jaxrl(step: JaxrlStep, calls: int) -> dict:
  """FLOPs, op-category time and matmul rates of jaxrl's train step and reference forward.

  The trace covers whole `train` calls; its ops are split by the HLO module that ran them. The
  op names are mapped to categories through the compiled HLO of the same two programs: the
  reference forward's `lower(...)`, and the train step's through its jitted function (the
  `_jitted` of make_train_step's callable: the one handle on the exact executable that ran).
  """
  w, cfg = step.w, step.w.cfg
  full = np.concatenate([step.rows, w.completions], axis=1)
  valid = np.ones(full.shape, bool)
  batch = batch_lib.from_rollout(
    step.fixed, w.advantages, ref_logprobs=step.ref_logprobs(step.ref_params, full, valid)
  )
  programs = {"ref_logprobs": step.ref_logprobs.lower(step.ref_params, full, valid).compile()}
  jitted = getattr(step.step_fn, "_jitted", None)
  if jitted is not None:
    programs["train_step"] = jitted.lower(step.state, batch, None).compile()

  def ref_call():
    jax.block_until_ready(step.ref_logprobs(step.ref_params, full, valid))

  def step_call():
    step.state, metrics = step.step_fn(step.state, batch)
    jax.block_until_ready(metrics)

  def wall(fn) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
      fn()
    return (time.perf_counter() - t0) / calls

  out = {"wall_s": {"train_call": wall(step.train), "train_step": wall(step_call),
                    "ref_logprobs": wall(ref_call)}}  # fmt: skip
  with tempfile.TemporaryDirectory() as tmp:
    per_module = trace_ops(step.train, calls, tmp)
  for name, compiled in programs.items():
    module = compiled.as_text().split("HloModule ", 1)[1].split(",", 1)[0].split()[0]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost.get("flops", 0.0))
    out[name] = {
      "hlo_module": module,
      "flops": flops,
      "transcendentals": float(cost.get("transcendentals", 0.0)),
      "gflops_per_s": flops / out["wall_s"][name] / 1e9,
      **breakdown(per_module.pop(module, {}), op_categories(compiled.as_text())),
    }
  # Whatever else ran in a train call: the eager ops of the batch assembly (concatenations).
  out["other_modules_core_s"] = {m: sum(ops.values()) for m, ops in per_module.items()}
  # The step's matmul shapes (per layer, forward): tokens x weights. Backward runs each twice more.
  m = full.size
  d, h, f = cfg.embed_dim, cfg.head_dim, cfg.mlp_dim
  shapes = [
    (m, d, cfg.num_heads * h),
    (m, d, cfg.num_kv_heads * h),
    (m, d, cfg.num_kv_heads * h),
    (m, cfg.num_heads * h, d),
    (m, d, f),
    (m, d, f),
    (m, f, d),
    (m, d, cfg.vocab_size),
  ]
  out["matmul_gflops_per_s_at_step_shapes"] = matmul_rate(shapes)
  out["matmul_gflops_per_s_2048_cube"] = matmul_rate([(2048, 2048, 2048)], reps=5)
  return out


# ------------------------------------------------------------------------------------------- main


def _parse_list(value: str, allowed, flag: str) -> list[str]:
  items = [v.strip() for v in value.split(",") if v.strip()]
  bad = [v for v in items if v not in allowed]
  if bad or not items:
    raise SystemExit(f"{flag}={value!r}: unknown {bad or 'empty'}; allowed: {', '.join(allowed)}")
  return items


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="small", choices=list(MODELS))
  ap.add_argument("--peers", default="jaxrl,tunix,trl", help=f"from {', '.join(PEERS)}")
  ap.add_argument(
    "--kinds", default="train,full", help="train (fixed completions), full (+rollout)"
  )
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--group-size", type=int, default=4)
  ap.add_argument("--prompt-len", type=int, default=16)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--beta", type=float, default=0.04)
  ap.add_argument("--epsilon", type=float, default=0.2)
  ap.add_argument("--lr", type=float, default=1e-5)
  ap.add_argument("--weight-decay", type=float, default=0.0)
  ap.add_argument("--grad-clip", type=float, default=1.0)
  ap.add_argument("--reps", type=int, default=7, help="timed calls per peer and kind (median)")
  ap.add_argument("--gap", type=float, default=0.25, help="idle seconds before every timed call")
  ap.add_argument("--threads", type=int, default=num_cores(), help="torch threads for TRL")
  ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
  ap.add_argument("--profile-calls", type=int, default=3)
  ap.add_argument("--quick", action="store_true", help="sanity run: 2 reps, no profile")
  ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
  args = ap.parse_args(argv)
  peers = _parse_list(args.peers, PEERS, "--peers")
  kinds = _parse_list(args.kinds, KINDS, "--kinds")
  if args.quick:
    args.reps, args.profile = min(args.reps, 2), False
  for name in ("prompts", "prompt_len", "new_tokens", "reps", "threads", "profile_calls"):
    if getattr(args, name) <= 0:
      raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  if args.group_size < 2:
    raise SystemExit(f"--group-size must be >= 2 (GRPO), got {args.group_size}")

  cfg = MODELS[args.model]()
  rng = np.random.default_rng(SEED)
  graphdef, params = make_model(cfg, seed=SEED)
  b = args.prompts * args.group_size
  # Byte tokens (ids 3..258): no prompt or completion holds pad / bos / eos.
  prompts = rng.integers(3, cfg.vocab_size, (args.prompts, args.prompt_len), dtype=np.int32)
  completions = rng.integers(3, cfg.vocab_size, (b, args.new_tokens), dtype=np.int32)
  rewards = parity_reward(completions).reshape(-1, args.group_size)
  advantages = np.asarray(ESTIMATORS.get("grpo")(rewards), np.float32).reshape(-1)
  results, first, first_compile, times, infos, notes = [], {}, {}, {}, {}, {}
  profile = None
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = Path(tmp) / args.model
    export_hf_checkpoint(cfg, params, ckpt)
    w = Workload(
      cfg,
      graphdef,
      params,
      ckpt,
      prompts,
      args.group_size,
      completions,
      advantages,
      args.beta,
      args.epsilon,
      args.lr,
      args.weight_decay,
      args.grad_clip,
      args.threads,
    )
    ready: dict[str, Peer] = {}
    try:
      for peer in peers:
        print(f"{peer}: building ...", flush=True)
        ready[peer] = PEERS[peer](w)
        notes[peer] = ready[peer].notes
        # The first call of each kind, untimed for the medians. The very first one (the whole
        # step when it is measured) is the cold first step: every compilation it needs is in it.
        for kind in sorted(kinds, key=KINDS_COLD_FIRST.index):
          seconds, info = ready[peer].call(kind)
          first[f"{peer}/{kind}"] = seconds
          if "compile" in info:
            first_compile[f"{peer}/{kind}"] = info["compile"]
          print(f"{peer}: first {kind} step {seconds:.2f} s", flush=True)
      for rep in range(args.reps):
        # One timed call per peer and kind per repetition, peers in an order rotated each
        # time: a drift in the machine's speed falls on all peers alike.
        order = peers[rep % len(peers) :] + peers[: rep % len(peers)]
        for kind in kinds:
          for peer in order:
            time.sleep(args.gap)
            seconds, info = ready[peer].call(kind)
            times.setdefault(f"{peer}/{kind}", []).append(seconds)
            if kind == "full" and any(n != args.new_tokens for n in info.get("lengths", [])):
              raise RuntimeError(f"{peer} sampled completions shorter than {args.new_tokens}")
            infos[f"{peer}/{kind}"] = {k: v for k, v in info.items() if k != "lengths"}
        print(f"repetition {rep + 1}/{args.reps} done ({os.getloadavg()[0]:.1f} load)", flush=True)
      if args.profile and "jaxrl" in ready:
        print("profiling jaxrl ...", flush=True)
        profile = profile_jaxrl(ready["jaxrl"].extra["jaxrl_step"], args.profile_calls)
    finally:
      for peer in ready.values():
        peer.close()

  for kind in kinds:
    meds = {p: statistics.median(times[f"{p}/{kind}"]) for p in peers}
    for peer in peers:
      r = {
        "peer": peer,
        "kind": kind,
        "median_s": meds[peer],
        "times_s": times[f"{peer}/{kind}"],
        "first_s": first[f"{peer}/{kind}"],
        # Whether first_s is the peer's cold first step (its first call, all compiles in it);
        # otherwise only what this kind adds (e.g. train after full: nothing left to compile).
        "first_is_cold": kind == min(kinds, key=KINDS_COLD_FIRST.index),
        "info": infos.get(f"{peer}/{kind}", {}),
      }
      if f"{peer}/{kind}" in first_compile:  # tracing, lowering, XLA compile of the cold step
        r["first_compile"] = first_compile[f"{peer}/{kind}"]
      if "jaxrl" in peers:
        r["ratio_jaxrl_over_peer"] = meds["jaxrl"] / meds[peer]  # < 1: jaxrl is faster
        paired = [j / t for j, t in zip(times[f"jaxrl/{kind}"], r["times_s"], strict=True)]
        r["paired_ratio_jaxrl_over_peer"] = {
          "median": statistics.median(paired),
          "min": min(paired),
          "max": max(paired),
        }
        r["first_ratio_jaxrl_over_peer"] = first[f"jaxrl/{kind}"] / r["first_s"]  # cold: see above
      results.append(r)

  print(
    f"\n{'kind':6} {'peer':6} {'median s':>9} {'first s':>8} {'jaxrl/peer':>11} {'by call':>18}"
  )
  for r in results:
    p = r.get("paired_ratio_jaxrl_over_peer", {})
    ratio = f"{r.get('ratio_jaxrl_over_peer', float('nan')):11.2f}"
    span = f"{p.get('median', 0):.2f} ({p.get('min', 0):.2f}-{p.get('max', 0):.2f})" if p else ""
    print(
      f"{r['kind']:6} {r['peer']:6} {r['median_s']:9.3f} {r['first_s']:8.2f} {ratio} {span:>18}"
    )
  print("(* first step of the peer's process: every compile included)")
  for r in results:
    c = r.get("first_compile")
    if c:
      print(
        f"{r['peer']} cold {r['kind']} step: trace {c['trace_s']:.2f} s, lower {c['lower_s']:.2f}"
        f" s, XLA compile {c['xla_compile_s']:.2f} s ({c['compilations']} compilations): "
        f"{c['top_xla_compile_s']}, other {c['other_xla_compile_s']:.2f} s"
      )
  if profile:
    print(f"\njaxrl wall s per call: {profile['wall_s']}")
    for name in ("train_step", "ref_logprobs"):
      p = profile.get(name)
      if p is None:
        continue
      print(
        f"jaxrl {name}: {p['flops'] / 1e9:.1f} GFLOP in {profile['wall_s'][name]:.3f} s -> "
        f"{p['gflops_per_s']:.1f} GFLOP/s; {p['core_s']:.3f} core-s in its ops"
      )
      for k, v in p["by_category"].items():
        print(f"  {k:32} {v:7.3f} core-s  {100 * v / max(p['core_s'], 1e-9):5.1f}%")
    print(f"other modules in a train call (core-s): {profile['other_modules_core_s']}")
    print(
      f"matmul rate at the step's shapes: {profile['matmul_gflops_per_s_at_step_shapes']:.1f} "
      f"GFLOP/s; 2048^3: {profile['matmul_gflops_per_s_2048_cube']:.1f} GFLOP/s"
    )

  report = {
    "benchmark": "grpo_step",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "load_average_at_end": os.getloadavg(),
    "versions": {**versions(), **_VERSIONS},
    "jaxrl_source": jaxrl_source(),
    "settings": {
      "model": args.model,
      "model_config": dataclasses.asdict(cfg),
      "prompts": args.prompts,
      "group_size": args.group_size,
      "prompt_len": args.prompt_len,
      "new_tokens": args.new_tokens,
      "beta": args.beta,
      "kl": "k3",
      "epsilon": args.epsilon,
      "loss_aggregation": "token-mean",
      "optimizer": f"AdamW lr {args.lr}, b1 0.9, b2 0.999, wd {args.weight_decay}, clip "
      f"{args.grad_clip}, constant schedule",
      "reps": args.reps,
      "gap_s": args.gap,
      "order": "per peer, one first call of each kind (full before train; the first is the "
      "cold first step, first_is_cold), not in the medians; then interleaved: one call per "
      "peer per kind per repetition, peer order rotated each repetition",
      "torch_threads": args.threads,
      "quick": args.quick,
      "dtype": "float32",
      "reward": "share of even token ids (same function in every peer)",
    },
    "notes": notes,
    "results": results,
    "profile_jaxrl": profile,
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {args.out}")
  return report


if __name__ == "__main__":
  main()
