"""What a run is built from, by config: tokenizer, model (preset or HF dir), task, prompts."""

from __future__ import annotations

import os
from pathlib import Path

from flax import nnx

from jaxrl.config import ConfigError, ModelSection, SandboxConfig, TaskConfig, TeacherConfig
from jaxrl.data import word_problems
from jaxrl.data.arithmetic import ArithmeticTask
from jaxrl.data.chain import ChainSumTask
from jaxrl.data.functions import FunctionTask
from jaxrl.data.jsonl import JsonlTask
from jaxrl.kernels import KERNELS
from jaxrl.mesh import Rules, shard_params
from jaxrl.models.config import ModelConfig, from_preset
from jaxrl.models.hf import hf_model_config, load_hf_checkpoint
from jaxrl.models.transformer import make_model
from jaxrl.rewards.sandbox import Limits, SandboxUnavailableError
from jaxrl.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer


def build_tokenizer(model: ModelSection) -> Tokenizer:
  """model.tokenizer: 'byte', an HF tokenizer directory, or '' (model.path's, else bytes)."""
  spec = model.tokenizer or model.path or "byte"
  if model.path and not Path(model.path).is_dir():
    raise ConfigError(
      f"config.model.path={model.path!r} does not exist; allowed: an HF checkpoint directory "
      "(config.json, *.safetensors, tokenizer.json) or '' for model.preset"
    )
  try:
    return load_tokenizer(spec)
  except (ValueError, OSError) as e:
    field = "model.tokenizer" if model.tokenizer else "model.path"
    raise ConfigError(f"config.{field}={spec!r}: {e}") from e


def lora_options(model: ModelSection) -> dict:
  """The ModelConfig LoRA fields of the config (empty without LoRA)."""
  if not model.lora_rank:
    return {}
  targets = tuple(t.strip() for t in model.lora_targets.split(",") if t.strip())
  return dict(lora_rank=model.lora_rank, lora_alpha=model.lora_alpha, lora_targets=targets)


def _execution(model: ModelSection) -> dict:
  """How the forward runs (scan, remat, logits chunks, kernels): ModelConfig fields that leave
  params alone."""
  return dict(
    scan_layers=model.scan_layers,
    remat=model.remat,
    logits_chunk=model.logits_chunk,
    **{name: getattr(model, name) for name in (*KERNELS, "kernel_interpret")},
  )


def model_config(model: ModelSection, tokenizer) -> ModelConfig:
  """The run's ModelConfig, without drawing or reading a weight: the preset with the
  tokenizer's vocabulary, or the HF checkpoint's config.json (model.path). A run checks it
  against the rest of its config before it pays for the weights."""
  lora = lora_options(model)
  if model.path:
    if not (Path(model.path) / "config.json").is_file():
      raise ConfigError(
        f"config.model.path={model.path!r} is not an HF checkpoint directory (no config.json)"
      )
    # model.dtype is the compute, model.param_dtype the storage: a bfloat16 checkpoint is read
    # into float32 master weights by default.
    try:
      cfg = hf_model_config(
        model.path,
        dtype=model.dtype,
        param_dtype=model.param_dtype,
        lora=lora or None,
        execution=_execution(model),
      )
    except ValueError as e:
      raise ConfigError(f"config.model (path={model.path!r}): {e}") from e
    if tokenizer.vocab_size > cfg.vocab_size:
      raise ConfigError(
        f"config.model.tokenizer has {tokenizer.vocab_size} ids, more than the checkpoint's "
        f"vocab_size={cfg.vocab_size}"
      )
    return cfg
  overrides = dict(
    vocab_size=tokenizer.vocab_size,
    dtype=model.dtype,
    param_dtype=model.param_dtype,
    **lora,
    **_execution(model),
  )
  if model.max_seq_len:
    overrides["max_seq_len"] = model.max_seq_len
  try:
    return from_preset(model.preset, **overrides)
  except ValueError as e:
    raise ConfigError(f"config.model.preset: {e}") from e


