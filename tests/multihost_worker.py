"""One process of tests/multihost_test.py, doing one of three independent jobs (so that the
test's two workers can run them side by side):

--job=core: join the run, build the tiny model on a 4-device mesh (fsdp over every device, so
params and the batch are split across the processes), supply only this process's rows of a
16-row GRPO batch, take two train steps, write what it saw. With --hf, first load that HF
checkpoint onto the same mesh, counting what this process reads of it. With --jsonl, index
DIR/good.jsonl as a JSONL task and read batches and held-out records from it, noting which bytes
this process scanned and how many records it read, then index DIR/bad.jsonl (one bad line); then
the same for DIR/good.parquet and DIR/bad.parquet, noting which row groups it read. Then gather
shares of a list across the processes, one process failing on its share. With several
processes, checkpoints of the params in OUT/ckpt, the newest two made unreadable (one for every
process, one for process 1 only), and the newest readable one restored by every process.

--job=trainer: run the default job's `:smoke` (4 SFT steps, 2 RL steps with an entropy bonus,
so every step has a gradient) in --workdir, every process in the same one, counting the training
records this process made and the completions it scored; with several processes, the same job
again in WORKDIR_resumed, through launch.train with SIGTERM sent to process 1 alone during the
first RL step, then resumed. Then three exchanges between the processes, one larger than a
key-value entry, and the exchange keys left behind.

--job=split: the same job with the split placement in --workdir (and, with several processes,
WORKDIR_resumed, through launch.train with SIGTERM sent to process 0 during the first RL step
and to process 1 during the second, then resumed).

  python tests/multihost_worker.py --job=core|trainer|split --out=DIR
                                   [--coordinator=HOST:PORT --num-processes=N]
                                   [--hf=CHECKPOINT_DIR] [--jsonl=DIR] [--workdir=WORKDIR]
  (the process index comes from JAXRL_PROCESS_ID; XLA_FLAGS sets the devices per process)
"""

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py

from jaxrl import distributed  # noqa: E402  (before anything else touches jax's devices)

ROWS, LENGTH = 16, 12
# The trainer jobs run the default job's `:smoke` as a user would: its own model (not the suite's
# tiny one), every device of every process, progress bars and TensorBoard, which
# smoke_configdict's test defaults turn off.
AS_SMOKE = {
  "model": {"preset": "arith_small"},
  "mesh": {"devices": 0},
  "log": {"progress": True, "tensorboard": True},
}


def _row(i: int, vocab: int) -> dict:
  """Row i of the global batch, drawn from its own seed: a process makes only the rows it owns."""
  import numpy as np

  rng = np.random.default_rng([7, i])
  loss_mask = np.zeros(LENGTH, np.float32)
  loss_mask[6:] = 1.0
  valid = np.ones(LENGTH, bool)
  if i % 3 == 0:
    valid[:2] = False  # left padding
  return {
    "tokens": rng.integers(3, vocab, LENGTH).astype(np.int32),
    "valid": valid,
    "loss_mask": loss_mask,
    "advantages": (rng.normal() * loss_mask).astype(np.float32),
    "old_logprobs": ((-3.0 + 0.3 * rng.normal(size=LENGTH)) * loss_mask).astype(np.float32),
    "ref_logprobs": ((-3.0 + 0.3 * rng.normal(size=LENGTH)) * loss_mask).astype(np.float32),
    "versions": np.zeros(LENGTH, np.int32),
  }


