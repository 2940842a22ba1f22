"""The bad-input catalogue: each malformed input below fails with the exact message listed,
before any work, and leaves nothing half-written. docs/errors.md is rendered from this list;
`JAXRL_WRITE_ERRORS_DOC=1 pytest tests/bad_inputs_test.py` rewrites it after a change."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fixtures import smoke_config
from helpers import hf_config_dict, run_child

from jaxrl import rewards
from jaxrl.checkpoint import Checkpointer, CheckpointError, UnreadableCheckpointError
from jaxrl.config import ConfigError, SandboxConfig, validate
from jaxrl.data.jsonl import JsonlTask
from jaxrl.guard import NonFiniteError
from jaxrl.models import hf
from jaxrl.orbax_noise import silenced
from jaxrl.rewards import sandbox
from jaxrl.rewards.pool import RewardPool
from jaxrl.rl import components
from jaxrl.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "errors.md"


@dataclasses.dataclass(frozen=True)
class Entry:
  category: str
  what: str  # the bad input, in words
  message: str  # text the error's message holds, exactly
  trigger: Callable[[Path], object]  # runs it, in a fresh directory
  error: type = Exception


ENTRIES: list[Entry] = []


def entry(category: str, what: str, message: str, error: type = Exception):
  def deco(fn):
    ENTRIES.append(Entry(category, what, message, fn, error))
    return fn

  return deco


# ------------------------------------------------------------------------------------- configs


def _config(what: str, raw: dict, message: str) -> None:
  ENTRIES.append(Entry("config", what, message, lambda tmp: validate(raw), ConfigError))


for _what, _raw, _msg in [
  (
    "an unknown field",
    {"rl": {"stepz": 3}},
    "unknown field(s) config.rl.stepz; valid fields of config.rl: ['advantage',",
  ),
  (
    "an unknown section",
    {"colour": 1},
    "unknown field(s) config.colour; valid fields of config: ['checkpoint',",
  ),
  ("a string for an int", {"seed": "zero"}, "config.seed must be int, got str 'zero'"),
  ("a bool for an int", {"rl": {"steps": True}}, "config.rl.steps must be int, got bool True"),
  (
    "NaN for a float",
    {"rl": {"kl": {"beta": math.nan}}},
    "config.rl.kl.beta must be finite, got nan",
  ),
  ("negative RL steps", {"rl": {"steps": -1}}, "config.rl.steps=-1 is out of range; must be >= 1"),
  (
    "zero prompts per step",
    {"rl": {"prompts_per_step": 0}},
    "config.rl.prompts_per_step=0 is out of range; must be >= 1",
  ),
  (
    "zero new tokens",
    {"rl": {"max_new_tokens": 0}},
    "config.rl.max_new_tokens=0 is out of range; must be >= 1",
  ),
  (
    "a negative temperature",
    {"rl": {"sampling": {"temperature": -1}}},
    "config.rl.sampling.temperature=-1.0 is out of range; must be > 0.0",
  ),
  (
    "top_p above 1",
    {"rl": {"sampling": {"top_p": 1.5}}},
    "config.rl.sampling.top_p=1.5 is out of range; must be <= 1.0",
  ),
  (
    "an unknown loss",
    {"rl": {"loss": {"name": "ppo"}}},
    "config.rl.loss.name='ppo' is invalid; allowed: ['cispo', 'dual_clip', 'gspo', 'ppo_clip']",
  ),
  (
    "an unknown loss aggregation",
    {"rl": {"loss": {"aggregation": "mean"}}},
    "config.rl.loss.aggregation='mean' is invalid; allowed: ['token-mean',",
  ),
  (
    "a clip range above 1",
    {"rl": {"loss": {"eps_low": 1.5}}},
    "config.rl.loss.eps_low=1.5 is out of range; must be <= 1.0",
  ),
  (
    "an unknown advantage estimator",
    {"rl": {"advantage": "gpro"}},
    "config.rl.advantage='gpro' is invalid; allowed: ['dr_grpo', 'gae', 'grpo',",
  ),
  (
    "a group of one with a group estimator",
    {"rl": {"group_size": 1}},
    "config.rl.group_size=1 is invalid; allowed: >= 2 with the group estimator rl.advantage='grpo'",
  ),
  (
    "an unknown schedule",
    {"rl": {"optim": {"schedule": "linear"}}},
    "config.rl.optim.schedule='linear' is invalid; allowed: ['constant', 'cosine']",
  ),
  (
    "an unknown KL estimator",
    {"rl": {"kl": {"estimator": "k4"}}},
    "config.rl.kl.estimator='k4' is invalid; allowed: ['k1', 'k2', 'k3']",
  ),
  (
    "a negative KL weight",
    {"rl": {"kl": {"beta": -0.1}}},
    "config.rl.kl.beta=-0.1 is out of range; must be >= 0",
  ),
  (
    "an unknown rollout batching",
    {"rl": {"rollout": {"batching": "dynamic"}}},
    "config.rl.rollout.batching='dynamic' is invalid; allowed: ['continuous', 'static']",
  ),
  (
    "a zero page size",
    {"rl": {"rollout": {"page_size": 0}}},
    "config.rl.rollout.page_size=0 is out of range; must be >= 1",
  ),
  (
    "an unknown rollout quantization",
    {"rl": {"rollout": {"quantize": "int4"}}},
    "config.rl.rollout.quantize='int4' is invalid; allowed: ['none', 'int8', 'fp8',",
  ),
  (
    "negative slots",
    {"rl": {"rollout": {"slots": -1}}},
    "config.rl.rollout.slots=-1 is out of range; must be >= 0",
  ),
  (
    "minibatches that do not divide the batch",
    {"rl": {"num_minibatches": 3}},
    "config.rl.num_minibatches=3 is invalid; allowed: a divisor of rl.prompts_per_step * "
    "rl.group_size = 128",
  ),
  (
    "microbatches that do not divide a minibatch",
    {"rl": {"num_microbatches": 3}},
    "config.rl.num_microbatches=3 is invalid; allowed: a divisor of the mini-batch size 128",
  ),
  (
    "SFT microbatches that do not divide its batch",
    {"sft": {"num_microbatches": 3}},
    "config.sft.num_microbatches=3 is invalid; allowed: a divisor of sft.batch_size = 64",
  ),
  (
    "zero PPO epochs",
    {"rl": {"ppo_epochs": 0}},
    "config.rl.ppo_epochs=0 is out of range; must be >= 1",
  ),
  (
    "partial rollouts with fewer groups in flight than a step",
    {"rl": {"partial": {"enabled": True, "over_provision": 0.5}}},
    "config.rl.partial.over_provision=0.5 is out of range; must be >= 1.0",
  ),
  (
    "multi-turn tool use with partial rollouts",
    {"rl": {"rollout": {"env": "calculator"}, "partial": {"enabled": True}}},
    "config.rl.partial.enabled=True is invalid; allowed: off with rl.rollout.env='calculator'",
  ),
  (
    "an unknown tool environment",
    {"rl": {"rollout": {"env": "browser"}}},
    "config.rl.rollout.env='browser' is invalid; allowed: ['none', 'calculator', 'python']",
  ),
  (
    "a prompt pool smaller than a step",
    {"rl": {"prompt_pool": 3}},
    "config.rl.prompt_pool=3 is invalid; allowed: 0 (an endless stream) or >= rl.prompts_per_step",
  ),
  (
    "a float64 model",
    {"model": {"dtype": "float64"}},
    "config.model.dtype='float64' is invalid; allowed: ['float32', 'bfloat16']",
  ),
  (
    "an unknown task",
    {"task": {"name": "mnist"}},
    "config.task.name='mnist' is invalid; allowed: ['arithmetic', 'chain', 'functions',",
  ),
  (
    "a JSONL task without a file",
    {"task": {"name": "jsonl"}},
    "config.task.path='' is invalid; allowed: a JSONL/Parquet file when task.name='jsonl'",
  ),
  ("an unknown operator", {"task": {"ops": "/"}}, "config.task.ops='/' is invalid; allowed: chars"),
  (
    "ten-digit operands",
    {"task": {"max_digits": 12}},
    "config.task.max_digits=12 is out of range; must be <= 9",
  ),
  (
    "fewer chain terms at most than at least",
    {"task": {"name": "chain", "min_terms": 5, "max_terms": 3}},
    "config.task.max_terms=3 is invalid; allowed: >= task.min_terms = 5",
  ),
  (
    "zero coefficients for the function task",
    {"task": {"name": "functions", "max_coef": 0}},
    "config.task.max_coef=0 is out of range; must be >= 1",
  ),
  (
    "a held-out fraction of 0",
    {"task": {"held_out_fraction": 0.0}},
    "config.task.held_out_fraction=0.0 is out of range; must be > 0.0",
  ),
  (
    "careless demonstrations for a task without carries",
    {"task": {"name": "chain"}, "sft": {"careless_rate": 0.5}},
    "config.sft.careless_rate=0.5 is invalid; allowed: 0 unless task.name='arithmetic'",
  ),
  (
    "a zero learning rate",
    {"sft": {"learning_rate": 0}},
    "config.sft.learning_rate=0.0 is out of range; must be > 0.0",
  ),
  (
    "a zero SFT batch",
    {"sft": {"batch_size": 0}},
    "config.sft.batch_size=0 is out of range; must be >= 1",
  ),
  (
    "checkpoints every 0 steps",
    {"checkpoint": {"every": 0}},
    "config.checkpoint.every=0 is out of range; must be >= 1",
  ),
  (
    "no checkpoints kept",
    {"checkpoint": {"max_to_keep": 0}},
    "config.checkpoint.max_to_keep=0 is out of range; must be >= 1",
  ),
  (
    "an unknown sharding rule set",
    {"mesh": {"rules": "zero3"}},
    "config.mesh.rules='zero3' is invalid; allowed: ['fsdp_tp', 'replicated']",
  ),
  (
    "a zero tensor-parallel size",
    {"mesh": {"tensor": 0}},
    "config.mesh.tensor=0 is invalid; allowed: -1 (all remaining devices) or >= 1",
  ),
  (
    "distillation without a teacher",
    {"distill": {"enabled": True}},
    "config.distill.teacher.path='' is invalid; allowed: an HF checkpoint directory",
  ),
  (
    "an empty workdir",
    {"workdir": ""},
    "config.workdir='' is invalid; allowed: a directory for the run's outputs",
  ),
  (
    "a stop after zero bad updates",
    {"guard": {"max_nonfinite_updates": 0}},
    "config.guard.max_nonfinite_updates=0 is out of range; must be >= 1",
  ),
  (
    "an unknown reward",
    {"reward": {"name": "exact_mach"}},
    "config.reward.name='exact_mach' is invalid; allowed: one of [",
  ),
  (
    "math-verify scored without a time limit",
    {"reward": {"name": "math_verify"}},
    "config.reward.timeout_s=0.0 is invalid; allowed: > 0 with reward.name='math_verify': it can "
    "run without bound on a pathological completion",
  ),
  (
    "an unknown reward error policy",
    {"reward": {"on_error": "skip"}},
    "config.reward.on_error='skip' is invalid; allowed: ['raise', 'zero']",
  ),
  (
    "a zero reward range",
    {"reward": {"max_abs": 0}},
    "config.reward.max_abs=0.0 is out of range; must be > 0.0",
  ),
  (
    "zero reward workers",
    {"reward": {"workers": 0}},
    "config.reward.workers=0 is out of range; must be >= 1",
  ),
  (
    "an unknown sandbox isolation",
    {"reward": {"sandbox": {"isolation": "docker"}}},
    "config.reward.sandbox.isolation='docker' is invalid; allowed: ['auto', 'namespaces', "
    "'limits']",
  ),
  (
    "a sandbox memory limit below the interpreter's",
    {"reward": {"sandbox": {"memory_mb": 10}}},
    "config.reward.sandbox.memory_mb=10 is out of range; must be >= 64",
  ),
]:
  _config(_what, _raw, _msg)


# ---------------------------------------------------------------------------------- CLI flags


def _cli(what: str, flags, message: str) -> None:
  """`flags`: a list, or a function of the test's directory that returns one."""

  def trigger(tmp):
    args = flags(tmp) if callable(flags) else flags
    if not any(a.startswith("--config.workdir=") for a in args):
      args = [*args, f"--config.workdir={tmp / 'wd'}"]
    cmd = [sys.executable, "-m", "launch.train", *args]
    done = run_child(cmd, cwd=ROOT)
    if done.returncode == 0:
      return done
    raise SystemExit(done.stderr.strip().splitlines()[-1].replace(str(tmp), "TMP"))

  ENTRIES.append(Entry("CLI flags", what, message, trigger, SystemExit))