def build_model(
  model: ModelSection, tokenizer, mesh, rules: Rules, *, seed: int
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
  """(ModelConfig, graphdef, params placed on the mesh): an HF checkpoint read tensor by tensor
  straight into its shardings (model.path), or a preset initialised from `seed`. With
  model.lora_rank the model carries fresh adapters (B = 0: it starts equal to the base)."""
  cfg = model_config(model, tokenizer)
  if not model.path:
    graphdef, params = make_model(cfg, seed=seed)
    return cfg, graphdef, shard_params(params, mesh, rules)
  try:
    return load_hf_checkpoint(
      model.path,
      mesh=mesh,
      rules=rules,
      dtype=model.dtype,
      param_dtype=model.param_dtype,
      lora=lora_options(model) or None,
      lora_seed=seed,
      execution=_execution(model),
    )
  except ValueError as e:
    raise ConfigError(f"config.model (path={model.path!r}): {e}") from e


def _check_teacher_vocab(cfg: ModelConfig, student_cfg: ModelConfig) -> None:
  if cfg.vocab_size < student_cfg.vocab_size:
    raise ConfigError(
      f"config.distill.teacher has vocab_size={cfg.vocab_size}, smaller than the student's "
      f"{student_cfg.vocab_size}: teacher and student must share a tokenizer"
    )


def teacher_config(teacher: TeacherConfig, student_cfg) -> ModelConfig:
  """The distillation teacher's ModelConfig, without its weights (config.json or the preset)."""
  if teacher.path:
    if not (Path(teacher.path) / "config.json").is_file():
      raise ConfigError(
        f"config.distill.teacher.path={teacher.path!r} is not an HF checkpoint directory "
        "(no config.json)"
      )
    try:
      cfg = hf_model_config(teacher.path, dtype=teacher.dtype)
    except ValueError as e:
      raise ConfigError(f"config.distill.teacher (path={teacher.path!r}): {e}") from e
  else:
    try:
      # A frozen teacher stores its weights in its compute dtype: no master copy to update.
      cfg = from_preset(
        teacher.preset,
        vocab_size=student_cfg.vocab_size,
        dtype=teacher.dtype,
        param_dtype=teacher.dtype,
      )
    except ValueError as e:
      raise ConfigError(f"config.distill.teacher.preset: {e}") from e
  _check_teacher_vocab(cfg, student_cfg)  # from config.json, before any weight is read
  return cfg


def build_teacher(
  teacher: TeacherConfig, student_cfg, mesh, rules: Rules
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
  """(ModelConfig, graphdef, params) of the distillation teacher on the student's mesh: an HF
  checkpoint of any supported family (teacher.path), or a preset initialised from teacher.seed.

  The teacher must speak the student's tokenizer: its vocabulary may only be larger (HF
  checkpoints pad it), and the losses read its first student-vocab logits.
  """
  cfg = teacher_config(teacher, student_cfg)
  if teacher.path:
    try:
      cfg, graphdef, params = load_hf_checkpoint(
        teacher.path, mesh=mesh, rules=rules, dtype=teacher.dtype
      )
    except ValueError as e:
      raise ConfigError(f"config.distill.teacher (path={teacher.path!r}): {e}") from e
  else:
    graphdef, params = make_model(cfg, seed=teacher.seed)
    params = shard_params(params, mesh, rules)
  return cfg, graphdef, params


def build_task(
  task: TaskConfig, workdir: str | os.PathLike, *, seed: int
) -> ArithmeticTask | ChainSumTask | FunctionTask | JsonlTask:
  """The prompt source: arithmetic (synthetic), chain (synthetic, long-tailed completions),
  functions (write f(x) from examples; a code reward runs it against tests), jsonl (a local
  file, GSM8K layout by default) or word_problems (GSM8K-format problems generated into
  workdir/data)."""
  if task.name == "arithmetic":
    return ArithmeticTask(
      max_digits=task.max_digits,
      ops=tuple(task.ops),
      held_out_fraction=task.held_out_fraction,
      allow_negative=task.allow_negative,
      operand_dist=task.operand_dist,
    )
  if task.name == "chain":
    return ChainSumTask(
      min_terms=task.min_terms,
      max_terms=task.max_terms,
      tail=task.tail,
      held_out_fraction=task.held_out_fraction,
    )
  if task.name == "functions":
    return FunctionTask(
      max_coef=task.max_coef,
      max_degree=task.max_degree,
      held_out_fraction=task.held_out_fraction,
    )
  if task.name == "word_problems":
    data = Path(workdir) / "data"
    data.mkdir(parents=True, exist_ok=True)
    path = word_problems.write_jsonl(
      data / f"word_problems_{seed}_{task.num_problems}.jsonl", task.num_problems, seed
    )
    return JsonlTask(path, held_out_fraction=task.held_out_fraction)
  held_out_path = task.held_out_path or None
  try:
    return JsonlTask(
      task.path,
      held_out_path=held_out_path,
      held_out_fraction=0.0 if held_out_path else task.held_out_fraction,
      prompt_field=task.prompt_field,
      answer_field=task.answer_field,
      answer_format=task.answer_format,
    )
  except (FileNotFoundError, IsADirectoryError) as e:
    field = "task.path" if not os.path.isfile(task.path) else "task.held_out_path"
    raise ConfigError(f"config.{field}: {e}") from e


class PromptEncoder:
  """record -> prompt token ids: `task.prompt_template` over the record's fields, then either
  BOS + text or, with `task.chat`, the tokenizer's chat template (which writes its own BOS)."""

  def __init__(self, task: TaskConfig, tokenizer):
    self.template = task.prompt_template
    self.chat = task.chat
    self.system_prompt = task.system_prompt
    self.tokenizer = tokenizer
    if self.chat and not hasattr(tokenizer, "apply_chat_template"):
      raise ConfigError("config.task.chat=True needs an HF tokenizer with a chat template")

  def text(self, record) -> str:
    try:
      text = self.template.format(**record)
    except (KeyError, IndexError, ValueError) as e:
      raise ConfigError(
        f"config.task.prompt_template={self.template!r} does not fit a record with fields "
        f"{sorted(record)}: {e!r}"
      ) from e
    if not self.chat:
      return text
    messages = [{"role": "user", "content": text}]
    if self.system_prompt:
      messages.insert(0, {"role": "system", "content": self.system_prompt})
    try:
      return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ChatTemplateError as e:  # missing, does not compile, or refuses these messages
      raise ConfigError(f"config.task.chat=True: {e}") from e

  def __call__(self, record) -> list[int]:
    return self.tokenizer.encode(self.text(record), add_bos=not self.chat)


def sandbox_limits(sandbox: SandboxConfig) -> Limits:
  """config.reward.sandbox as the sandbox's Limits."""
  return Limits(
    cpu_s=sandbox.cpu_s,
    wall_s=sandbox.wall_s,
    memory_mb=sandbox.memory_mb,
    file_size_mb=sandbox.file_size_mb,
    processes=sandbox.processes,
    output_bytes=sandbox.output_kb * 1024,
    isolation=sandbox.isolation,
  )


def env_factory(cfg):
  """config.rl.rollout.env as a factory of one episode's environment (None: single-turn)."""
  from jaxrl.rollout.multiturn import CalculatorEnv, PythonToolEnv

  env = cfg.rl.rollout.env
  if env == "none":
    return None
  if env == "calculator":
    return CalculatorEnv
  limits = sandbox_limits(cfg.reward.sandbox)
  return lambda: PythonToolEnv(limits=limits)


def sandboxed(reward_fn, sandbox: SandboxConfig):
  """A code reward under config.reward.sandbox's limits; the isolation asked for is checked
  here, before the model is built."""
  limits = sandbox_limits(sandbox)
  try:
    return reward_fn.configured(limits, workers=sandbox.workers, dedupe=sandbox.dedupe)
  except SandboxUnavailableError as e:
    raise ConfigError(f"config.reward.sandbox.isolation={sandbox.isolation!r}: {e}") from e