def _every_process_writes_the_compilation_cache() -> None:
  """Let every process write the suite's persistent compilation cache, as process 0 does.

  JAX writes entries from process 0 only, and a process's cache keys name its own devices, so
  process 1 never finds an entry it could use: it compiled every program of every Trainer it
  built (the stopped and resumed runs three times over) while process 0 loaded them, and
  process 0 waited at the next collective. An entry is the executable a fresh compile of the
  same key gives, so this changes how long the processes take, not what they run."""
  from jax._src import compiler
  from jax._src import distributed as jax_distributed

  write = getattr(compiler, "_cache_write", None)
  if write is None:  # another JAX: each process compiles for itself, as before
    return

  def write_from_any_process(*args, **kwargs):
    state = jax_distributed.global_state
    me, state.process_id = state.process_id, 0
    try:
      return write(*args, **kwargs)
    finally:
      state.process_id = me

  compiler._cache_write = write_from_any_process


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--job", required=True, choices=("core", "trainer", "split"))
  ap.add_argument("--out", required=True)
  ap.add_argument("--coordinator", default="")
  ap.add_argument("--num-processes", type=int, default=1)
  ap.add_argument("--hf", default="")
  ap.add_argument("--jsonl", default="")
  ap.add_argument("--workdir", default="")
  args = ap.parse_args()
  joined = distributed.initialize(args.coordinator, args.num_processes)
  _every_process_writes_the_compilation_cache()

  import jax

  seen = {
    "out": str(Path(args.out).resolve()),
    "joined": joined,
    "process_count": jax.process_count(),
    "devices": jax.device_count(),
    "local_devices": jax.local_device_count(),
  }
  several = jax.process_count() > 1
  if args.job == "core":
    seen |= _core(args.hf, args.jsonl, Path(args.out) / "ckpt" if several else None)
  elif args.job == "trainer":
    seen["work"] = _trainer(args.workdir)
    if several:  # the same job, SIGTERM at process 1 only during RL step 1, then resumed
      seen["preempted"] = _trainer(args.workdir + "_resumed", signals={1: 0})
    seen["exchange"] = _exchange()
  else:
    seen["split_run"] = _split(args.workdir)
    if several:  # SIGTERM at process 0 during RL step 1 and at process 1 during step 2
      seen["preempted"] = _split(args.workdir + "_resumed", signals={0: 0, 1: 1})
  out = Path(args.out) / f"p{jax.process_index()}.json"
  out.write_text(json.dumps(seen))


def _core(hf_dir: str, files_dir: str, ckpt_dir: Path | None) -> dict:
  """The train steps on the 4-device mesh, the HF load, the JSONL and Parquet reads, the shares,
  and with `ckpt_dir` the fallback from unreadable checkpoints of the params."""
  import jax
  import numpy as np
  import optax

  from jaxrl.config import KLConfig
  from jaxrl.mesh import get_rules, make_mesh, named_sharding, shard_params
  from jaxrl.models import ModelConfig
  from jaxrl.models.transformer import make_model
  from jaxrl.rl.batch import TrainBatch
  from jaxrl.rl.objectives import PolicyLoss
  from jaxrl.rl.train_step import Optimizer, init_state, make_train_step

  hf = _load_hf(hf_dir) if hf_dir else None
  cfg = ModelConfig.tiny()
  graphdef, params = make_model(cfg, seed=3)
  init = jax.tree.map(np.asarray, params)
  rules = get_rules("fsdp_tp")
  mesh = make_mesh(data=1, fsdp=-1, tensor=1)
  params = shard_params(params, mesh, rules)
  sharding = named_sharding(mesh, ("batch",), rules)
  rows = distributed.process_rows(sharding, ROWS)
  mine = [_row(int(i), cfg.vocab_size) for i in rows]
  local = TrainBatch(**{k: np.stack([r[k] for r in mine]) for k in mine[0]})
  batch = distributed.put_process_local(local, sharding, ROWS)
  opt = Optimizer(optax.sgd(0.5), lambda s: 0.5)
  step = make_train_step(opt, PolicyLoss(graphdef, kl=KLConfig(beta=0.1)), num_microbatches=2)
  state = init_state(params, opt)
  metrics = []
  for _ in range(2):
    state, m = step(state, batch)
    metrics.append({k: float(v) for k, v in distributed.to_host(m).items()})
  final = distributed.to_host(state.params)
  deltas = {
    jax.tree_util.keystr(path): (np.asarray(b, np.float64) - a).tolist()
    for (path, a), b in zip(
      jax.tree_util.tree_flatten_with_path(init)[0], jax.tree.leaves(final), strict=True
    )
  }
  split = sum(not x.is_fully_addressable for x in jax.tree.leaves(state.params))
  files = _jsonl(files_dir) if files_dir else None
  tables = _parquet(files_dir) if files_dir else None
  fallback = _fallback(ckpt_dir, state.params) if ckpt_dir else None
  shares = distributed.gather_shares(lambda rows: [(jax.process_index(), i) for i in rows], 5)
  try:  # process 1 fails on its share: every process must raise, none wait forever
    distributed.gather_shares(lambda rows: [1 / (jax.process_index() != 1)], 5)
    failure = None
  except Exception as e:
    failure = f"{type(e).__name__}: {e}"
  return {
    "rows": rows.tolist(),
    "params_split_across_processes": split,
    "metrics": metrics,
    "deltas": deltas,
    "compiles": step._cache_size(),
    "hf": hf,
    "jsonl": files,
    "parquet": tables,
    "shares": shares,
    "failure": failure,
    "fallback": fallback,
  }