_SMOKE = "--config=configs/grpo_arith.py:smoke"
_cli(
  "a misspelt field",
  [_SMOKE, "--config.rl.stepz=3"],
  "error in command-line flags: unknown field config.rl.stepz; did you mean config.rl.steps?",
)
_cli(
  "a value of the wrong type",
  [_SMOKE, "--config.rl.steps=many"],
  "error in command-line flags: flag --config.rl.steps=many: invalid literal for int() with base "
  "10: 'many'",
)
_cli(
  "a value out of range",
  [_SMOKE, "--config.rl.steps=0"],
  "error in config: config.rl.steps=0 is out of range; must be >= 1",
)
_cli(
  "an unknown config variant",
  ["--config=configs/grpo_arith.py:smok"],
  "error in command-line flags: flag --config=configs/grpo_arith.py:smok: ValueError: unknown "
  "config variant 'smok'; valid: '' (full) or 'smoke'",
)
_cli(
  "a missing config file",
  ["--config=configs/nope.py"],
  "error in command-line flags: --config='configs/nope.py' is not a file; expected "
  "configs/NAME.py, optionally with :variant",
)
_cli(
  "a stray positional argument",
  [_SMOKE, "extra"],
  "unexpected arguments: ['extra']",
)

_cli(
  "a workdir that is a file, from the command line",
  lambda tmp: (tmp / "afile").write_text("x") and [_SMOKE, f"--config.workdir={tmp / 'afile'}"],
  "error in config: config.workdir='TMP/afile' exists and is not a directory; allowed: a "
  "directory for the run's outputs (an existing one, or a path where one can be made)",
)


