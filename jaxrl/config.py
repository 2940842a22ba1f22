"""Typed, validated views of ml_collections ConfigDicts: a bad value names its field and range."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import types
import typing
from typing import Any

# Re-exported: `jaxrl.config` stays the one import for every section, the error and the checks.
from jaxrl.config_fields import LOSS_AGGREGATIONS, ConfigError, check  # noqa: F401
from jaxrl.config_fields import option as _field
from jaxrl.config_model import MemoryConfig, MeshConfig, ModelSection  # noqa: F401
from jaxrl.config_reward import RewardConfig, SandboxConfig  # noqa: F401
from jaxrl.config_rl import (  # noqa: F401
  AllocationConfig,
  CriticConfig,
  DynamicSamplingConfig,
  KLConfig,
  OffPolicyConfig,
  OptimConfig,
  OverlongConfig,
  PartialConfig,
  PlacementConfig,
  PolicyLossConfig,
  PromptFilterConfig,
  ReplayConfig,
  RLConfig,
  RolloutConfig,
  SamplingConfig,
  check_rl,
)
from jaxrl.kernels import KERNELS, backend_problem
from jaxrl.registry import ADVANTAGES, REWARDS


def config_module(path: str | os.PathLike) -> types.ModuleType:
  """Import a configs/*.py file by path (configs/ is not a package): its `get_config(arg)` builds
  the ConfigDict. Configs that extend another one load it this way."""
  path = os.fspath(path)
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  name: str = _field(
    "arithmetic",
    choices=("arithmetic", "chain", "functions", "jsonl", "word_problems"),
    help="the prompt source (chain: sums of a heavy-tailed number of digits, long-tailed "
    "completions; functions: write f(x) from examples, run against tests in the sandbox)",
  )
  path: str = _field("", help="name='jsonl': the training JSONL/Parquet file")
  held_out_path: str = _field("", help="name='jsonl': a held-out file ('' = held_out_fraction)")
  prompt_field: str = _field("question", help="name='jsonl': the record field holding the question")
  answer_field: str = _field(
    "answer", help="name='jsonl': the record field holding the reference solution"
  )
  answer_format: str = _field(
    "gsm8k",
    choices=("gsm8k", "raw"),
    help="name='jsonl': gsm8k = the final answer follows '####'; raw = the whole field",
  )
  num_problems: int = _field(2000, lo=1, help="name='word_problems': problems generated")
  max_coef: int = _field(
    9, lo=1, hi=99, help="name='functions': coefficients of f are integers in [-max_coef, max_coef]"
  )
  max_degree: int = _field(1, lo=1, hi=2, help="name='functions': f is linear (1) or quadratic (2)")
  prompt_template: str = _field("{prompt}", help="str.format over the record's fields")
  chat: bool = _field(False, help="render the prompt through the tokenizer's chat template")
  system_prompt: str = _field("", help="chat=True: a system message ('' = none)")
  max_digits: int = _field(
    2, lo=1, hi=9, help="name='arithmetic': operands have up to this many digits"
  )
  ops: str = _field("+-", help="characters from '+-*'")
  held_out_fraction: float = _field(
    0.1,
    lo=0.0,
    hi=1.0,
    lo_open=True,
    help="share of problems never trained on (held-out evaluation)",
  )
  allow_negative: bool = _field(False, help="name='arithmetic': allow negative answers")
  min_terms: int = _field(2, lo=2, help="name='chain': the fewest digits summed")
  max_terms: int = _field(10, lo=2, help="name='chain': the most digits summed")
  tail: float = _field(
    2.0, lo=0.0, help="name='chain': P(k terms) ~ k**-tail (larger: a thinner long tail)"
  )
  operand_dist: str = _field(
    "uniform",
    choices=("uniform", "by_digits"),
    help="name='arithmetic': uniform operands, or uniform over digit counts",
  )


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  steps: int = _field(300, lo=0, help="warm-start steps (0 = none)")
  batch_size: int = _field(64, lo=1, help="demonstrations per step")
  learning_rate: float = _field(
    1e-3, lo=0.0, lo_open=True, help="peak AdamW rate (cosine decay to 10%)"
  )
  warmup_steps: int = _field(20, lo=0, help="linear warmup")
  weight_decay: float = _field(0.0, lo=0.0, help="AdamW's decoupled weight decay")
  b2: float = _field(0.999, lo=0.0, hi=1.0, lo_open=True, help="Adam's second-moment decay")
  grad_clip: float = _field(1.0, lo=0.0, help="global-norm clip before Adam; 0 = off")
  num_microbatches: int = _field(1, lo=1, help="gradient accumulation within one step")
  load_balance_coef: float = _field(
    0.0, lo=0.0, help="MoE models: Switch-Transformer load-balancing loss weight (0 = off)"
  )
  router_z_coef: float = _field(0.0, lo=0.0, help="MoE models: ST-MoE router z-loss weight")
  operand_dist: str = _field(
    "by_digits",
    choices=("uniform", "by_digits"),
    help="the warm-start's own problem mix; by_digits over-weights short operands (a curriculum)",
  )
  careless_rate: float = _field(
    0.0,
    lo=0.0,
    hi=1.0,
    help="task.name='arithmetic': the share of warm-start demonstrations of problems that need a "
    "carry or borrow written by a careless teacher who forgets it (27+15=32); RL's reward and "
    "the held-out set keep the true answers",
  )
  tool_rate: float = _field(
    0.0,
    lo=0.0,
    hi=1.0,
    help="task.name='arithmetic': the share of warm-start demonstrations written with a "
    "calculator call, '<<123*45=5535>>5535' (the call, the tool's answer, the answer), for "
    "rl.rollout.env='calculator'",
  )


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
  """The distillation teacher: an HF checkpoint directory (any family jaxrl loads; export a jaxrl
  run with `python -m launch.export`), or a preset initialised from `seed` (random weights: only
  for pipeline checks such as the smoke configs). It must share the student's vocabulary."""

  path: str = _field("", help="an HF checkpoint directory (config.json + safetensors)")
  preset: str = _field("", help="without path: a jaxrl.models.config preset, random init")
  seed: int = _field(0, lo=0, help="preset teachers: the init seed")
  dtype: str = _field(
    "float32", choices=("float32", "bfloat16"), help="the teacher's weights and activations"
  )


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """On-policy distillation (jaxrl.rl.distill): when enabled, the RL phase trains the student on
  its own samples against the teacher's per-token log-probs instead of on rewards."""

  enabled: bool = _field(False, help="train on the teacher's log-probs instead of rewards")
  teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
  loss: str = _field(
    "reverse_kl",
    choices=("reverse_kl", "forward_kl_topk", "mixed"),
    help="reverse KL on the sampled tokens, forward KL on the teacher's top-k, or a mix",
  )
  alpha: float = _field(0.5, lo=0.0, hi=1.0, help="loss='mixed': weight of the reverse KL")
  top_k: int = _field(16, lo=1, help="teacher top-k kept for the forward KL")
  window: int = _field(0, lo=0, help="supervise only the first `window` completion tokens; 0 = all")
  adaptive: bool = _field(False, help="ADWIN: adapt the window from gradient-alignment probes")
  probe_every: int = _field(10, lo=1, help="adaptive: RL steps between probes")
  align_low: float = _field(0.8, lo=-1.0, hi=1.0, help="adaptive: below this the window doubles")
  align_high: float = _field(0.95, lo=-1.0, hi=1.0, help="adaptive: above this it halves")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every: int = _field(10, lo=0, help="0 = only before and after RL")
  num_examples: int = _field(256, lo=1, help="held-out prompts, decoded greedily all at once")
  num_samples: int = _field(
    0,
    lo=0,
    help="also sample this many completions per held-out prompt at rl.sampling.temperature: "
    "eval/sampled_accuracy, the expected reward RL maximises (greedy accuracy can sit at its "
    "ceiling while it still moves), and unbiased eval/pass@k for k = 1, 2, 4, ... and this "
    "many (a pass: the full reward); 0 = off",
  )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = _field(25, lo=1, help="steps between checkpoints (the last step is always saved)")
  max_to_keep: int = _field(2, lo=1, help="newest checkpoints kept per phase")
  async_save: bool = _field(
    True,
    help="write checkpoints in the background: training goes on while a host copy of the "
    "state (params and optimizer) is written; False writes before the next step, so that "
    "copy never sits beside a step's working set (where memory is tight)",
  )


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  """Non-finite numbers (jaxrl.guard): an optimizer update whose loss, gradient or update holds
  a NaN or inf is skipped (params and optimizer state unchanged) and counted."""

  max_nonfinite_updates: int = _field(
    10,
    lo=1,
    help="consecutive skipped updates after which the run stops with an error; checkpoints "
    "only ever hold finite states",
  )


@dataclasses.dataclass(frozen=True)
class LogConfig:
  progress: bool = _field(True, help="progress bars on stderr")
  tensorboard: bool = _field(True, help="also write TensorBoard events under workdir/tb")
  wandb_project: str = _field(
    "", help="also log to this Weights & Biases project (needs `pip install wandb`); '' = off"
  )
  profile_steps: int = _field(
    0,
    lo=0,
    help="trace this many RL steps with jax.profiler into workdir/profile (TensorBoard's "
    "profile plugin or Perfetto reads it); 0 = off",
  )
  profile_from: int = _field(
    2, lo=0, help="log.profile_steps > 0: the RL step the trace starts at (after the compiles)"
  )


@dataclasses.dataclass(frozen=True)
class Config:
  seed: int = _field(
    0,
    lo=0,
    help="model init, data order and sampling: the same seed repeats a run on one CPU type",
  )
  workdir: str = _field(
    "runs/grpo_arith", help="metrics, checkpoints, plots and summary.json go here"
  )
  resume: bool = _field(True, help="continue from the latest checkpoint in workdir if any")
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
  model: ModelSection = dataclasses.field(default_factory=ModelSection)
  task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
  sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
  rl: RLConfig = dataclasses.field(default_factory=RLConfig)
  distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  guard: GuardConfig = dataclasses.field(default_factory=GuardConfig)
  log: LogConfig = dataclasses.field(default_factory=LogConfig)


def _to_dict(cfg) -> dict:
  if hasattr(cfg, "to_dict"):
    return cfg.to_dict()
  if dataclasses.is_dataclass(cfg):
    return dataclasses.asdict(cfg)
  return dict(cfg)


def _convert(cls, raw: dict, prefix: str):
  hints = typing.get_type_hints(cls)
  names = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(raw) - set(names))
  if unknown:
    where = f"config.{prefix}" if prefix else "config"
    raise ConfigError(
      f"unknown field(s) {', '.join(f'{where}.{u}'.strip('.') for u in unknown)}; "
      f"valid fields of {where}: {sorted(names)}"
    )
  kwargs = {}
  for name, f in names.items():
    path = f"{prefix}.{name}" if prefix else name
    typ = hints[name]
    if name not in raw:
      continue
    value = raw[name]
    if dataclasses.is_dataclass(typ):
      if not isinstance(value, dict):
        raise ConfigError(f"config.{path} must be a section (dict), got {value!r}")
      kwargs[name] = _convert(typ, value, path)
      continue
    kwargs[name] = _check_value(path, value, typ, f.metadata)
  return cls(**kwargs)


def _check_value(path: str, value: Any, typ, meta) -> Any:
  if isinstance(typ, types.UnionType):
    typ = next(t for t in typing.get_args(typ) if t is not type(None))
  if typ is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
  if not ok:
    raise ConfigError(f"config.{path} must be {typ.__name__}, got {type(value).__name__} {value!r}")
  if typ is float and not math.isfinite(value):
    raise ConfigError(f"config.{path} must be finite, got {value!r}")
  lo, hi, lo_open, choices = (
    meta.get("lo"),
    meta.get("hi"),
    meta.get("lo_open"),
    meta.get("choices"),
  )
  if choices is not None and value not in choices:
    raise ConfigError(f"config.{path}={value!r} is invalid; allowed: {list(choices)}")
  registry = meta.get("registry")
  if registry is not None and value not in registry:
    raise ConfigError(f"config.{path}={value!r} is invalid; allowed: {registry.names()}")
  if lo is not None and (value < lo or (lo_open and value == lo)):
    bound = f"> {lo}" if lo_open else f">= {lo}"
    raise ConfigError(f"config.{path}={value!r} is out of range; must be {bound}")
  if hi is not None and value > hi:
    raise ConfigError(f"config.{path}={value!r} is out of range; must be <= {hi}")
  return value


def field_default(f: dataclasses.Field):
  """A dataclass field's default value (calling its default_factory if it has one)."""
  return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def field_paths(cls=None, prefix: str = "") -> dict[str, bool]:
  """Every field of `Config` by dotted path ("rl.rollout.batching"), True for a section."""
  cls = Config if cls is None else cls
  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    path = f"{prefix}{f.name}"
    section = dataclasses.is_dataclass(hints[f.name])
    out[path] = section
    if section:
      out.update(field_paths(hints[f.name], f"{path}."))
  return out


def complete(cfg):
  """Fill every `Config` field a config file's ConfigDict leaves out with its default, in place,
  and return it. A config file ends with `return complete(c)`: config flags can only override
  fields the ConfigDict holds, so without it `--config.model.lora_rank=16` fails for a config
  that never mentions LoRA. Values the file sets are kept; a section set to something other than
  a dict is left for `validate` to report."""
  import ml_collections

  def fill(cls, node):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      typ = hints[f.name]
      if dataclasses.is_dataclass(typ):
        if f.name not in node:
          node[f.name] = ml_collections.ConfigDict()
        if isinstance(node[f.name], ml_collections.ConfigDict):
          fill(typ, node[f.name])
      elif f.name not in node:
        node[f.name] = field_default(f)

  with cfg.unlocked():
    fill(Config, cfg)
  return cfg


def unknown_field_message(path: str) -> str | None:
  """None if `path` ("rl.kl.beta") is a field or section of `Config`; otherwise an error naming
  the full path and the closest valid ones: a near spelling in the same section, the same name
  in another section, or else the section's fields."""
  paths = field_paths()
  if path in paths:
    return None
  parent = path.rpartition(".")[0]
  while parent and not paths.get(parent, False):
    parent = parent.rpartition(".")[0]
  rest = path[len(parent) + 1 :] if parent else path
  siblings = sorted(p.rpartition(".")[2] for p in paths if p.rpartition(".")[0] == parent)
  close = [f"{parent}.{n}" if parent else n for n in difflib.get_close_matches(rest, siblings)]
  if not close:  # the right name in the wrong section
    name = path.rpartition(".")[2]
    close = [p for p in paths if p.rpartition(".")[2] == name]
  where = f"config.{parent}" if parent else "config"
  if close:
    hint = "did you mean " + " or ".join(f"config.{p}" for p in close) + "?"
  else:
    hint = f"valid fields of {where}: {', '.join(siblings)}"
  return f"unknown field config.{path}; {hint}"


def validate(cfg) -> Config:
  """Turn a ConfigDict (or dict) into a validated `Config`; raise `ConfigError` naming the field."""
  c = _convert(Config, _to_dict(cfg), "")
  # Registry-backed fields were checked against their registries' names (so newly registered
  # functions are valid values); the rest are cross-field checks.
  traits = ADVANTAGES.traits(c.rl.advantage)
  off = c.rl.offpolicy
  # Cross-field checks.
  grouped = not traits.get("groupless") and not c.distill.enabled
  check(
    c.rl.group_size >= 2 or not grouped,
    "rl.group_size",
    c.rl.group_size,
    f">= 2 with the group estimator rl.advantage={c.rl.advantage!r} (a group of one has no "
    f"baseline); group_size=1 works with {ADVANTAGES.names(groupless=True)}",
  )
  check_rl(c.rl)
  d = c.distill
  check(
    not d.enabled or bool(d.teacher.path or d.teacher.preset),
    "distill.teacher.path",
    d.teacher.path,
    "an HF checkpoint directory (or distill.teacher.preset) when distill.enabled",
  )
  check(
    not d.adaptive or d.window > 0,
    "distill.window",
    d.window,
    "> 0 (the starting window) with distill.adaptive",
  )
  check(
    d.window <= c.rl.max_new_tokens,
    "distill.window",
    d.window,
    f"0 (every token) to rl.max_new_tokens = {c.rl.max_new_tokens}",
  )
  if d.enabled:
    # The teacher replaces the reward signal: the reward-side machinery would not be read.
    check(
      c.rl.kl.beta == 0,
      "rl.kl.beta",
      c.rl.kl.beta,
      "0 with distill.enabled (the teacher is the target)",
    )
    check(
      not traits.get("needs_critic"),
      "rl.advantage",
      c.rl.advantage,
      "a group estimator (unused) with distill.enabled: no critic is trained",
    )
    for name in ("method", "is_correction"):
      v = getattr(off, name)
      check(v == "none", f"rl.offpolicy.{name}", v, "'none' with distill.enabled")
  check(
    d.align_low < d.align_high,
    "distill.align_high",
    d.align_high,
    f"> distill.align_low = {d.align_low}",
  )
  check(c.workdir.strip() != "", "workdir", c.workdir, "a directory for the run's outputs")
  check(
    not c.log.wandb_project or importlib.util.find_spec("wandb") is not None,
    "log.wandb_project",
    c.log.wandb_project,
    "'' unless the wandb package is installed (pip install wandb)",
  )
  check(
    set(c.task.ops) <= set("+-*") and c.task.ops != "", "task.ops", c.task.ops, "chars of '+-*'"
  )
  check(
    c.sft.tool_rate == 0 or c.task.name == "arithmetic",
    "sft.tool_rate",
    c.sft.tool_rate,
    "0 unless task.name='arithmetic' (only its demonstrations are written with calls)",
  )
  check(
    c.sft.careless_rate == 0 or c.task.name == "arithmetic",
    "sft.careless_rate",
    c.sft.careless_rate,
    "0 unless task.name='arithmetic' (only its demonstrations have carries to forget)",
  )
  check(
    c.task.max_terms >= c.task.min_terms,
    "task.max_terms",
    c.task.max_terms,
    f">= task.min_terms = {c.task.min_terms}",
  )
  check(
    c.task.name != "jsonl" or bool(c.task.path),
    "task.path",
    c.task.path,
    "a JSONL/Parquet file when task.name='jsonl'",
  )
  from jaxrl import rewards  # here: the registry, with whatever a config module registered

  check(
    c.reward.name in rewards.names(),
    "reward.name",
    c.reward.name,
    f"one of {list(rewards.names())} (or a function registered with jaxrl.rewards.register)",
  )
  check(
    c.reward.timeout_s > 0 or not REWARDS.traits(c.reward.name).get("unbounded"),
    "reward.timeout_s",
    c.reward.timeout_s,
    f"> 0 with reward.name={c.reward.name!r}: it can run without bound on a pathological "
    "completion (its own timeouts need the main thread), so it must score in worker processes",
  )
  check(
    not (c.task.chat and c.model.tokenizer == "byte"),
    "task.chat",
    c.task.chat,
    "False with model.tokenizer='byte' (the byte tokenizer has no chat template)",
  )
  check(
    c.sft.batch_size % c.sft.num_microbatches == 0,
    "sft.num_microbatches",
    c.sft.num_microbatches,
    f"a divisor of sft.batch_size = {c.sft.batch_size}",
  )
  for name in ("data", "fsdp", "tensor"):
    v = getattr(c.mesh, name)
    check(v == -1 or v >= 1, f"mesh.{name}", v, "-1 (all remaining devices) or >= 1")
  check(c.mesh.expert >= 1, "mesh.expert", c.mesh.expert, ">= 1 (1: no expert axis)")
  for name in KERNELS:
    impl = getattr(c.model, name)
    problem = backend_problem(impl, c.model.kernel_interpret)
    check(problem is None, f"model.{name}", impl, problem or "")
  check(
    c.model.matmul_kernel in ("reference", "auto")
    or c.rl.rollout.quantize in ("int8", "fp8", "fp8_e5m2"),
    "model.matmul_kernel",
    c.model.matmul_kernel,
    "'reference' or 'auto' unless rl.rollout.quantize is per-channel (int8, fp8, fp8_e5m2): "
    f"it runs only quantized projections, and {c.rl.rollout.quantize!r} has no kernel",
  )
  return c
