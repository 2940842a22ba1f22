"""The RL loop: SFT warm-start, then RL with the sampler reading the learner's own arrays.

A run is composed of stages, each built once from the config:
  Run          the mesh, rules, tokenizer, model, task, reward and held-out set (jaxrl.rl.run)
  sampler      the continuous-batching engine behind `GroupSampler` (jaxrl.rollout.collect)
  Evaluator    greedy and sampled held-out accuracy through that sampler (jaxrl.rl.evaluation)
  SFTPhase     the supervised warm-start with its own optimizer and checkpoints (jaxrl.rl.sft)
  Experience   sample -> score -> filter -> shape -> TrainBatch (jaxrl.rl.experience)
  pipeline     which policy version samples which batch, and where (jaxrl.rl.placement)
  Learner      optimizer, policy loss, critic, epochs and mini-batches (jaxrl.rl.learner)
One RL step: `rolled = pipeline.get(step)` (Experience's host half, sampled inline or by the
sampler's own thread and sub-mesh), `batch = experience.batch(step, rolled)`, then
`state, m = learner.update(state, batch, step)`, `pipeline.publish(step + 1, params)`, then
one fetch of the step's metrics.

The KL reference (rl.kl.beta > 0) is one rule for LoRA and full fine-tuning: the policy the RL
phase starts from, i.e. the warm-started params. With full fine-tuning it is a frozen copy of
them; with LoRA the frozen base is the learner's own arrays (no copy) and only the warm-started
adapters are copied (`ref_params_now`).
Checkpoints carry params, optimizer state, step, RNG and the data-iterator position (with
rl.partial the groups in flight, with rl.prompt_filter the per-prompt statistics, with a stale
or split placement the batches sampled ahead), so a resumed run repeats an uninterrupted one
bit for bit on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxrl import memory
from jaxrl.config import Config, ConfigError
from jaxrl.mesh import use_mesh
from jaxrl.metrics import MetricsWriter, Progress, plot_curves
from jaxrl.models.lora import split_lora
from jaxrl.models.precision import ComputeCast
from jaxrl.preemption import Preempted, StopRequest
from jaxrl.rewards import sandbox
from jaxrl.rl import components
from jaxrl.rl.evaluation import Evaluator
from jaxrl.rl.experience import Experience, build_sampler
from jaxrl.rl.learner import Learner, LearnerState
from jaxrl.rl.placement import ProcessShare, RolloutPipeline
from jaxrl.rl.run import Run, abstract, restore_params
from jaxrl.rl.sft import SFTPhase
from jaxrl.rl.teacher import Teacher


def refuse_used_workdir(workdir: Path) -> None:
  """resume=False must not write into another run's workdir: its checkpoints would be kept
  where this run's steps differ (saves to existing steps are skipped) and replaced where they
  match, and metrics.jsonl would hold both runs."""
  used = sorted(
    str(p.relative_to(workdir))
    for p in [*workdir.glob("checkpoints/*/[0-9]*"), *workdir.glob("metrics.jsonl")]
  )
  if used:
    shown = ", ".join(used[:4]) + (f" and {len(used) - 4} more" if len(used) > 4 else "")
    raise ConfigError(
      f"config.resume=False but config.workdir={str(workdir)!r} already holds a run ({shown}); "
      "its files would be mixed with this run's. Use a new workdir, delete this one, or set "
      "config.resume=True to continue it."
    )


class Trainer:
  """One run: its stages, its RL checkpoints and metrics, and the loop that drives them."""

  def __init__(self, cfg: Config, *, log=print):
    if not cfg.resume:
      refuse_used_workdir(Path(cfg.workdir))
    self.cfg, self.log = cfg, log
    self.ctx = run = Run.build(cfg)
    self.workdir = run.workdir
    if jax.process_index() == 0:  # before any weight is used: what each device will hold
      log(f"[jaxrl] memory per device, estimated:\n{run.memory.table()}")
    self.sampler = build_sampler(run)  # evaluation's, and the rounds' when colocated
    # model.param_dtype above model.dtype: readers that never update the weights (the sampler,
    # evaluation, the KL reference) hold a copy with the matrices in the compute dtype.
    self.cast = ComputeCast(run.model_cfg)
    self.evaluate = Evaluator(run, self.sampler, view=self.cast.view)
    self.metrics = MetricsWriter(
      run.workdir,
      use_tensorboard=cfg.log.tensorboard,
      wandb_project=cfg.log.wandb_project,
      wandb_config=dataclasses.asdict(cfg),
    )
    self.sft = SFTPhase(run, evaluate=self.evaluate, metrics=self.metrics, log=log)
    temperature = self.sampler.sampling.logprob_temperature
    self.teacher = None
    if cfg.distill.enabled:
      teacher_model = components.build_teacher(
        cfg.distill.teacher, run.model_cfg, run.mesh, run.rules
      )
      self.teacher = Teacher(
        cfg.distill,
        teacher_model,
        run.model_cfg,
        run.graphdef,
        sampling=self.sampler.sampling,
        aggregation=cfg.rl.loss.aggregation,
        max_new_tokens=cfg.rl.max_new_tokens,
      )
    self.learner = Learner(run, temperature=temperature, teacher=self.teacher)
    rounds = self.sampler if run.sampler_mesh is None else build_sampler(run, run.sampler_mesh)
    if run.sampler_mesh is not None and jax.process_count() > 1:
      rounds = ProcessShare(rounds)  # each process's engine samples its share of the prompts
    self.experience = Experience(
      run, rounds, critic=self.learner.critic, teacher=self.teacher, cast=self.cast
    )
    self.pipeline = RolloutPipeline(run, self.experience, steps=cfg.rl.steps)
    self.rl_ckpt = run.checkpointer("rl")
    self.base_key = jax.random.key(cfg.seed)
    self.state: LearnerState | None = None
    self.sft_params = None
    self.ref_params = None  # the frozen reference: params (full fine-tuning) or adapters (LoRA)
    self.summary: dict = {}
    self.stop_request = StopRequest()  # installed as the SIGTERM handler by `run`
    self._told_skipped = False  # whether a skipped RL update has been logged

  def ref_params_now(self) -> nnx.State:
    """The KL reference the rollout stage reads: the warm-started policy. With LoRA, the
    learner's own frozen base arrays with the warm-started adapters (copied at RL's start)."""
    if self.learner.trainable:
      _, base = split_lora(self.state.policy.params)
      return nnx.merge_state(self.ref_params, base)
    return self.ref_params

  def run_sft(self, until: int | None = None) -> None:
    """Run (or resume) the warm-start; `until` stops it early, as a preemption would."""
    with use_mesh(self.ctx.mesh, self.ctx.rules):  # the model's activation constraints
      self.sft_params = self.sft.run_phase(self.summary, until, self.stop_request)

  def run_rl(self, until: int | None = None) -> None:
    """Run (or resume) the RL phase from the warm-started params; `until` stops it early."""
    with use_mesh(self.ctx.mesh, self.ctx.rules):  # the model's activation constraints
      self._run_rl(until)

  def _run_rl(self, until: int | None) -> None:
    cfg, rl = self.cfg, self.cfg.rl
    self.state = self.learner.init(self.sft_params)
    if rl.kl.beta > 0:
      # Frozen before the first step donates the warm-started buffers; the learner moves on.
      frozen = split_lora(self.sft_params)[0] if self.learner.trainable else self.sft_params
      self.ref_params = self.cast.copy(frozen)  # matrices in the compute dtype: same logits
    it = iter(self.ctx.rl_stream())
    start, queued = 0, []
    found = None
    if cfg.resume:  # the newest readable checkpoint (unreadable newer ones moved aside)
      found = self.rl_ckpt.restore_newest_readable(self._checkpoint_item(abstract), self.log)
    if found is not None:
      latest, restored, meta = found
      self.state = LearnerState(restored["train"], restored.get("critic"))
      if self.teacher:
        self.teacher.load_state_dict(meta.get("distill", {}))
      for name, part in self.experience.stateful().items():
        if name not in meta:
          raise ValueError(
            f"the RL checkpoint at step {latest} in {self.rl_ckpt.directory} was written "
            f"without rl.{name}: it holds no state of it to resume"
          )
        part.load_state_dict(meta[name])
      if self.pipeline.stateful:
        queued = self.pipeline.load(meta.get("placement"), latest)
      it.set_state(meta["data"])
      start = latest
      self.summary.update(meta.get("summary", {}))
      self.learner.guard.resume(self.summary.get("rl_nonfinite_updates", 0))
      self.metrics.truncate_after("rl", start + 1)
      self.log(f"[jaxrl] resumed RL from step {start} in {self.rl_ckpt.directory}")
    else:
      self.metrics.truncate_after("rl", 0)  # rows of a try killed before its first checkpoint
    if cfg.eval.num_samples and "sampled_accuracy_after_sft" not in self.summary:
      # A warm-start made without it (eval.num_samples was 0 then): measured here, once.
      ev = self.evaluate(self.sft_params)
      self.summary["sampled_accuracy_after_sft"] = ev["eval/sampled_accuracy"]
    stop = rl.steps if until is None else min(until, rl.steps)
    progress = Progress(total=rl.steps, desc="rl", enabled=cfg.log.progress, initial=start)
    self.pipeline.start(start, it, self.state.policy.params, queued)
    profile = range(cfg.log.profile_from, cfg.log.profile_from + cfg.log.profile_steps)
    tracing = False
    try:
      for step in range(start, stop):
        if profile and step == profile.start:
          jax.profiler.start_trace(str(self.workdir / "profile"))
          tracing = True
        m = self.rl_step(step)
        if tracing and step == profile[-1]:
          jax.profiler.stop_trace()  # rl_step fetched its metrics: the step's work is done
          tracing = False
        done = step + 1
        if cfg.eval.every and done % cfg.eval.every == 0 or done == rl.steps:
          m.update(self.evaluate(self.state.policy.params))
        if done == rl.steps:
          self._summarise(m, "after_rl")
        self.metrics.write(done, {**m, "global_step": cfg.sft.steps + done}, phase="rl")
        shown = {"reward": m["rl/reward_mean"]}
        if "eval/accuracy" in m:
          shown["acc"] = m["eval/accuracy"]
        progress.update(1, **shown)
        self._save_rl(done, it, force=done == stop)
        # SIGTERM at any process: every process saves here and stops.
        if done < rl.steps and self.stop_request.requested_anywhere():
          self._save_rl(done, it, force=True)
          self.rl_ckpt.wait()
          raise Preempted("RL", done, self.rl_ckpt.directory)
    finally:
      if tracing:
        jax.profiler.stop_trace()  # the run stopped inside the traced steps
      self.pipeline.close()
      progress.close()  # ended, so that a line about a stop starts a line of its own
    if stop == rl.steps and "accuracy_after_rl" not in self.summary:
      # Resumed from the final checkpoint: the loop above ran no step.
      self._summarise(self.evaluate(self.state.policy.params), "after_rl")

  def rl_step(self, step: int) -> dict:
    """Take batch `step`'s rollouts, update, publish the new policy version, and fetch the
    step's metrics from the device once."""
    t0, casts_before = time.perf_counter(), self.cast.calls
    rolled, pipeline_m = self.pipeline.get(step)
    batch, rollout_m = self.experience.batch(
      step,
      rolled,
      ref_params=self.ref_params_now() if self.cfg.rl.kl.beta > 0 else None,
      critic_params=None if self.state.critic is None else self.state.critic.params,
    )
    t1 = time.perf_counter()
    self.state, update_m = self.learner.update(self.state, batch, step)
    self.pipeline.publish(step + 1, self.state.policy.params)
    m = {k: float(v) for k, v in jax.device_get({**update_m, **rollout_m}).items()}
    skipped = self.learner.guard.check(step + 1)
    if skipped > self.summary.get("rl_nonfinite_updates", 0) and not self._told_skipped:
      self._told_skipped = True  # once: later skips are only counted
      if jax.process_index() == 0:
        self.log(
          f"[jaxrl] RL step {step + 1}: the optimizer update was skipped (non-finite loss, "
          f"gradient or update; params and optimizer state kept), {skipped} skipped so far; "
          "later ones are only counted (opt/nonfinite), and "
          f"guard.max_nonfinite_updates={self.learner.guard.limit} in a row stop the run"
        )
    self.summary["rl_nonfinite_updates"] = skipped
    m.update(pipeline_m)
    if self.cast.active:  # the sampler's copy of the master weights in the compute dtype
      casts = self.cast.calls - casts_before  # this step's (a resumed run repeats them)
      m.update({"sync/casts": float(casts), "sync/cast_mb": self.cast.last_bytes / 2**20})
    m.update({"time/rollout_s": t1 - t0, "time/train_s": time.perf_counter() - t1})
    self._count_staleness(step, rolled)
    return m

  def _count_staleness(self, step: int, rolled) -> None:
    """The run's staleness histogram (tokens trained on, by versions behind), in the summary."""
    r = rolled.rollout
    hist = self.summary.setdefault("staleness_histogram", {})
    lag = (step - np.asarray(r.versions))[r.model_tokens()]
    for k, n in zip(*np.unique(lag, return_counts=True), strict=True):
      hist[str(int(k))] = hist.get(str(int(k)), 0) + int(n)

  def _summarise(self, ev: dict, when: str) -> None:
    self.summary[f"accuracy_{when}"] = ev["eval/accuracy"]
    if "eval/sampled_accuracy" in ev:
      self.summary[f"sampled_accuracy_{when}"] = ev["eval/sampled_accuracy"]

  def _checkpoint_item(self, leaf=lambda x: x) -> dict:
    """What an RL checkpoint holds (its layout is fixed: older checkpoints restore into it)."""
    item = {"train": leaf(self.state.policy), "rng": jax.random.key_data(self.base_key)}
    if self.state.critic is not None:
      item["critic"] = leaf(self.state.critic)
    return item

  def _save_rl(self, step: int, it, *, force: bool) -> None:
    if not force and step % self.rl_ckpt.save_every:
      return
    # The sampler is held while the prompt stream and its stateful parts are read.
    with self.pipeline.paused(step) as placement:
      meta = {"data": it.get_state(), "phase": "rl", "summary": dict(self.summary)}
      if self.teacher:
        meta["distill"] = self.teacher.state_dict()
      for name, part in self.experience.stateful().items():
        meta[name] = part.state_dict()
      if self.pipeline.stateful:
        meta["placement"] = placement
    self.rl_ckpt.save(step, self._checkpoint_item(), meta, force=force)

  def restore_params(self, phase: str = "latest") -> tuple[str, int, nnx.State]:
    """(phase, step, params) of this run's newest `phase` checkpoint (jaxrl.rl.run)."""
    self.rl_ckpt.wait()
    return restore_params(self.ctx, phase)

  def run(self, until: int | None = None) -> dict:
    """Run (or resume) SFT then RL; `until` stops RL after that many steps (preemption, tests)."""
    t0 = time.perf_counter()
    self.workdir.mkdir(parents=True, exist_ok=True)
    with StopRequest() as self.stop_request:  # SIGTERM: checkpoint after this step and stop
      self.run_sft()
      # Between the phases (the warm-start is saved whole), as every process agrees.
      if self.stop_request.requested_anywhere():
        raise Preempted("SFT", self.cfg.sft.steps, self.sft.ckpt.directory)
      self.run_rl(until)
    self.rl_ckpt.wait()
    self.metrics.flush()
    if "accuracy_after_rl" in self.summary and jax.process_index() == 0:  # one writer
      self.summary["wall_s"] = time.perf_counter() - t0
      # The estimate beside what was measured (peak RSS on a CPU, peak device bytes elsewhere).
      self.summary["memory"] = {**self.ctx.memory.as_dict(), **memory.peak_bytes()}
      if (isolation := _sandbox_isolation(self.cfg, self.ctx.reward_fn)) is not None:
        self.summary["sandbox_isolation"] = isolation  # what fenced model-written code here
      (self.workdir / "summary.json").write_text(json.dumps(self.summary, indent=2))
      png = plot_curves(
        self.workdir / "metrics.jsonl",
        self.workdir / "curves.png",
        panels=[
          ("SFT warm-start loss", ["sft/loss"]),
          ("RL reward (sampled, T = rl.sampling.temperature)", ["rl/reward_mean"]),
          ("held-out accuracy", ["eval/accuracy", "eval/sampled_accuracy"]),
          ("KL (to the reference; sampler vs learner)", ["rl/kl", "offpolicy/kl_k3"]),
          ("response length (tokens)", ["rl/response_length", "eval/response_length"]),
          ("seconds per RL step", ["time/rollout_s", "time/train_s"]),
        ],
      )
      s = self.summary
      self.log(
        f"[jaxrl] held-out accuracy: init {s.get('accuracy_init', float('nan')):.3f} | "
        f"after SFT {s['accuracy_after_sft']:.3f} | after RL {s['accuracy_after_rl']:.3f}"
      )
      self.log(f"[jaxrl] metrics: {self.workdir / 'metrics.jsonl'}  plot: {png}")
    return dict(self.summary)

  def close(self) -> None:
    self.pipeline.close()
    if self.ctx.reward_pool is not None:
      self.ctx.reward_pool.close()
    self.sft.ckpt.close()
    self.rl_ckpt.close()
    self.metrics.close()


def _sandbox_isolation(cfg: Config, reward_fn) -> str | None:
  """The isolation ("namespaces" or "limits") the run's sandboxed programs got on this host, if
  it runs any (a code reward, or the python tool)."""
  if hasattr(reward_fn, "isolation"):
    return reward_fn.isolation
  if cfg.rl.rollout.env == "python":
    return sandbox.isolation(components.sandbox_limits(cfg.reward.sandbox))
  return None