_cli(
  "a dataset line that is not JSON, from the command line",
  lambda tmp: [
    _SMOKE,
    "--config.task.name=jsonl",
    "--config.task.path=" + str(_jsonl(tmp, '{"question": 5')),
    "--config.reward.name=gsm8k",
  ],
  "error in input: TMP/data.jsonl:1: not valid JSON (Expecting ',' delimiter)",
)


# ---------------------------------------------------------- runs (checked before the model)


def _run(tmp: Path, workdir=None, **over):
  """Builds a smoke run with `over` merged in (section: dict); the error, before any work."""
  from jaxrl.rl.loop import Trainer

  cfg = smoke_config(tmp / "wd" if workdir is None else workdir, **over)
  Trainer(cfg, log=lambda *_: None).close()


def _run_entry(category: str, what: str, message: str, make=None, **over) -> None:
  def trigger(tmp):
    extra = make(tmp) if make else {}
    _run(tmp, **{**over, **extra})

  ENTRIES.append(Entry(category, what, message, trigger, ConfigError))


_run_entry(
  "mesh shapes",
  "a data axis that does not divide the devices",
  "config.mesh: mesh.fsdp=-1 cannot be inferred: the other sizes multiply to 3, which does not "
  "divide the 8 devices",
  mesh={"data": 3, "devices": 0},
)
_run_entry(
  "mesh shapes",
  "axes that multiply past the devices",
  "config.mesh: mesh.data=1 * mesh.fsdp=16 * mesh.tensor=1 = 16 must equal the 8 devices",
  mesh={"fsdp": 16, "devices": 0},
)
_run_entry(
  "mesh shapes",
  "a tensor axis wider than the devices",
  "config.mesh: mesh.fsdp=-1 cannot be inferred: the other sizes multiply to 16",
  mesh={"data": 2, "tensor": 8, "devices": 0},
)
_run_entry(
  "mesh shapes",
  "more devices than there are",
  "config.mesh.devices=9 cannot be taken from the 8 devices of 1 process(es); allowed: 0 (all), "
  "or 1 to 8 in a one-process run",
  mesh={"devices": 9},
)
_run_entry(
  "mesh shapes",
  "a batch that does not split over the batch axes",
  "config.sft.batch_size = 12 rows is invalid; allowed: a multiple of 8, the devices each batch "
  "is split over",
  mesh={"devices": 0},
  sft={"batch_size": 12},
)
_run_entry(
  "prompts",
  "a template naming a field the records lack",
  "config.task.prompt_template='Q: {question}' does not fit a record with fields ['a', "
  "'answer', 'b', 'op', 'prompt']: KeyError('question')",
  task={"prompt_template": "Q: {question}"},
)
_run_entry(
  "prompts",
  "a chat template with the byte tokenizer",
  "config.task.chat=True needs an HF tokenizer with a chat template",
  task={"chat": True},
)
_run_entry(
  "prompts",
  "prompts longer than the prompt bucket",
  "config.rl.max_prompt_len=3 is shorter than the task's prompts:",
  rl={"max_prompt_len": 3},
)
_run_entry(
  "prompts",
  "a template with an unclosed brace",
  "config.task.prompt_template='{prompt' does not fit a record with fields",
  task={"prompt_template": "{prompt"},
)
_run_entry(
  "checkpoints",
  "resume=False in a used workdir",
  "already holds a run (metrics.jsonl); its files would be mixed with this run's. Use a new "
  "workdir, delete this one, or set config.resume=True to continue it.",
  make=lambda tmp: (tmp / "wd").mkdir() or (tmp / "wd" / "metrics.jsonl").write_text("{}\n") and {},
  resume=False,
)
_run_entry(
  "workdirs",
  "a workdir that is a file",
  "/afile' exists and is not a directory; allowed: a directory for the run's outputs (an "
  "existing one, or a path where one can be made)",
  make=lambda tmp: (tmp / "afile").write_text("x") and {"workdir": str(tmp / "afile")},
)
_run_entry(
  "workdirs",
  "a workdir under a file",
  "/afile', which exists and is not a directory; allowed: a directory for the run's outputs",
  make=lambda tmp: (tmp / "afile").write_text("x") and {"workdir": str(tmp / "afile" / "run")},
)
_run_entry(
  "workdirs",
  "a workdir under /proc",
  "config.workdir='/proc/jaxrl/run' cannot be written: no directory can be created in '/proc'",
  workdir="/proc/jaxrl/run",
)
_run_entry(
  "workdirs",
  "a workdir under /sys",
  "config.workdir='/sys/jaxrl' cannot be written: no directory can be created in '/sys'",
  workdir="/sys/jaxrl",
)
_run_entry(
  "prompts",
  "warm-start demonstrations longer than the completion budget",
  "config.rl.max_new_tokens=3 is shorter than the warm-start's demonstrations (with their EOS): ",
  rl={"max_new_tokens": 3},
)