def _load_hf(path: str) -> dict:
  """Load the checkpoint onto a 4-device fsdp mesh; what this process read of its tensors, what
  its devices hold (distinct blocks), and a hash of every param gathered whole."""
  import hashlib

  import jax
  import numpy as np
  from helpers import counting_hf_reads, distinct_block_elements

  from jaxrl.mesh import get_rules, make_mesh
  from jaxrl.models import hf

  with counting_hf_reads() as calls:
    _, _, params = hf.load_hf_checkpoint(
      path, mesh=make_mesh(data=1, fsdp=-1, tensor=1), rules=get_rules("fsdp_tp")
    )
  leaves = jax.tree.leaves(params)
  hashes = [hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
            for a in distributed.to_host(leaves)]  # fmt: skip
  return {
    "read": sum(read for read, _ in calls),
    "held": sum(distinct_block_elements(x, addressable=True) for x in leaves),
    "total": sum(x.size for x in leaves),
    "split": sum(not x.is_fully_addressable for x in leaves),
    "hashes": hashes,
  }


def _jsonl(folder: str) -> dict:
  """What this process scanned and read of a JSONL task's file, and what it got from it."""
  from jaxrl.data import jsonl

  scans, read = [], []
  scan, rows_read = jsonl._scan, jsonl._Rows.read

  def counting_scan(path, span, check):
    found = scan(path, span, check)
    scans.append([span.start, span.stop, found["owned"]])
    return found

  def counting_read(self, js):
    read.extend(int(j) for j in js)
    return rows_read(self, js)

  jsonl._scan, jsonl._Rows.read = counting_scan, counting_read
  try:
    got = _use(folder, "jsonl")
  finally:
    jsonl._scan, jsonl._Rows.read = scan, rows_read
  return {"scans": scans, "read": read, **got}


def _use(folder: str, ext: str) -> dict:
  """Three batches and four held-out prompts from good.EXT, and the error bad.EXT gives."""
  from jaxrl.data.jsonl import JsonlTask

  task = JsonlTask(str(Path(folder) / f"good.{ext}"), held_out_fraction=0.25)
  it = iter(task.train_dataset(seed=0, batch_size=6))
  batches = [[r["prompt"] for r in next(it)] for _ in range(3)]
  held = [r["prompt"] for r in task.held_out(4, seed=1)]
  try:
    JsonlTask(str(Path(folder) / f"bad.{ext}"))
    error = None
  except Exception as e:
    error = f"{type(e).__name__}: {e}"
  return {"batches": batches, "held": held, "error": error}


def _parquet(folder: str) -> dict:
  """The same for the Parquet copies: which row groups each scan of this process read."""
  import pyarrow.parquet as pq

  from jaxrl.data import jsonl

  scans, scan = [], jsonl._scan_parquet
  read_group, batches = pq.ParquetFile.read_row_group, pq.ParquetFile.iter_batches
  groups: list[int] = []

  def counting_scan(path, share, check):
    before = len(groups)
    found = scan(path, share, check)
    scans.append([share.start, share.stop, groups[before:]])
    return found

  def counting_read_group(self, g, *args, **kwargs):
    groups.append(int(g))
    return read_group(self, g, *args, **kwargs)

  def counting_batches(self, *args, row_groups, **kwargs):
    groups.extend(int(g) for g in row_groups)
    return batches(self, *args, row_groups=row_groups, **kwargs)

  jsonl._scan_parquet = counting_scan
  pq.ParquetFile.read_row_group, pq.ParquetFile.iter_batches = counting_read_group, counting_batches
  try:
    got = _use(folder, "parquet")
  finally:
    jsonl._scan_parquet = scan
    pq.ParquetFile.read_row_group, pq.ParquetFile.iter_batches = read_group, batches
  return {"scans": scans, **got}


