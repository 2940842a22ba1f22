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

from jaxrl.models.config import REMAT_POLICIES
from jaxrl.registry import ADVANTAGES, IS_CORRECTIONS, OFFPOLICY, POLICY_LOSSES


class ConfigError(ValueError):
  """A config value is missing, unknown, of the wrong type or out of range."""


def config_module(path: str | os.PathLike) -> types.ModuleType:
  """Import a configs/*.py file by path (configs/ is not a package): its `get_config(arg)` builds
  the ConfigDict. Configs that extend another one load it this way."""
  path = os.fspath(path)
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def check(cond: bool, field: str, value, allowed: str) -> None:
  if not cond:
    raise ConfigError(f"config.{field}={value!r} is invalid; allowed: {allowed}")


# How a per-token loss becomes one number (jaxrl.rl.losses.aggregate implements each).
LOSS_AGGREGATIONS = (
  "token-mean",
  "seq-mean-token-mean",
  "seq-mean-token-sum",
  "seq-mean-token-sum-norm",
)


def _field(default, *, lo=None, hi=None, lo_open=False, choices=None, registry=None, help=""):
  """A config field with its bounds, fixed choices or registry of valid names, and help."""
  meta = {"lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices, "help": help}
  meta["registry"] = registry
  if isinstance(default, list | dict):
    return dataclasses.field(default_factory=lambda: default, metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = _field(1, help="-1 = all remaining devices")
  fsdp: int = _field(-1, help="devices the params are sharded over (-1 = all remaining)")
  tensor: int = _field(1, help="devices each matmul is split over (heads, MLP columns)")
  rules: str = _field(
    "fsdp_tp",
    choices=("fsdp_tp", "replicated"),
    help="the logical-axis rules table (jaxrl.mesh): FSDP + tensor parallel, or all replicated",
  )


@dataclasses.dataclass(frozen=True)
class ModelSection:
  preset: str = _field("arith_small", help="a jaxrl.models.config preset; ignored with path")
  path: str = _field("", help="an HF checkpoint directory (config.json + safetensors)")
  tokenizer: str = _field("", help="'byte', an HF tokenizer directory, or '' = path or byte")
  dtype: str = _field("float32", choices=("float32", "bfloat16"), help="weights and activations")
  max_seq_len: int = _field(0, lo=0, help="override the preset's context length; 0 = keep")
  lora_rank: int = _field(0, lo=0, help="LoRA adapters of this rank (0 = full fine-tuning)")
  lora_alpha: float = _field(16.0, lo=0.0, lo_open=True, help="LoRA scale alpha / rank")
  lora_targets: str = _field("q,k,v,o,gate,up,down", help="comma-separated projections")
  scan_layers: bool = _field(
    False,
    help="run the blocks of a full forward (learner, reference, critic) as one jax.lax.scan: "
    "the forward's compile time stays flat in depth (params keep their per-layer layout)",
  )
  remat: str = _field(
    "none",
    choices=REMAT_POLICIES,
    help="recompute each block's activations on the backward pass (jax.checkpoint policy)",
  )


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  name: str = _field(
    "arithmetic",
    choices=("arithmetic", "chain", "jsonl", "word_problems"),
    help="the prompt source (chain: sums of a heavy-tailed number of digits, long-tailed "
    "completions)",
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
class RewardConfig:
  name: str = _field("exact_match", help="a reward function registered in jaxrl.rewards")
  on_error: str = _field(
    "raise",
    choices=("raise", "zero"),
    help="a reward function that raises: stop the run, or score 0 and count it",
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


@dataclasses.dataclass(frozen=True)
class OverlongConfig:
  """DAPO overlong reward shaping (jaxrl.rl.shaping)."""

  buffer: int = _field(0, lo=0, help="soft-punishment buffer L_cache in tokens; 0 = off")
  penalty: float = _field(1.0, lo=0.0, help="the penalty at max_new_tokens")
  mask_truncated: bool = _field(False, help="drop completions without EOS from the loss")


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
  """DAPO dynamic sampling (jaxrl.rl.allocation): only groups whose rewards differ are trained."""

  enabled: bool = _field(False, help="drop groups whose rewards all tie and sample more prompts")
  max_rounds: int = _field(4, lo=1, help="rollout rounds per step at most, the first included")


@dataclasses.dataclass(frozen=True)
class PromptFilterConfig:
  """Per-prompt statistics and the pre-rollout filter that reads them (rl.prompt_filter;
  jaxrl.rl.prompt_stats): which of the drawn prompts a step samples. The statistics (a Beta
  posterior of each prompt's success with forgetting, its run of all-tied visits, last-seen
  step, recent rewards) are kept and checkpointed whenever a method is set."""

  method: str = _field(
    "none",
    choices=("none", "greso", "difficulty_window", "thompson"),
    help="greso: skip a prompt whose last z visits all tied with probability 1 - p_e**z; "
    "difficulty_window: skip a seen prompt whose posterior success is outside the window; "
    "thompson: of max_draws batches, keep the prompts whose Beta-sampled success p has the "
    "largest p(1 - p)",
  )
  decay: float = _field(
    0.9, lo=0.0, hi=1.0, help="forgetting of the Beta posterior per visit (1 = never forget)"
  )
  history: int = _field(8, lo=1, help="recent group-mean rewards kept per prompt")
  greso_p_explore: float = _field(0.5, lo=0.0, hi=1.0, help="GRESO's initial p_e")
  greso_p_min: float = _field(0.05, lo=0.0, hi=1.0, help="the lowest p_e may go")
  greso_p_step: float = _field(0.01, lo=0.0, help="p_e's move after each step")
  greso_target_tied: float = _field(
    0.25, lo=0.0, hi=1.0, help="the share of all-tied groups p_e steers toward"
  )
  window_low: float = _field(0.05, lo=0.0, hi=1.0, help="difficulty_window: lowest success kept")
  window_high: float = _field(0.95, lo=0.0, hi=1.0, help="difficulty_window: highest kept")
  max_draws: int = _field(
    4,
    lo=1,
    help="prompt batches drawn per step at most (thompson: exactly); short of prompts, "
    "skipped ones fill",
  )


@dataclasses.dataclass(frozen=True)
class PartialConfig:
  """Partial rollouts (rl.partial; jaxrl.rl.partial): more groups are in flight than a step
  trains on, the rollout phase ends once prompts_per_step groups are complete, and the
  unfinished sequences are carried to the next step and resumed under its weights (APRIL,
  "Active Partial Rollouts in Reinforcement Learning"; CoPRIS). Their tokens keep the
  behaviour log-prob and policy version that drew them: the loss's ratio reads each token's
  own, and rl.offpolicy corrects across stages."""

  enabled: bool = _field(False, help="carry unfinished sequences to the next step")
  over_provision: float = _field(
    1.5,
    lo=1.0,
    help="groups in flight = ceil(over_provision * prompts_per_step); 1 = synchronous "
    "(every started group finishes in its step)",
  )
  max_age: int = _field(
    4,
    lo=0,
    help="a sequence may carry tokens drawn at most this many policy versions ago; a group "
    "holding older ones is restarted from its prompt (0: nothing stale is ever trained on)",
  )


@dataclasses.dataclass(frozen=True)
class AllocationConfig:
  """In-step rollout allocation (rl.allocation; jaxrl.rl.allocation): a step's budget of
  prompts_per_step * group_size samples is spent in rounds, every prompt getting `initial`
  samples first and the rest going to the prompts whose rewards vary, so groups have variable
  sizes (advantages, loss and metrics take them as they are). vigor: VIGOR's variance-greedy
  rounds; pilot_commit: Pilot-Commit's pilot, then the rest to the prompts that varied."""

  method: str = _field(
    "none",
    choices=("none", "vigor", "pilot_commit"),
    help="none: group_size samples per prompt; vigor / pilot_commit: allocated in rounds",
  )
  initial: int = _field(2, lo=2, help="samples per prompt in the first round (the pilot)")
  increment: int = _field(2, lo=1, help="vigor: samples one grant adds to a prompt")
  rounds: int = _field(2, lo=1, help="vigor: rounds after the first (the budget split evenly)")
  max_group: int = _field(0, lo=0, help="samples one prompt may get at most; 0 = 2 * group_size")


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  """Rollout replay (rl.replay; jaxrl.rl.replay): recent informative groups are kept and mixed
  into later batches, so a step samples fewer fresh ones ("Improving Data Efficiency for LLM
  Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and Rollout
  Replay"). Replayed tokens keep their behaviour log-probs and versions: rl.offpolicy corrects
  them like any stale token."""

  ratio: float = _field(
    0.0,
    lo=0.0,
    hi=1.0,
    help="share of a step's groups taken from the buffer (floor(ratio * prompts_per_step), "
    "once it holds that many); 0 = off",
  )
  max_age: int = _field(
    2, lo=1, help="a stored group is evicted once its oldest token is this many versions old"
  )
  capacity: int = _field(
    0, lo=0, help="groups kept, newest first; 0 = the replayed groups of max_age + 1 steps"
  )


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  """Where the sampler runs and how stale its policy may be (rl.placement; jaxrl.rl.placement).

  colocated: sampler and learner share the mesh and take turns; with max_staleness 0 the
  sampler reads the learner's own arrays (no copy). split: the devices are divided into a
  sampler sub-mesh and a learner sub-mesh that run concurrently (ROLL Flash; AReaL); each new
  policy version is pushed to the sampler in one transfer. Batch s is sampled by policy version
  max(0, s - max_staleness): the bound is used in full, so a run is reproducible and resumes
  exactly, and with colocated it injects a known staleness (for off-policy experiments)."""

  kind: str = _field(
    "colocated",
    choices=("colocated", "split"),
    help="colocated: one mesh, sampler and learner take turns; split: two sub-meshes, "
    "running concurrently",
  )
  sampler_fraction: float = _field(
    0.5,
    lo=0.0,
    hi=1.0,
    lo_open=True,
    help="split: the share of the devices given to the sampler (at least one each side); "
    "the learner's sub-mesh takes config.mesh's sizes over the rest",
  )
  max_staleness: int = _field(
    0,
    lo=0,
    help="batch s is sampled by policy version max(0, s - max_staleness); split needs >= 1 "
    "for the two sides to overlap",
  )


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """How RL samples, always through the engine (paged KV, one prefill per group, prompts of one
  length bucket prefilled in one call): `batching` is its admission policy."""

  batching: str = _field(
    "continuous",
    choices=("continuous", "static"),
    help="continuous refills a slot as soon as its sequence ends; static admits a new batch "
    "only when the whole previous one has ended (the same tokens, a baseline)",
  )
  slots: int = _field(0, lo=0, help="engine decode slots; 0 = every sample of a step at once")
  page_size: int = _field(16, lo=1, help="tokens per KV-cache page")
  num_pages: int = _field(0, lo=0, help="KV page budget; 0 = enough for every slot")
  steps_per_call: int = _field(8, lo=1, help="decode steps per jitted engine call")
  quantize: str = _field(
    "none",
    choices=("none", "int8"),
    help="int8: sample from a W8A8 copy of the policy made at every step (jaxrl.quant); the "
    "sampler-learner gap shows in rl/logprob_gap, rl.offpolicy.is_correction corrects it",
  )


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  """PPO's value model, used when rl.advantage='gae' (jaxrl.rl.critic): a copy of the
  warm-started policy's trunk with a scalar head, trained on the policy's mini-batches with the
  clipped value loss."""

  learning_rate: float = _field(
    1e-4, lo=0.0, lo_open=True, help="the critic's own AdamW (constant)"
  )
  warmup_steps: int = _field(0, lo=0, help="first RL steps that train only the critic")
  value_clip: float = _field(0.2, lo=0.0, help="PPO2 value clipping range; 0 = plain squared error")
  gamma: float = _field(1.0, lo=0.0, hi=1.0, help="GAE discount")
  lam: float = _field(0.95, lo=0.0, hi=1.0, help="GAE lambda")
  whiten: bool = _field(True, help="normalise GAE advantages over the batch's loss tokens")
  grad_clip: float = _field(1.0, lo=0.0, help="global-norm clip of the critic's gradient")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How rollouts sample (rl.sampling); evaluation's greedy pass ignores it."""

  temperature: float = _field(
    1.0, lo=0.0, lo_open=True, help="the learner's log-probs use the same temperature"
  )
  top_k: int = _field(0, lo=0, help="0 = off")
  top_p: float = _field(1.0, lo=0.0, hi=1.0, lo_open=True, help="1 = off")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
  """The policy-gradient loss (rl.loss; jaxrl.rl.objectives.PolicyLoss): which surrogate, its
  clip range, how per-token terms become one number, and the entropy bonus."""

  name: str = _field("ppo_clip", registry=POLICY_LOSSES, help="the surrogate")
  aggregation: str = _field(
    "token-mean",
    choices=LOSS_AGGREGATIONS,
    help="per-token terms to one number (DAPO: token-mean; Dr.GRPO: seq-mean-token-sum-norm)",
  )
  eps_low: float = _field(0.2, lo=0.0, hi=1.0, lo_open=True, help="clip range below 1")
  eps_high: float = _field(0.2, lo=0.0, lo_open=True, help="> eps_low: DAPO's clip-higher")
  dual_clip_c: float = _field(3.0, lo=1.0, lo_open=True, help="name='dual_clip' only")
  entropy_coef: float = _field(0.0, lo=0.0, help="entropy bonus on completion tokens")


@dataclasses.dataclass(frozen=True)
class KLConfig:
  """The KL penalty to the reference policy (rl.kl): the policy RL starts from, i.e. the
  warm-started params (with LoRA: the frozen base plus the warm-started adapters)."""

  beta: float = _field(0.0, lo=0.0, help="0 = no reference forward at all")
  estimator: str = _field(
    "k3", choices=("k1", "k2", "k3"), help="Schulman's k1 / k2 / k3 estimators of KL(pi || pi_ref)"
  )
  in_reward: bool = _field(
    False, help="fold beta * KL into the reward (per token with gae) instead of the loss"
  )


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
  """Off-policy corrections (rl.offpolicy; jaxrl.rl.offpolicy): a ratio/clip method for stale
  data and an importance-sampling correction of the sampler-learner mismatch."""

  method: str = _field("none", registry=OFFPOLICY, help="staleness: ratio and clip method")
  is_correction: str = _field(
    "none", registry=IS_CORRECTIONS, help="sampler-learner mismatch: IS weight"
  )
  prox: str = _field(
    "recompute",
    choices=("recompute", "interpolate"),
    help="method='decoupled': pi_prox from a learner forward, or interpolated by version lag",
  )
  is_cap: float = _field(2.0, lo=1.0, help="TIS truncation C (>= 1: on-policy tokens unchanged)")
  mis_low: float = _field(0.5, lo=0.0, hi=1.0, lo_open=True, help="MIS band lower end")
  mis_high: float = _field(2.0, lo=1.0, help="MIS band upper end")
  m2po_tau: float = _field(0.04, lo=0.0, lo_open=True, help="M2PO second-moment threshold")
  sat_tail: float = _field(2.0, lo=0.0, lo_open=True, help="SAT tail threshold, batch RMS units")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """The RL optimizer (rl.optim): AdamW after global-norm clipping, linear warmup, then a
  constant or cosine schedule over all updates (steps * num_minibatches * ppo_epochs)."""

  learning_rate: float = _field(1e-4, lo=0.0, lo_open=True, help="peak rate")
  schedule: str = _field("constant", choices=("constant", "cosine"), help="after warmup")
  warmup_steps: int = _field(5, lo=0, help="in updates")
  weight_decay: float = _field(0.0, lo=0.0, help="AdamW's decoupled weight decay")
  b2: float = _field(0.999, lo=0.0, hi=1.0, lo_open=True, help="Adam's second-moment decay")
  grad_clip: float = _field(1.0, lo=0.0, help="global-norm clip; 0 = off")


@dataclasses.dataclass(frozen=True)
class RLConfig:
  steps: int = _field(100, lo=1, help="RL steps (each: one rollout batch, then its updates)")
  prompts_per_step: int = _field(
    16, lo=1, help="prompts per step; each is sampled group_size times"
  )
  group_size: int = _field(8, lo=1, help="samples per prompt; group estimators need >= 2")
  max_prompt_len: int = _field(
    16, lo=1, help="the prompt bucket (left-padded); longer prompts are an error"
  )
  max_new_tokens: int = _field(
    8, lo=1, help="completion budget; completions cut there count as truncated"
  )
  advantage: str = _field(
    "grpo", registry=ADVANTAGES, help="the advantage estimator (gae: PPO's critic, rl.critic)"
  )
  scale_by_std: bool = _field(True, help="grpo: divide by the group's std")
  num_microbatches: int = _field(1, lo=1, help="gradient accumulation within one update")
  num_minibatches: int = _field(1, lo=1, help="optimizer updates per rollout batch and epoch")
  ppo_epochs: int = _field(1, lo=1, help="passes over each rollout batch")
  skip_zero_advantage: str = _field(
    "off",
    choices=("auto", "off"),
    help="auto: where the loss is zero wherever the advantage is (no KL term in the loss, "
    "entropy_coef 0, no off-policy correction, no distillation), the policy update runs over "
    "only the rows with a non-zero advantage, padded to a power of two, and divides by the "
    "whole batch's denominator: the same update for less compute where groups tie. Per-token "
    "metrics (entropy, clip_frac, logprob_gap) then cover the rows trained (rl/trained_rows)",
  )
  sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
  loss: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
  kl: KLConfig = dataclasses.field(default_factory=KLConfig)
  offpolicy: OffPolicyConfig = dataclasses.field(default_factory=OffPolicyConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  overlong: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)
  dynamic_sampling: DynamicSamplingConfig = dataclasses.field(default_factory=DynamicSamplingConfig)
  partial: PartialConfig = dataclasses.field(default_factory=PartialConfig)
  prompt_filter: PromptFilterConfig = dataclasses.field(default_factory=PromptFilterConfig)
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
  replay: ReplayConfig = dataclasses.field(default_factory=ReplayConfig)
  allocation: AllocationConfig = dataclasses.field(default_factory=AllocationConfig)
  critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)


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
    "ceiling while it still moves); 0 = off",
  )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = _field(25, lo=1, help="steps between checkpoints (the last step is always saved)")
  max_to_keep: int = _field(2, lo=1, help="newest checkpoints kept per phase")


@dataclasses.dataclass(frozen=True)
class LogConfig:
  progress: bool = _field(True, help="progress bars on stderr")
  tensorboard: bool = _field(True, help="also write TensorBoard events under workdir/tb")


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
  model: ModelSection = dataclasses.field(default_factory=ModelSection)
  task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
  sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
  rl: RLConfig = dataclasses.field(default_factory=RLConfig)
  distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
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
  check(
    c.rl.group_size >= 2 or not c.rl.dynamic_sampling.enabled,
    "rl.group_size",
    c.rl.group_size,
    ">= 2 with rl.dynamic_sampling (it drops groups whose rewards all tie)",
  )
  check(
    not (c.rl.partial.enabled and c.rl.dynamic_sampling.enabled),
    "rl.partial.enabled",
    c.rl.partial.enabled,
    "False with rl.dynamic_sampling.enabled (each allocates the step's rollouts its own way)",
  )
  pf = c.rl.prompt_filter
  check(
    pf.window_low < pf.window_high,
    "rl.prompt_filter.window_high",
    pf.window_high,
    f"> rl.prompt_filter.window_low = {pf.window_low}",
  )
  check(
    pf.method == "none" or not c.rl.partial.enabled,
    "rl.prompt_filter.method",
    pf.method,
    "'none' with rl.partial.enabled (partial rollouts draw their prompts themselves)",
  )
  pl = c.rl.placement
  check(
    not c.rl.partial.enabled or (pl.kind == "colocated" and pl.max_staleness == 0),
    "rl.partial.enabled",
    c.rl.partial.enabled,
    "False with rl.placement.kind='split' or rl.placement.max_staleness > 0 (partial rollouts "
    "carry their own per-token staleness, bounded by rl.partial.max_age)",
  )
  rp = c.rl.replay
  if rp.ratio > 0:
    n = math.floor(rp.ratio * c.rl.prompts_per_step)
    check(
      0 < n < c.rl.prompts_per_step,
      "rl.replay.ratio",
      rp.ratio,
      f"0 (off) or a share whose floor(ratio * prompts_per_step={c.rl.prompts_per_step}) "
      "is at least 1 group and leaves at least 1 fresh",
    )
    for name, on in (
      ("rl.partial.enabled", c.rl.partial.enabled),
      ("rl.dynamic_sampling.enabled", c.rl.dynamic_sampling.enabled),
      ("rl.prompt_filter.method", pf.method != "none"),
    ):
      check(not on, name, on, "off with rl.replay.ratio > 0 (each decides the step's prompts)")
    check(
      rp.max_age > pl.max_staleness,
      "rl.replay.max_age",
      rp.max_age,
      f"> rl.placement.max_staleness = {pl.max_staleness} (fresh groups are already that old)",
    )
    check(
      c.rl.group_size >= 2,
      "rl.group_size",
      c.rl.group_size,
      ">= 2 with rl.replay (only groups whose rewards differ are stored)",
    )
  al = c.rl.allocation
  if al.method != "none":
    check(
      al.initial <= c.rl.group_size,
      "rl.allocation.initial",
      al.initial,
      f"2 to rl.group_size = {c.rl.group_size} (the budget is group_size per prompt)",
    )
    check(
      al.max_group == 0 or al.max_group >= c.rl.group_size,
      "rl.allocation.max_group",
      al.max_group,
      f"0 (2 * group_size) or >= rl.group_size = {c.rl.group_size}",
    )
    for name, on in (
      ("rl.partial.enabled", c.rl.partial.enabled),
      ("rl.dynamic_sampling.enabled", c.rl.dynamic_sampling.enabled),
      ("rl.prompt_filter.method", pf.method != "none"),
      ("rl.replay.ratio", rp.ratio > 0),
    ):
      check(not on, name, on, f"off with rl.allocation.method={al.method!r}")
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
  check(
    off.mis_low < off.mis_high,
    "rl.offpolicy.mis_high",
    off.mis_high,
    f"> rl.offpolicy.mis_low = {off.mis_low}",
  )
  check(
    c.rl.overlong.buffer <= c.rl.max_new_tokens,
    "rl.overlong.buffer",
    c.rl.overlong.buffer,
    f"0 (off) to rl.max_new_tokens = {c.rl.max_new_tokens}",
  )
  check(
    set(c.task.ops) <= set("+-*") and c.task.ops != "", "task.ops", c.task.ops, "chars of '+-*'"
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
  check(
    not (c.task.chat and c.model.tokenizer == "byte"),
    "task.chat",
    c.task.chat,
    "False with model.tokenizer='byte' (the byte tokenizer has no chat template)",
  )
  b_rl = c.rl.prompts_per_step * c.rl.group_size
  check(
    b_rl % c.rl.num_minibatches == 0,
    "rl.num_minibatches",
    c.rl.num_minibatches,
    f"a divisor of rl.prompts_per_step * rl.group_size = {b_rl}",
  )
  mini = b_rl // c.rl.num_minibatches
  check(
    mini % c.rl.num_microbatches == 0,
    "rl.num_microbatches",
    c.rl.num_microbatches,
    f"a divisor of the mini-batch size {mini} (= prompts_per_step * group_size / num_minibatches)",
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
  return c