_run_entry(
  "memory",
  "a run that cannot fit its devices",
  "per device, more than the 1.02 MiB it has (memory.device_gb, or the device's own):",
  memory={"device_gb": 0.001},
)
_run_entry(
  "memory",
  "KV pages sized from a budget with no room for one sequence",
  "pages of 7.00 KiB, fewer than one sequence of 14 tokens needs (1); raise kv_fraction or "
  "memory.device_gb",
  memory={"device_gb": 0.0072},
  rl={"rollout": {"kv_fraction": 0.01}},
)


def _long_training_prompts(tmp: Path) -> dict:
  """A JSONL task whose held-out file's prompts fit the smoke's 8-token bucket, and whose
  training file's do not."""
  train = _jsonl(tmp, '{"question": "a long question", "answer": "#### 4"}\n', "train.jsonl")
  held = _jsonl(tmp, '{"question": "q", "answer": "#### 4"}\n', "held.jsonl")
  task = {"name": "jsonl", "path": str(train), "held_out_path": str(held)}
  return {"task": task, "reward": {"name": "gsm8k"}, "eval": {"num_examples": 1}}


_run_entry(
  "prompts",
  "training prompts longer than the prompt bucket, beside held-out ones that fit",
  "config.rl.max_prompt_len=8 is shorter than the task's prompts: 'a long question' is 16 tokens",
  make=_long_training_prompts,
)
_run_entry(
  "prompts",
  "a chat template that fails to render",
  "config.task.chat=True: chat template from ",
  make=lambda tmp: {
    "model": {"tokenizer": str(_tok_dir(tmp, chat_template="{{ raise_exception('no') }}"))},
    "task": {"chat": True},
  },
)
_run_entry(
  "HF checkpoint directories",
  "model.path that does not exist",
  "config.model.path='/nonexistent/model' does not exist; allowed: an HF checkpoint directory",
  model={"path": "/nonexistent/model", "preset": ""},
)
_run_entry(
  "tokenizer files",
  "model.tokenizer that does not exist",
  "config.model.tokenizer='/nonexistent/tok': tokenizer='/nonexistent/tok': expected 'byte' or "
  "a directory holding a Hugging Face tokenizer.json",
  model={"tokenizer": "/nonexistent/tok"},
)