def _fallback(directory: Path, params) -> dict:
  """`params` (split over both processes' devices) saved as steps 1 to 4 (step s adds s to
  every leaf). Then process 0 (the others waiting) loses step 4's array data and the data
  process 1 wrote of step 3, and every process restores the newest readable step into a fresh
  Checkpointer: which step, a hash of what it restored gathered whole against that of each step
  saved, what it logged or raised, and what the directories hold after."""
  import hashlib
  import shutil

  import jax

  from jaxrl.checkpoint import Checkpointer
  from jaxrl.rl.run import abstract

  def digest(tree) -> str:
    leaves = distributed.to_host(jax.tree.leaves(tree))
    return hashlib.sha256(b"".join(a.tobytes() for a in leaves)).hexdigest()

  hashes = {}
  with Checkpointer(directory, max_to_keep=None) as ckpt:
    for step in (1, 2, 3, 4):
      tree = jax.tree.map(lambda x, s=step: x + s, params)
      ckpt.save(step, tree, {"step": step})
      hashes[step] = digest(tree)
  distributed.allgather_objects("saved")  # a barrier: every process's writes are committed
  if jax.process_index() == 0:
    for part in (directory / "4" / "state").iterdir():  # every process's arrays
      if part.is_dir():
        shutil.rmtree(part)
    shutil.rmtree(directory / "3" / "state" / "ocdbt.process_1")  # process 1's shards only
  distributed.allgather_objects("lost")
  logged, got = [], {"step": None, "error": None}
  with Checkpointer(directory) as ckpt:
    try:
      step, state, meta = ckpt.restore_newest_readable(abstract(params), log=logged.append)
      got |= {"step": step, "meta": meta, "hash": digest(state)}
    except Exception as e:
      got["error"] = f"{type(e).__name__}: {e}"
  distributed.allgather_objects("restored")
  aside = directory.with_name(directory.name + ".unreadable")
  return {
    **got,
    "saved": {str(k): v for k, v in hashes.items()},
    "logged": logged,
    "steps": sorted(p.name for p in directory.iterdir() if p.name.isdigit()),
    "aside": sorted(p.name for p in aside.iterdir()) if aside.is_dir() else None,
    "aside_step_3": sorted(p.name for p in (aside / "3" / "state").glob("*")),
  }


def _stopped_by_sigterm(c, signals: dict[int, int]) -> dict:
  """launch.train's `main` running config `c` (in place of its --config), SIGTERM sent to this
  process as RL step signals[process] (0-based) starts, if it has one: its exit code, the steps
  at which the signal was sent, what it printed of the stop, and the RL checkpoints after it."""
  import jax

  from jaxrl.rl.loop import Trainer
  from launch import train as launch_train

  at, sent = signals.get(jax.process_index()), []
  rl_step, config = Trainer.rl_step, launch_train._CONFIG

  def signalled_rl_step(self, step):
    if step == at:
      sent.append(step)
      os.kill(os.getpid(), signal.SIGTERM)  # handled here, before the step's work
    return rl_step(self, step)

  Trainer.rl_step, launch_train._CONFIG = signalled_rl_step, types.SimpleNamespace(value=c)
  err, code = io.StringIO(), 0
  try:
    with contextlib.redirect_stderr(err):
      launch_train.main(["train"])
  except SystemExit as e:
    code = e.code
  finally:
    Trainer.rl_step, launch_train._CONFIG = rl_step, config
    sys.stderr.write(err.getvalue())
  rl = Path(c.workdir) / "checkpoints" / "rl"
  return {
    "exit": code,
    "sent": sent,
    "said": [line for line in err.getvalue().splitlines() if "stopped on SIGTERM" in line],
    "rl_checkpoints": sorted(int(p.name) for p in rl.iterdir() if p.name.isdigit()),
  }


def _resume_log(logged: list):
  """A Trainer's log that prints each line, as the default one does, and keeps it."""

  def log(line):
    logged.append(line)
    print(line)

  return log


