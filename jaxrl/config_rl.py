"""The RL phase's config sections (config.rl.*) and their cross-field checks."""

from __future__ import annotations

import dataclasses
import math

from jaxrl.config_fields import LOSS_AGGREGATIONS, check
from jaxrl.config_fields import option as _field
from jaxrl.registry import ADVANTAGES, IS_CORRECTIONS, OFFPOLICY, POLICY_LOSSES


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
    help="a sequence may carry tokens drawn at most this many versions before the weights "
    "that continue it; a group holding older ones is restarted from its prompt (0: none "
    "carried across versions); with rl.placement's max_staleness k, tokens are <= k + max_age "
    "versions behind the learner",
  )


@dataclasses.dataclass(frozen=True)
class AllocationConfig:
  """In-step rollout allocation (rl.allocation; jaxrl.rl.allocation): a step's budget of
  prompts_per_step * group_size samples is spent in rounds, every prompt getting `initial`
  samples first and the rest going to the prompts whose rewards vary, so groups have variable
  sizes (advantages, loss and metrics take them as they are). vigor: VIGOR's variance-greedy
  rounds (each round to the prompts whose rewards vary, by variance, up to max_group; the tied
  ones only get what is left at the end); pilot_commit: Pilot-Commit's pilot, then the rest to
  the prompts that varied."""

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
    help="split: the share of the devices given to the sampler (at least one each side; "
    "with several processes, of each process's devices); the learner's sub-mesh takes "
    "config.mesh's sizes over the rest",
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
  kv_fraction: float = _field(
    0.0,
    lo=0.0,
    hi=1.0,
    help="size the KV pages from memory instead (vLLM's memory utilisation): this fraction of "
    "what a device has (memory.device_gb) after the learner's estimated state and step, at "
    "most enough for every slot; 0 = num_pages",
  )
  steps_per_call: int = _field(8, lo=1, help="decode steps per jitted engine call")
  prefill_batch_prompts: int = _field(
    0,
    lo=0,
    help="prompts per batched prefill call, padded to exactly this many (more are split into "
    "several calls): one prefill and one insert program per length bucket and samples per "
    "prompt; 0 = each call padded to the power of two above its prompt count (a program per "
    "count: partial rollouts' resumes come in every count, and each program compiles anew)",
  )
  overlap_rewards: bool = _field(
    True,
    help="detokenise and score each completion as soon as it finishes, while the engine's "
    "next decode call runs (the same rewards; off: all at the end, in row order)",
  )
  quantize: str = _field(
    "none",
    choices=("none", "int8", "fp8", "fp8_e5m2", "fp8_block", "fp4", "nvfp4"),
    help="sample from a W8A8 copy of the policy made at every step (jaxrl.quant): int8 or "
    "fp8 (float8_e4m3fn) per output channel, fp8_e5m2, fp8_block (e4m3 in 128 x 128 weight "
    "blocks), fp4 (research: float4_e2m1fn with a float32 scale per 16 inputs, upcast before "
    "the dot) or nvfp4 (fp4 with NVFP4's e4m3 block scales under a float32 scale per weight / "
    "token); the sampler-learner gap shows in rl/logprob_gap, rl.offpolicy.is_correction "
    "corrects it",
  )
  learner_fake_quant: bool = _field(
    False,
    help="the learner's loss and pi_prox forwards run the projections through the sampler's "
    "quantize-dequantize path with straight-through gradients (needs quantize), so the "
    "learner scores tokens with the numerics that drew them",
  )
  learner_fake_quant_part: str = _field(
    "both",
    choices=("both", "weights"),
    help="what learner_fake_quant rounds: both operands, as the sampler does, or the weights "
    "only, activations in full precision (QUADS's asymmetric QAT: activation rounding is "
    "the larger error, bench/quant_error.py)",
  )
  kv_dtype: str = _field(
    "auto",
    choices=("auto", "fp8"),
    help="the engine's KV pages: the compute dtype, or float8_e4m3fn with per-layer, "
    "per-kv-head scales recalibrated at every step from its first prefill (FP8 rollouts as in "
    "veRL's FP8 stack); the gap shows in the mismatch metrics",
  )
  env: str = _field(
    "none",
    choices=("none", "calculator", "python"),
    help="multi-turn tool use (jaxrl.rollout.multiturn): each sample is an episode whose turns "
    "an environment answers, its observations fed back as tokens and left out of the loss; "
    "calculator answers GSM8K-style '<<48/2=' with '24>>', python runs '<py>...</py>' in the "
    "reward sandbox (reward.sandbox) and answers '<out>...</out>'; rl.max_new_tokens is the "
    "episode's budget (turns and observations), rl.rollout.turn_tokens each turn's",
  )
  max_turns: int = _field(4, lo=1, help="model turns per episode with rl.rollout.env")
  turn_tokens: int = _field(
    0, lo=0, help="each model turn's token budget with rl.rollout.env; 0 = rl.max_new_tokens"
  )
  routes: str = _field(
    "none",
    choices=("none", "record", "replay"),
    help="MoE models: record has the engine return every token's top-k experts per layer "
    "(carried through partial-rollout resumes) and reports the sampler-learner routing "
    "agreement per layer (moe/route_agree*); replay also forces the learner's loss and pi_prox "
    "forwards to those experts, gated by the live router's softmax over them (R3, routing "
    "replay), so router gradients still flow",
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
  load_balance_coef: float = _field(
    0.0, lo=0.0, help="MoE models: Switch-Transformer load-balancing loss weight (0 = off)"
  )
  router_z_coef: float = _field(0.0, lo=0.0, help="MoE models: ST-MoE router z-loss weight")


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
  prompt_pool: int = _field(
    0,
    lo=0,
    help="0: an endless stream of the task's training prompts; n: the RL phase draws from a "
    "fixed pool of the stream's first n distinct prompts, each epoch reshuffled, so prompts "
    "come back (what per-prompt statistics and filters need)",
  )
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


def check_rl(rl: RLConfig) -> None:
  """The RL section's cross-field checks (jaxrl.config.validate runs them with the rest):
  switches that each decide a step's rollouts their own way exclude one another, and sizes
  must divide."""
  check(
    rl.group_size >= 2 or not rl.dynamic_sampling.enabled,
    "rl.group_size",
    rl.group_size,
    ">= 2 with rl.dynamic_sampling (it drops groups whose rewards all tie)",
  )
  check(
    not (rl.partial.enabled and rl.dynamic_sampling.enabled),
    "rl.partial.enabled",
    rl.partial.enabled,
    "False with rl.dynamic_sampling.enabled (each allocates the step's rollouts its own way)",
  )
  check(
    rl.prompt_pool == 0 or rl.prompt_pool >= rl.prompts_per_step,
    "rl.prompt_pool",
    rl.prompt_pool,
    f"0 (an endless stream) or >= rl.prompts_per_step = {rl.prompts_per_step} (a batch "
    "never repeats a prompt)",
  )
  check(
    not rl.rollout.learner_fake_quant or rl.rollout.quantize != "none",
    "rl.rollout.learner_fake_quant",
    rl.rollout.learner_fake_quant,
    "False with rl.rollout.quantize='none' (it copies the sampler's quantization)",
  )
  check(
    rl.rollout.learner_fake_quant or rl.rollout.learner_fake_quant_part == "both",
    "rl.rollout.learner_fake_quant_part",
    rl.rollout.learner_fake_quant_part,
    "'both' without rl.rollout.learner_fake_quant (it says what that rounds)",
  )
  pf = rl.prompt_filter
  check(
    pf.window_low < pf.window_high,
    "rl.prompt_filter.window_high",
    pf.window_high,
    f"> rl.prompt_filter.window_low = {pf.window_low}",
  )
  check(
    pf.method == "none" or not rl.partial.enabled,
    "rl.prompt_filter.method",
    pf.method,
    "'none' with rl.partial.enabled (partial rollouts draw their prompts themselves)",
  )
  pl, rp = rl.placement, rl.replay
  if rp.ratio > 0:
    n = math.floor(rp.ratio * rl.prompts_per_step)
    check(
      0 < n < rl.prompts_per_step,
      "rl.replay.ratio",
      rp.ratio,
      f"0 (off) or a share whose floor(ratio * prompts_per_step={rl.prompts_per_step}) "
      "is at least 1 group and leaves at least 1 fresh",
    )
    for name, on in (
      ("rl.partial.enabled", rl.partial.enabled),
      ("rl.dynamic_sampling.enabled", rl.dynamic_sampling.enabled),
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
      rl.group_size >= 2,
      "rl.group_size",
      rl.group_size,
      ">= 2 with rl.replay (only groups whose rewards differ are stored)",
    )
  if rl.rollout.env != "none":
    for name, on in (
      ("rl.partial.enabled", rl.partial.enabled),
      ("rl.allocation.method", rl.allocation.method != "none"),
      ("rl.rollout.routes", rl.rollout.routes != "none"),
    ):
      check(not on, name, on, f"off with rl.rollout.env={rl.rollout.env!r} (multi-turn episodes)")
  al = rl.allocation
  if al.method != "none":
    check(
      al.initial <= rl.group_size,
      "rl.allocation.initial",
      al.initial,
      f"2 to rl.group_size = {rl.group_size} (the budget is group_size per prompt)",
    )
    check(
      al.max_group == 0 or al.max_group >= rl.group_size,
      "rl.allocation.max_group",
      al.max_group,
      f"0 (2 * group_size) or >= rl.group_size = {rl.group_size}",
    )
    for name, on in (
      ("rl.partial.enabled", rl.partial.enabled),
      ("rl.dynamic_sampling.enabled", rl.dynamic_sampling.enabled),
      ("rl.replay.ratio", rp.ratio > 0),
    ):
      check(not on, name, on, f"off with rl.allocation.method={al.method!r}")
  check(
    rl.offpolicy.mis_low < rl.offpolicy.mis_high,
    "rl.offpolicy.mis_high",
    rl.offpolicy.mis_high,
    f"> rl.offpolicy.mis_low = {rl.offpolicy.mis_low}",
  )
  check(
    rl.overlong.buffer <= rl.max_new_tokens,
    "rl.overlong.buffer",
    rl.overlong.buffer,
    f"0 (off) to rl.max_new_tokens = {rl.max_new_tokens}",
  )
  b_rl = rl.prompts_per_step * rl.group_size
  check(
    b_rl % rl.num_minibatches == 0,
    "rl.num_minibatches",
    rl.num_minibatches,
    f"a divisor of rl.prompts_per_step * rl.group_size = {b_rl}",
  )
  mini = b_rl // rl.num_minibatches
  check(
    mini % rl.num_microbatches == 0,
    "rl.num_microbatches",
    rl.num_microbatches,
    f"a divisor of the mini-batch size {mini} (= prompts_per_step * group_size / num_minibatches)",
  )