def _tok_dir(tmp: Path, tokenizer_json: str | None = "ok", **config) -> Path:
  """A tiny WordLevel tokenizer directory; `tokenizer_json` text replaces its tokenizer.json."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  d = tmp / "tok"
  d.mkdir()
  vocab = {"<eos>": 0, "<pad>": 1, "[UNK]": 2, "a": 3, "b": 4}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  if tokenizer_json == "ok":
    tok.save(str(d / "tokenizer.json"))
  elif tokenizer_json is not None:
    (d / "tokenizer.json").write_text(tokenizer_json)
  cfg = {"eos_token": "<eos>", "pad_token": "<pad>", **config}
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  return d


_run_entry(
  "tokenizer files",
  "a tokenizer directory without tokenizer.json",
  "/tok/tokenizer.json does not exist (only tokenizer.json is supported)",
  make=lambda tmp: {"model": {"tokenizer": str(_tok_dir(tmp, None))}},
)
_run_entry(
  "tokenizer files",
  "a tokenizer.json that is not JSON",
  "/tok/tokenizer.json could not be loaded by `tokenizers`",
  make=lambda tmp: {"model": {"tokenizer": str(_tok_dir(tmp, "{not json"))}},
)


@entry(
  "tokenizer files",
  "tokenizer_config.json that is not JSON",
  "/tok/tokenizer_config.json is not valid JSON: Expecting property name",
)
def _(tmp):
  d = _tok_dir(tmp)
  (d / "tokenizer_config.json").write_text("{ torn")
  return load_tokenizer(str(d))


@entry(
  "tokenizer files",
  "an eos_token not in the vocabulary",
  "/tok/tokenizer_config.json field 'eos_token' is '<nope>', which is not in the vocabulary of",
)
def _(tmp):
  return load_tokenizer(str(_tok_dir(tmp, eos_token="<nope>")))


@entry(
  "tokenizer files",
  "a pad_token of the wrong type",
  "field 'pad_token' must be a string, an AddedToken dict with a 'content' string, or null; got 7",
)
def _(tmp):
  return load_tokenizer(str(_tok_dir(tmp, pad_token=7)))


@entry("tokenizer files", "a misspelt 'byte'", "tokenizer='bytes': expected 'byte' or a directory")
def _(tmp):
  return load_tokenizer("bytes")


# ------------------------------------------------------------------------------ dataset records


def _jsonl(tmp: Path, text: str | bytes, name: str = "data.jsonl") -> Path:
  path = tmp / name
  path.write_bytes(text if isinstance(text, bytes) else text.encode())
  return path


for _what, _text, _msg in [
  (
    "a line that is not JSON",
    '{"question": "q", "answer": "#### 4"}\n{"question": 5\n',
    "data.jsonl:2: not valid JSON (Expecting ',' delimiter)",
  ),
  (
    "a record without the prompt field",
    '{"q": "x", "answer": "#### 4"}\n',
    "data.jsonl:1: missing field 'question' (fields present: ['answer', 'q'])",
  ),
  ("an empty file", "", "data.jsonl: the file holds no records"),
  (
    "a GSM8K answer without '####'",
    '{"question": "q", "answer": "4"}\n',
    "data.jsonl:1: field 'answer' must end with '#### <final answer>' (answer_format='gsm8k'), "
    "got '4'",
  ),
  (
    "bytes that are not UTF-8",
    b'{"question": "q\xff", "answer": "#### 4"}\n',
    "data.jsonl:1: not UTF-8 (byte 0xff at column 16); JSONL files must be UTF-8 encoded",
  ),
  (
    "a line holding a list, not an object",
    "[1, 2]\n",
    "data.jsonl:1: a record must be a JSON object, got list",
  ),
  (
    "a question that is not a string",
    '{"question": 5, "answer": "#### 4"}\n',
    "data.jsonl:1: field 'question' must be a non-empty string",
  ),
]:
  ENTRIES.append(
    Entry(
      "dataset records",
      _what,
      _msg,
      lambda tmp, text=_text: JsonlTask(_jsonl(tmp, text)),
    )
  )


@entry("dataset records", "a dataset file that does not exist", "/nope.jsonl' does not exist")
def _(tmp):
  return JsonlTask(tmp / "nope.jsonl")


@entry(
  "dataset records",
  "a dataset path that is a directory",
  "/data' is a directory; allowed: a .jsonl or .parquet file",
)
def _(tmp):
  (tmp / "data").mkdir()
  return JsonlTask(tmp / "data")


@entry(
  "dataset records",
  "a training record without an answer, beside a held-out file",
  "train.jsonl:2: missing field 'answer' (fields present: ['question'])",
)
def _(tmp):
  train = _jsonl(tmp, '{"question": "q", "answer": "#### 4"}\n{"question": "r"}\n', "train.jsonl")
  held = _jsonl(tmp, '{"question": "s", "answer": "#### 5"}\n', "held.jsonl")
  return JsonlTask(train, held_out_path=held)


@entry(
  "dataset records",
  "a .parquet file that is not Parquet",
  "data.parquet: not a readable Parquet file (ArrowInvalid: ",
)
def _(tmp):
  return JsonlTask(_jsonl(tmp, '{"question": "q", "answer": "#### 4"}\n', "data.parquet"))


@entry(
  "dataset records",
  "a Parquet row whose answer is null",
  "data.parquet:2: field 'answer' must be a non-empty string",
)
def _(tmp):
  import pyarrow as pa
  import pyarrow.parquet as pq

  rows = [{"question": "q", "answer": "#### 4"}, {"question": "r", "answer": None}]
  pq.write_table(pa.Table.from_pylist(rows), tmp / "data.parquet")
  return JsonlTask(tmp / "data.parquet")


# ---------------------------------------------------------------------------------- checkpoints


def _state(din: int = 3):
  import jax.numpy as jnp

  return {"w": jnp.ones((din, 2)), "step": jnp.int32(0)}


def _abstract(state):
  import jax

  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


@entry(
  "checkpoints",
  "restoring onto another model's shapes",
  "does not match the restore target:\n  shape differs: w (checkpoint (3, 2) vs target (4, 2))",
  CheckpointError,
)
def _(tmp):
  with Checkpointer(tmp / "ck") as ckpt:
    ckpt.save(1, _state(3), {"step": 1})
    ckpt.restore(1, _abstract(_state(4)))


@entry("checkpoints", "a state holding NaN", "the state holds NaN or inf values", NonFiniteError)
def _(tmp):
  import jax.numpy as jnp

  with Checkpointer(tmp / "ck") as ckpt:
    ckpt.save(1, {"w": jnp.array([1.0, jnp.nan])}, {"step": 1})


@entry(
  "checkpoints", "meta that is not JSON", "checkpoint meta must be JSON-serialisable", TypeError
)
def _(tmp):
  with Checkpointer(tmp / "ck") as ckpt:
    ckpt.save(1, _state(), {"when": object()})


@entry(
  "checkpoints",
  "no readable checkpoint at all",
  "can be read (steps [3]); the newest, 3: cannot read checkpoint metadata in",
  UnreadableCheckpointError,
)
def _(tmp):
  with Checkpointer(tmp / "ck") as ckpt:
    ckpt.save(3, _state(), {"step": 3})
  for p in (tmp / "ck" / "3" / "state").iterdir():
    if p.is_dir():
      for f in p.rglob("*"):
        if f.is_file():
          f.write_bytes(b"")
  # (silenced: the failed reads' own reports would land, as warnings, in a later test)
  with silenced(), Checkpointer(tmp / "ck") as ckpt:
    try:
      ckpt.restore_newest_readable(_abstract(_state()))
    finally:
      time.sleep(0.2)  # the reads' callbacks come from TensorStore's threads


@entry(
  "checkpoints",
  "restoring a step that was never saved",
  "/ck; available steps: [2]",
  FileNotFoundError,
)
def _(tmp):
  with Checkpointer(tmp / "ck") as ckpt:
    ckpt.save(2, _state(), {"step": 2})
    ckpt.restore(9, _abstract(_state()))


# -------------------------------------------------------------------- HF checkpoint directories


for _what, _kw, _msg in [
  (
    "an unsupported architecture",
    {"model_type": "gpt2"},
    "hf config model_type='gpt2' is not supported; allowed: ('qwen3', 'qwen2', 'llama',",
  ),
  (
    "a width the heads do not divide",
    {"hidden_size": 50},
    "hidden_size=50 is not divisible by num_attention_heads=6",
  ),
  (
    "an unsupported rope scaling",
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "hf config rope type 'linear' is not supported; allowed: default, llama3",
  ),
  (
    "an unsupported activation",
    {"hidden_act": "gelu"},
    "hf config hidden_act='gelu' is not supported; allowed: silu",
  ),
  (
    "attention biases",
    {"attention_bias": True},
    "hf config attention_bias=True is not supported for llama",
  ),
]:
  ENTRIES.append(
    Entry(
      "HF checkpoint directories",
      _what,
      _msg,
      lambda tmp, kw=_kw: hf.config_from_hf(hf_config_dict(**kw)),
      ValueError,
    )
  )


def _hf_dir(tmp: Path, weights: bytes | None) -> Path:
  d = tmp / "hf"
  d.mkdir()
  (d / "config.json").write_text(json.dumps(hf_config_dict()))
  if weights is not None:
    (d / "model.safetensors").write_bytes(weights)
  return d


@entry(
  "HF checkpoint directories",
  "a directory without config.json",
  "is not an HF checkpoint directory: no config.json",
  hf.CheckpointFileError,
)
def _(tmp):
  (tmp / "hf").mkdir()
  return hf.load_hf_checkpoint(tmp / "hf")


@entry(
  "HF checkpoint directories",
  "a directory without weights",
  "/hf holds neither model.safetensors nor model.safetensors.index.json",
  FileNotFoundError,
)
def _(tmp):
  return hf.load_hf_checkpoint(_hf_dir(tmp, None))


@entry(
  "HF checkpoint directories",
  "a truncated safetensors file",
  "/hf/model.safetensors: Error while deserializing header: invalid header length (truncated or "
  "not a safetensors file?)",
  hf.CheckpointFileError,
)
def _(tmp):
  return hf.load_hf_checkpoint(_hf_dir(tmp, b"\x10\x00\x00\x00\x00\x00\x00\x00{"))


@entry(
  "HF checkpoint directories",
  "config.json that is not JSON",
  "/hf/config.json is not valid JSON: Expecting property name",
  hf.CheckpointFileError,
)
def _(tmp):
  (tmp / "hf").mkdir()
  (tmp / "hf" / "config.json").write_text("{ torn")
  return hf.load_hf_checkpoint(tmp / "hf")


# ------------------------------------------------------------------------------ reward functions


def by_text(completion, record):
  """A reward with a failure for every kind of completion (module level: workers import it)."""
  return {"raise": lambda: 1 / 0, "none": lambda: None, "nan": lambda: math.nan,
          "inf": lambda: math.inf, "huge": lambda: 1e39, "big": lambda: 2e6,
          "array": lambda: np.ones(2)}[completion]()  # fmt: skip


def _score(completion: str, **kw):
  record = {"prompt": "1+1=", "answer": "2"}
  return rewards.compute_rewards(by_text, [completion], [record], on_error="raise", **kw)


for _text, _what, _msg, _kw in [
  ("raise", "a reward that raises", "ZeroDivisionError: division by zero", {}),
  (
    "none",
    "a reward that returns None",
    "TypeError: reward must be a real number, got NoneType: None",
    {},
  ),
  ("nan", "a NaN reward", "ValueError: reward must be finite, got nan", {}),
  ("inf", "an infinite reward", "ValueError: reward must be finite, got inf", {}),
  (
    "huge",
    "a reward float32 cannot hold",
    "ValueError: reward 1e+39 is beyond the accepted range",
    {},
  ),
  (
    "big",
    "a reward beyond reward.max_abs",
    "ValueError: reward 2000000.0 is beyond the accepted range [-1e+06, 1e+06]",
    {"max_abs": 1e6},
  ),
  (
    "array",
    "a reward that returns an array",
    "TypeError: reward must be a real number, got ndarray",
    {},
  ),
]:
  ENTRIES.append(
    Entry(
      "reward functions",
      _what,
      f"reward by_text failed on sample 0 (prompt '1+1=', completion {_text!r}): " + _msg,
      lambda tmp, t=_text, kw=_kw: _score(t, **kw),
      rewards.RewardError,
    )
  )


@entry(
  "reward functions",
  "a lambda sent to reward workers",
  "cannot be sent to worker processes (Can't pickle local object",
  ValueError,
)
def _(tmp):
  return RewardPool(lambda c, r: 1.0, workers=1, timeout_s=1.0)


@entry(
  "reward functions",
  "a code reward on records without tests",
  "reward code_tests failed on sample 0 (prompt None, completion '1'): KeyError: \"a code reward "
  "needs records with 'code_prefix' and 'tests' fields; this one has ['p']\"",
  rewards.RewardError,
)
def _(tmp):
  return rewards.compute_rewards(rewards.get("code_tests"), ["1"], [{"p": 1}], on_error="raise")


@entry(
  "reward functions",
  "sandbox namespaces required where the host has none",
  "config.reward.sandbox.isolation='namespaces': sandbox isolation='namespaces' needs Linux "
  "namespaces",
  ConfigError,
)
def _(tmp):
  real = sandbox._namespace_prefix
  sandbox._namespace_prefix = lambda: None
  try:
    return components.sandboxed(rewards.get("code_tests"), SandboxConfig(isolation="namespaces"))
  finally:
    sandbox._namespace_prefix = real


@entry(
  "reward functions",
  "an unknown reward looked up by name",
  # (the valid names go on with those other tests of the process registered: not listed here)
  "unknown reward 'exact_mach'; valid: ['code_tests', 'code_tests_passed',",
)
def _(tmp):
  return rewards.get("exact_mach")


# --------------------------------------------------------------------------------------- tests


def _id(e: Entry) -> str:
  return f"{e.category}: {e.what}".replace(" ", "_")


@pytest.mark.parametrize("e", ENTRIES, ids=_id)
def test_bad_input_fails_with_its_message(e: Entry, tmp_path):
  with pytest.raises(e.error) as raised:
    e.trigger(tmp_path)
  assert e.message in str(raised.value), str(raised.value)
  # Nothing half-written: a run refused before its first step leaves no workdir behind (the
  # used-workdir entry's own files are what it refuses to mix with).
  wd = tmp_path / "wd"
  if wd.exists() and e.what != "resume=False in a used workdir":
    assert not any(wd.iterdir()), sorted(wd.rglob("*"))


def render() -> str:
  lines = [
    "# Bad inputs and their errors",
    "",
    "Every malformed input below fails with an error whose message holds the text shown word "
    "for word (`...`: the message goes on, with paths or lists; a line break is written "
    "`\\n`). What a run can check up front (configs, flags, mesh shapes, workdirs, prompts "
    "and demonstrations, model, tokenizer and dataset files) fails before its first step and "
    "leaves no workdir behind; "
    "reward and checkpoint failures are caught where they happen (rewards per "
    "`reward.on_error`; a non-finite state is never written). Each row is asserted by "
    "`tests/bad_inputs_test.py`, which also renders this page "
    "(`JAXRL_WRITE_ERRORS_DOC=1 pytest tests/bad_inputs_test.py`).",
    "",
    f"{len(ENTRIES)} entries.",
  ]
  for category in dict.fromkeys(e.category for e in ENTRIES):
    rows = [e for e in ENTRIES if e.category == category]
    lines += [
      "",
      f"## {category} ({len(rows)})",
      "",
      "| input | error | message |",
      "|---|---|---|",
    ]
    for e in rows:
      msg = e.message.replace("|", "\\|").replace("\n", "\\n")
      lines.append(f"| {e.what} | `{e.error.__name__}` | `` {msg} `` ... |")
  return "\n".join(lines) + "\n"


def test_the_catalogue_is_large_and_documented():
  assert len(ENTRIES) >= 80
  assert len({_id(e) for e in ENTRIES}) == len(ENTRIES)
  if os.environ.get("JAXRL_WRITE_ERRORS_DOC"):
    DOC.write_text(render())
  assert DOC.read_text() == render(), "docs/errors.md is stale: rerun with JAXRL_WRITE_ERRORS_DOC=1"