def _trainer(workdir: str, signals: dict[int, int] | None = None) -> dict:
  """Run the smoke job: how many training records this process made (SFT's and RL's prompt
  batches) and how many completions it scored (RL's and evaluation's). With `signals`, a first
  try is stopped by SIGTERM (`_stopped_by_sigterm`) and a new Trainer resumes it: what the try
  did, and what the resumed run logged."""

  from fixtures import smoke_configdict

  from jaxrl import rewards
  from jaxrl.config import validate
  from jaxrl.data.arithmetic import ArithmeticTask
  from jaxrl.rl.loop import Trainer

  counts = {"records": 0, "scored": 0}
  sample, compute = ArithmeticTask.sample, rewards.compute_rewards

  def counting_sample(self, rng, *, split="train"):
    counts["records"] += split == "train"
    return sample(self, rng, split=split)

  def counting_compute(fn, completions, records, **kw):
    counts["scored"] += len(completions)
    return compute(fn, completions, records, **kw)

  ArithmeticTask.sample, rewards.compute_rewards = counting_sample, counting_compute
  c = smoke_configdict(
    workdir, sft={"steps": 4}, rl={"steps": 2, "loss": {"entropy_coef": 0.01}}, **AS_SMOKE
  )
  seen, logged = {}, []
  try:
    if signals:
      seen["stopped"] = _stopped_by_sigterm(c, signals)
    trainer = Trainer(validate(c), log=_resume_log(logged))
    try:
      trainer.run()
    finally:
      trainer.close()
  finally:
    ArithmeticTask.sample, rewards.compute_rewards = sample, compute
  return {**counts, **seen, "logged": logged} if signals else counts


def _exchange() -> dict:
  """Three more exchanges, the middle one of 3 MiB from each process (more than one key-value
  entry's chunk): what each process got, and the exchange keys the coordinator holds after a
  barrier (each process deletes its part of an exchange at its next one)."""
  import jax
  from jax._src import distributed as jax_distributed

  me, got = jax.process_index(), []
  for i in range(3):
    payload = bytes([me + 1]) * (3 << 20) if i == 1 else b""
    every = distributed.allgather_objects((i, me, payload))
    got.append([[j, p, len(b), sorted(set(b))] for j, p, b in every])
  if jax.process_count() == 1:
    return {"got": got, "left": []}
  client = jax_distributed.global_state.client
  client.wait_at_barrier("jaxrl-test-exchange", 60_000)
  left = client.key_value_dir_get_bytes("jaxrl/exchange/")
  return {"got": got, "left": sorted({k.split("/")[2] for k, _ in left})}


def _split(workdir: str, signals: dict[int, int] | None = None) -> dict:
  """The smoke job with the split placement (max_staleness 1, 3 RL steps; `signals` as in
  `_trainer`): which processes' devices each sub-mesh holds, and how many of this process's
  devices each side has."""
  import jax
  from fixtures import smoke_configdict

  from jaxrl.config import validate
  from jaxrl.rl.loop import Trainer

  c = smoke_configdict(
    workdir,
    sft={"steps": 4},
    rl={
      "steps": 3,
      "loss": {"entropy_coef": 0.01},
      "placement": {"kind": "split", "max_staleness": 1},
    },
    **AS_SMOKE,
  )
  seen = {}
  if jax.process_count() > 1 and signals is None:  # groups in flight per engine: refused
    from jaxrl.config import ConfigError
    from jaxrl.rl.run import Run

    partial = c.copy_and_resolve_references()
    partial.rl.partial.enabled, partial.workdir = True, workdir + "_partial"
    try:
      Run.build(validate(partial))
    except ConfigError as e:
      seen["partial_error"] = str(e)
  logged = []
  if signals:
    seen["stopped"], seen["logged"] = _stopped_by_sigterm(c, signals), logged
  trainer = Trainer(validate(c), log=_resume_log(logged))
  try:
    for side, mesh in (("learner", trainer.ctx.mesh), ("sampler", trainer.ctx.sampler_mesh)):
      devices = list(mesh.devices.flat)
      seen[side] = {
        "processes": sorted({d.process_index for d in devices}),
        "local": sum(d.process_index == jax.process_index() for d in devices),
      }
    seen["lockstep"] = trainer.pipeline.lockstep
    trainer.run()
  finally:
    trainer.close()
  return seen


if __name__ == "__main__":
  main()
