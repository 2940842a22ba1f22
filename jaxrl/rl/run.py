"""A run's fixed parts, built once from the config, and the params-only restore.

`Run.build(cfg)` makes what every stage of a run reads and nothing that trains or samples:
the mesh and its rules, the tokenizer and prompt encoder, the model (config, graphdef, params
on the mesh), the task, the reward function and the held-out set. The sampler, the learner and
the SFT phase are built from a `Run`; export and evaluation need only a `Run` and
`restore_params`, which reads the params out of a checkpoint without building an optimizer,
an engine or a teacher.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl import distributed, memory, rewards
from jaxrl.checkpoint import Checkpointer
from jaxrl.config import Config, ConfigError
from jaxrl.data.stream import draw_pool, pooled_batches
from jaxrl.memory import MemoryEstimate
from jaxrl.mesh import Rules, get_rules, make_mesh, named_sharding, split_devices
from jaxrl.models.config import ModelConfig
from jaxrl.rewards.pool import RewardPool
from jaxrl.rl import components
from jaxrl.rollout.collect import left_pad

PHASES = ("sft", "rl")


@dataclasses.dataclass
class Run:
  """Everything fixed for the life of a run; `build` checks the config against the model."""

  cfg: Config
  workdir: Path
  tokenizer: Any
  encode_prompt: components.PromptEncoder
  mesh: jax.sharding.Mesh
  rules: Rules
  model_cfg: ModelConfig
  graphdef: Any
  init_params: Any  # the initial params on the mesh (preset draw, or the HF checkpoint)
  task: Any
  reward_fn: Callable
  held_out: list[dict]
  batch_sharding: jax.sharding.NamedSharding  # rows over the mesh's batch axes
  # rl.placement.kind='split': the sampler's sub-mesh ('mesh' is then the learner's); else None.
  sampler_mesh: jax.sharding.Mesh | None = None
  # rl.prompt_pool > 0: the fixed pool the RL phase draws its prompts from; else None.
  prompt_pool: list[dict] | None = None
  # reward.timeout_s > 0: the worker processes rewards are scored in; else None.
  reward_pool: RewardPool | None = None
  # What a device holds, estimated before the weights (jaxrl.memory), and its budget.
  memory: MemoryEstimate | None = None

  @classmethod
  def build(cls, cfg: Config, *, writes: bool = True) -> Run:
    """`writes=False`: a run that only reads its workdir (export, evaluation), which then need
    not be writable."""
    if writes:
      check_workdir(Path(cfg.workdir))
    tok = components.build_tokenizer(cfg.model)
    devices, sampler_mesh = jax.devices(), None
    if cfg.mesh.devices:
      if jax.process_count() > 1 or cfg.mesh.devices > len(devices):
        raise ConfigError(
          f"config.mesh.devices={cfg.mesh.devices} cannot be taken from the {len(devices)} "
          f"devices of {jax.process_count()} process(es); allowed: 0 (all), or 1 to "
          f"{len(devices)} in a one-process run"
        )
      devices = devices[: cfg.mesh.devices]
    if cfg.rl.placement.kind == "split":
      # The learner takes config.mesh's sizes over its share; the sampler replicates the
      # weights and splits its rows over all of its devices (decode reads every weight).
      try:
        devices, sampler_devices = split_devices(devices, cfg.rl.placement.sampler_fraction)
      except ValueError as e:
        raise ConfigError(f"config.rl.placement: {e}") from e
      if jax.process_count() > 1:
        # Each process gives a share of its own devices to each side: the learner's sub-mesh
        # spans the processes, and each process's sampler is an engine on its own devices
        # that samples its share of the prompts (jaxrl.rl.placement.ProcessShare).
        if cfg.rl.partial.enabled:
          raise ConfigError(
            "config.rl.partial.enabled=True is not supported with rl.placement.kind='split' "
            f"over {jax.process_count()} processes (each process's engine would hold its own "
            "groups in flight); allowed there: rl.placement.kind='colocated'"
          )
        sampler_devices = [d for d in sampler_devices if d.process_index == jax.process_index()]
      sampler_mesh = make_mesh(data=-1, fsdp=1, tensor=1, devices=sampler_devices)
    try:
      mesh = make_mesh(
        cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, expert=cfg.mesh.expert, devices=devices
      )
    except ValueError as e:
      raise ConfigError(f"config.mesh: {e}") from e
    rules = get_rules(cfg.mesh.rules)
    check_batches_divide(cfg, mesh, rules)
    # The task, its prompt template and the reward before the model: their errors come first.
    workdir = Path(cfg.workdir)
    task = components.build_task(cfg.task, workdir, seed=cfg.seed)
    held_out = task.held_out(cfg.eval.num_examples, seed=cfg.seed)
    encode_prompt = components.PromptEncoder(cfg.task, tok)
    pool = None
    if cfg.rl.prompt_pool:
      try:
        pool = draw_pool(task, cfg.rl.prompt_pool, seed=cfg.seed)
      except ValueError as e:
        raise ConfigError(f"config.rl.prompt_pool={cfg.rl.prompt_pool}: {e}") from e
    # The template fits the task's records, and its prompts and demonstrations fit: not mid-run.
    check_lengths(cfg, task, encode_prompt, held_out, pool)
    reward_fn = rewards.get(cfg.reward.name)
    if hasattr(reward_fn, "configured"):  # a code reward: its sandbox's limits
      reward_fn = components.sandboxed(reward_fn, cfg.reward.sandbox)
    # The model's config before its weights (seconds to minutes to draw or read): its errors
    # come before any weight is paid for.
    model_cfg = components.model_config(cfg.model, tok)
    rl = cfg.rl
    if rl.max_prompt_len + rl.max_new_tokens > model_cfg.max_seq_len:
      raise ConfigError(
        f"config.rl.max_prompt_len + config.rl.max_new_tokens = {rl.max_prompt_len} + "
        f"{rl.max_new_tokens} exceeds the model's max_seq_len={model_cfg.max_seq_len}"
      )
    if model_cfg.num_experts and model_cfg.num_experts % cfg.mesh.expert:
      raise ConfigError(
        f"config.mesh.expert={cfg.mesh.expert} is invalid; allowed: a divisor of the model's "
        f"{model_cfg.num_experts} experts"
      )
    if not model_cfg.num_experts:
      for name, coef in (
        ("rl.loss.load_balance_coef", rl.loss.load_balance_coef),
        ("rl.loss.router_z_coef", rl.loss.router_z_coef),
        ("sft.load_balance_coef", cfg.sft.load_balance_coef),
        ("sft.router_z_coef", cfg.sft.router_z_coef),
      ):
        if coef:
          raise ConfigError(
            f"config.{name}={coef} is invalid; allowed: 0 for a dense model (this model has no "
            "MoE layers)"
          )
      if cfg.mesh.expert != 1:
        raise ConfigError(
          f"config.mesh.expert={cfg.mesh.expert} is invalid; allowed: 1 for a dense model (this "
          "model has no experts to split)"
        )
      if rl.rollout.routes != "none":
        raise ConfigError(
          f"config.rl.rollout.routes={rl.rollout.routes!r} is invalid; allowed: 'none' for a "
          "dense model (this model has no MoE layers to route)"
        )
    # What each device will hold, before any weight: a config that cannot fit stops here.
    teacher_cfg = None
    if cfg.distill.enabled:
      teacher_cfg = components.teacher_config(cfg.distill.teacher, model_cfg)
    estimate = memory.estimate(cfg, model_cfg, mesh, rules, teacher_cfg=teacher_cfg)
    if cfg.memory.check and writes:  # a run that only reads its weights holds far less
      memory.check(estimate)
    if model_cfg.param_dtype != "float32" and (cfg.sft.steps or rl.steps):
      warnings.warn(
        f"config.model.param_dtype={model_cfg.param_dtype!r}: the optimizer updates "
        f"{model_cfg.param_dtype} weights, and an update under ~1/256 of a weight rounds away "
        f"(at rl.optim.learning_rate={rl.optim.learning_rate} most weights never move); "
        "param_dtype='float32' keeps float32 master weights and computes in model.dtype",
        stacklevel=2,
      )
    reward_pool = None
    if cfg.reward.timeout_s > 0:
      try:
        reward_pool = RewardPool(
          reward_fn, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s
        )
      except ValueError as e:
        raise ConfigError(f"config.reward.timeout_s={cfg.reward.timeout_s}: {e}") from e
    try:
      _, graphdef, params = components.build_model(cfg.model, tok, mesh, rules, seed=cfg.seed)
    except BaseException:
      if reward_pool is not None:
        reward_pool.close()
      raise
    return cls(
      cfg=cfg,
      workdir=workdir,
      tokenizer=tok,
      encode_prompt=encode_prompt,
      mesh=mesh,
      rules=rules,
      model_cfg=model_cfg,
      graphdef=graphdef,
      init_params=params,
      task=task,
      reward_fn=reward_fn,
      reward_pool=reward_pool,
      held_out=held_out,
      batch_sharding=named_sharding(mesh, ("batch",), rules),
      sampler_mesh=sampler_mesh,
      prompt_pool=pool,
      memory=estimate,
    )

  def rl_stream(self):
    """The RL phase's prompt batches (grain, checkpointable): the task's endless stream, or the
    fixed pool's epochs with rl.prompt_pool."""
    rl, seed = self.cfg.rl, self.cfg.seed
    if self.prompt_pool is None:
      return self.task.train_dataset(seed=seed, batch_size=rl.prompts_per_step)
    return pooled_batches(self.prompt_pool, seed=seed, batch_size=rl.prompts_per_step)

  # ------------------------------------------------------------------------- prompts and text

  def encode(self, records) -> list[list[int]]:
    """Prompt token ids of each record; a prompt longer than rl.max_prompt_len is an error."""
    limit = self.cfg.rl.max_prompt_len
    seqs = [self.encode_prompt(r) for r in records]
    for r, ids in zip(records, seqs, strict=True):
      if len(ids) > limit:
        text = self.encode_prompt.text(r)
        raise ConfigError(
          too_long("rl.max_prompt_len", limit, "the task's prompts", text, len(ids))
        )
    return seqs

  def prompts(self, records) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) [B, rl.max_prompt_len], left-padded."""
    return left_pad(self.encode(records), self.cfg.rl.max_prompt_len, self.tokenizer.pad_id)

  def completions(self, tokens, lengths) -> list[str]:
    return [self.tokenizer.decode(t[:n]) for t, n in zip(tokens, lengths, strict=True)]

  def score(self, texts: list[str], records, sample_ids=None, kinds=None) -> tuple[np.ndarray, int]:
    """(rewards [B], number of reward-function errors) of completions against their records;
    `sample_ids` name the samples in errors (default: their positions); errors are counted by
    kind into `kinds` (rewards.compute_rewards)."""
    cfg = self.cfg.reward
    ids = list(range(len(texts))) if sample_ids is None else list(sample_ids)

    def part(rows: range) -> tuple[np.ndarray, int, dict]:
      found: dict[str, int] = {}
      r, n_err = rewards.compute_rewards(
        self.reward_fn,
        [texts[i] for i in rows],
        [records[i] for i in rows],
        on_error=cfg.on_error,
        sample_ids=[ids[i] for i in rows],
        max_abs=cfg.max_abs,
        pool=self.reward_pool,
        kinds=found,
      )
      return r, n_err, found

    # Multi-process: each process scores its share of the completions; all get every reward.
    parts = distributed.gather_shares(part, len(texts))
    if kinds is not None:
      for _, _, found in parts:
        for kind, n in found.items():
          kinds[kind] = kinds.get(kind, 0) + n
    scored = np.concatenate([r for r, _, _ in parts]).astype(np.float32)
    return scored, sum(n for _, n, _ in parts)

  # ---------------------------------------------------------------------------- placement, seeds

  def seed(self, *parts: int) -> int:
    """An engine run seed (its request keys fold in request ids) derived from the run seed."""
    return int(np.random.SeedSequence([self.cfg.seed, *parts]).generate_state(1)[0] >> 1)

  def shard(self, tree) -> Any:
    """Place a batch pytree (host or device arrays) with its rows over the batch axes."""
    return distributed.put(tree, self.batch_sharding)

  def checkpointer(self, phase: str) -> Checkpointer:
    ck = self.cfg.checkpoint
    return Checkpointer(
      self.workdir / "checkpoints" / phase,
      max_to_keep=ck.max_to_keep,
      save_every=ck.every,
      async_save=ck.async_save,
    )


# Records of each training stream whose lengths are checked before the first step: the first
# ones, which the first steps train on (a synthetic stream has no end; a file may be long).
CHECKED_RECORDS = 2048
_WORKDIR = "a directory for the run's outputs (an existing one, or a path where one can be made)"


def check_workdir(workdir: Path) -> None:
  """config.workdir is a directory this process can write in, or a path where one can be made:
  checked before anything is built (the first write comes after the model, or mid-run), by
  creating and removing an empty directory in it or in its nearest existing ancestor
  (permission bits say nothing to root, nor of /proc or /sys)."""
  path = base = workdir.absolute()
  while not base.exists() and base != base.parent:
    base = base.parent
  if not base.is_dir():
    what = "exists" if base == path else f"is under {str(base)!r}, which exists"
    raise ConfigError(
      f"config.workdir={str(workdir)!r} {what} and is not a directory; allowed: {_WORKDIR}"
    )
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".jaxrl-write-check-", dir=base))
  except OSError as e:
    raise ConfigError(
      f"config.workdir={str(workdir)!r} cannot be written: no directory can be created in "
      f"{str(base)!r} ({e.strerror}); allowed: {_WORKDIR}"
    ) from None


def too_long(field: str, limit: int, what: str, text: str, n: int) -> str:
  """The message for a prompt or demonstration longer than config field `field` allows."""
  return f"config.{field}={limit} is shorter than {what}: {text!r} is {n} tokens"


def _head(dataset, n: int) -> list[dict]:
  """The first `n` records of a training stream (a dataset of lists of records)."""
  out = []
  for batch in dataset:
    out += batch[: n - len(out)]
    if len(out) >= n:
      break
  return out


def _longest(items: list, length) -> tuple[int, int]:
  """(index, length) of the first longest item."""
  lengths = [length(x) for x in items]
  i = int(np.argmax(lengths))
  return i, lengths[i]


def check_lengths(cfg: Config, task, encode_prompt, held_out: list[dict], pool) -> None:
  """Every prompt fits rl.max_prompt_len and every warm-start demonstration, with its EOS,
  rl.max_new_tokens; else a ConfigError naming the field and the longest one. Checked before
  the model is built, on the held-out records, the RL phase's prompts (its pool, or the first
  CHECKED_RECORDS records of its stream) and the warm-start's first CHECKED_RECORDS records
  (the stream jaxrl.rl.sft draws, with seed + 1). A later record that does not fit is refused
  when its batch is made."""
  rl, sft = cfg.rl, cfg.sft
  rl_prompts = pool
  if pool is None:  # the stream Run.rl_stream draws
    n = min(CHECKED_RECORDS, rl.steps * rl.prompts_per_step)
    rl_prompts = _head(task.train_dataset(seed=cfg.seed, batch_size=n), n)
  prompts, demos = [*held_out, *rl_prompts], []
  if sft.steps:
    sft_task = task.sft_task(sft)
    n = min(CHECKED_RECORDS, sft.steps * sft.batch_size)
    records = _head(sft_task.train_dataset(seed=cfg.seed + 1, batch_size=n), n)
    prompts += records
    demos = [sft_task.sft_completion(r) for r in records]
  i, n = _longest(prompts, lambda r: len(encode_prompt(r)))
  if n > rl.max_prompt_len:
    text = encode_prompt.text(prompts[i])
    raise ConfigError(
      too_long("rl.max_prompt_len", rl.max_prompt_len, "the task's prompts", text, n)
    )
  if demos:
    i, n = _longest(demos, lambda d: len(encode_prompt.tokenizer.encode(d)) + 1)  # + EOS
    if n > rl.max_new_tokens:
      what = "the warm-start's demonstrations (with their EOS)"
      raise ConfigError(too_long("rl.max_new_tokens", rl.max_new_tokens, what, demos[i], n))


def check_batches_divide(cfg: Config, mesh: jax.sharding.Mesh, rules: Rules) -> None:
  """The rows of every training batch are split over the mesh's batch axes, so they must divide
  evenly: checked before anything is built, naming the field (JAX's IndivisibleError names
  none, and in RL came only after the whole warm-start)."""
  n = mesh.devices.size
  dp = n // named_sharding(mesh, ("batch",), rules).shard_shape((n,))[0]
  if dp == 1:
    return
  shape = ", ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
  rl = cfg.rl
  rows = [("rl.prompts_per_step * rl.group_size / rl.num_minibatches",
           rl.prompts_per_step * rl.group_size // rl.num_minibatches)]  # fmt: skip
  if cfg.sft.steps:
    rows.insert(0, ("sft.batch_size", cfg.sft.batch_size))
  for name, count in rows:
    if count % dp:
      raise ConfigError(
        f"config.{name} = {count} rows is invalid; allowed: a multiple of {dp}, the devices "
        f"each batch is split over (mesh {shape}, rules {cfg.mesh.rules!r})"
      )


def abstract(tree) -> Any:
  """ShapeDtypeStructs with each array's sharding: a restore target laid out like `tree`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def restore_params(run: Run, phase: str = "latest") -> tuple[str, int, Any]:
  """(phase, step, params) of the newest checkpoint of `phase`: 'rl', 'sft' or 'latest' (RL if
  the run has any, else SFT), read into the run's param shardings.

  Only the params are read (the checkpoint's optimizer state, critic and RNG stay on disk), so
  export and evaluation build no optimizer, engine or teacher.
  """
  if phase not in (*PHASES, "latest"):
    raise ValueError(f"phase={phase!r} is invalid; allowed: 'rl', 'sft', 'latest'")
  directory = run.workdir / "checkpoints"
  steps = {}
  for name in PHASES:
    # Only look: a Checkpointer would create the directory of a phase that never ran.
    if (directory / name).is_dir():
      with run.checkpointer(name) as ck:
        steps[name] = ck.latest_step()
    else:
      steps[name] = None
  if phase == "latest":
    phase = "rl" if steps["rl"] is not None else "sft"
  if steps[phase] is None:
    found = ", ".join(f"{name} (step {s})" for name, s in steps.items() if s is not None)
    raise FileNotFoundError(
      f"no {phase} checkpoint in {directory}; checkpointed phases: {found or 'none'}"
    )
  with run.checkpointer(phase) as ck:
    restored = ck.restore_subtree(steps[phase], {"train": {"params": abstract(run.init_params)}})
  return phase, steps[phase], restored["train"]["params"]
