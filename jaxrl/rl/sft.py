"""The supervised warm-start phase: the task's demonstrations, its own optimizer and checkpoints.

Checkpointed every `checkpoint.every` steps with optimizer and data-iterator state, so an
interrupted warm-start resumes where it stopped; its final params seed RL (and its reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxrl.config import ConfigError
from jaxrl.guard import NonFiniteGuard
from jaxrl.metrics import MetricsWriter, Progress
from jaxrl.preemption import Preempted
from jaxrl.rl import batch as batch_lib
from jaxrl.rl.objectives import SFTLoss
from jaxrl.rl.run import Run, abstract, too_long
from jaxrl.rl.train_step import init_state, make_optimizer, make_train_step


class SFTPhase:
  """`phase.run(summary, until) -> params | None` (None: stopped early at `until`)."""

  def __init__(self, run: Run, *, evaluate: Callable, metrics: MetricsWriter, log=print):
    cfg = run.cfg.sft
    self.run, self.evaluate, self.metrics, self.log = run, evaluate, metrics, log
    self.optimizer = make_optimizer(
      learning_rate=cfg.learning_rate,
      warmup_steps=cfg.warmup_steps,
      total_steps=cfg.steps,
      weight_decay=cfg.weight_decay,
      b2=cfg.b2,
      grad_clip=cfg.grad_clip,
      schedule="cosine",
    )
    self.trainable = "lora" if run.model_cfg.lora_rank else None
    self.step_fn = make_train_step(
      self.optimizer,
      SFTLoss(
        run.graphdef,
        load_balance_coef=cfg.load_balance_coef,
        router_z_coef=cfg.router_z_coef,
      ),
      num_microbatches=cfg.num_microbatches,
      trainable=self.trainable,
    )
    self.ckpt = run.checkpointer("sft")
    self.guard = NonFiniteGuard(
      run.cfg.guard.max_nonfinite_updates,
      "SFT",
      hint="Lower sft.learning_rate (or raise sft.warmup_steps), or check the demonstrations.",
    )
    # The warm-start has the task's own data mix; RL prompts and the held-out set follow `task`.
    self.task = run.task.sft_task(cfg)

  def batch(self, records) -> batch_lib.TrainBatch:
    """A supervised batch on the host: the prompts, then each record's demonstration + EOS."""
    run = self.run
    toks, mask = run.prompts(records)
    eos = run.tokenizer.eos_id
    demos = [self.task.sft_completion(r) for r in records]
    comps = [run.tokenizer.encode(d) + [eos] for d in demos]
    limit = run.cfg.rl.max_new_tokens
    for demo, ids in zip(demos, comps, strict=True):
      if len(ids) > limit:  # one past the records Run.build checked: still a config error
        what = "the warm-start's demonstrations (with their EOS)"
        raise ConfigError(too_long("rl.max_new_tokens", limit, what, demo, len(ids)))
    return batch_lib.supervised(
      toks, mask, comps, max_new_tokens=limit, pad_id=run.tokenizer.pad_id
    )

  def run_phase(self, summary: dict, until: int | None = None, stop_request=None) -> Any:
    """Run or resume the warm-start; `until` stops (and checkpoints) after that many steps
    without finishing the phase, as a preemption would; so does SIGTERM (`stop_request`, a
    `jaxrl.preemption.StopRequest`), raising `Preempted`. Updates `summary` in place."""
    run, cfg = self.run, self.run.cfg.sft
    state = init_state(run.init_params, self.optimizer, trainable=self.trainable)
    found = None
    if run.cfg.resume:  # the newest readable checkpoint (unreadable newer ones moved aside)
      found = self.ckpt.restore_newest_readable({"train": abstract(state)}, log=self.log)
    latest = None if found is None else found[0]
    if latest is None:
      self.metrics.truncate_after("sft", 0)  # rows of a try killed before its first checkpoint
      summary["accuracy_init"] = self.evaluate(run.init_params)["eval/accuracy"]
    it = iter(self.task.train_dataset(seed=run.cfg.seed + 1, batch_size=cfg.batch_size))
    start = 0
    if found is not None:
      latest, restored, meta = found
      state, start = restored["train"], latest
      summary.update(meta.get("summary", {}))
      if latest >= cfg.steps:
        self.log(f"[jaxrl] SFT warm-start restored from {self.ckpt.directory}/{latest}")
        return state.params
      it.set_state(meta["data"])
      self.guard.resume(summary.get("sft_nonfinite_updates", 0))
      self.metrics.truncate_after("sft", start + 1)
      self.log(f"[jaxrl] resumed SFT from step {start} in {self.ckpt.directory}")
    stop = cfg.steps if until is None else min(until, cfg.steps)
    progress = Progress(total=cfg.steps, desc="sft", enabled=run.cfg.log.progress, initial=start)
    checked, told = start, False  # the last step whose skips were counted; whether one was logged
    for step in range(start + 1, stop + 1):
      state, m = self.step_fn(state, run.shard(self.batch(next(it))))
      self.guard.update(m["opt/nonfinite"])
      # SIGTERM at any process of the run: every process checkpoints this step and stops.
      preempted = (
        stop_request is not None and step < cfg.steps and stop_request.requested_anywhere()
      )
      saving = step < cfg.steps and (step % self.ckpt.save_every == 0 or step == stop)
      saving = saving or preempted
      if step % 10 == 0 or step == cfg.steps or saving:
        # Counted on the device; fetched where metrics or a checkpoint sync anyway.
        skipped = self.guard.check(step)
        if skipped > summary.get("sft_nonfinite_updates", 0) and not told:
          told = True  # once: later skips are only counted
          self._tell_skipped(checked + 1, step, skipped)
        summary["sft_nonfinite_updates"], checked = skipped, step
      if step % 10 == 0 or step == cfg.steps:
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        self.metrics.write(step, {**m, "global_step": step}, phase="sft")
        progress.update(1, loss=m["sft/loss"])
      else:
        progress.update(1)
      if saving:
        meta = {"data": it.get_state(), "phase": "sft", "summary": dict(summary)}
        self.ckpt.save(step, {"train": state}, meta, force=step == stop or preempted)
      if preempted:
        progress.close()
        self.ckpt.wait()
        raise Preempted("SFT", step, self.ckpt.directory)
    progress.close()
    if stop < cfg.steps:
      self.ckpt.wait()
      return None
    ev = self.evaluate(state.params)
    summary["accuracy_after_sft"] = ev["eval/accuracy"]
    if "eval/sampled_accuracy" in ev:
      summary["sampled_accuracy_after_sft"] = ev["eval/sampled_accuracy"]
    self.metrics.write(cfg.steps, {**ev, "global_step": cfg.steps}, phase="sft")
    meta = {"data": it.get_state(), "phase": "sft", "summary": dict(summary)}
    self.ckpt.save(cfg.steps, {"train": state}, meta, force=True)
    self.ckpt.wait()
    self.log(
      f"[jaxrl] held-out accuracy: {summary['accuracy_init']:.3f} at init -> "
      f"{summary['accuracy_after_sft']:.3f} after {cfg.steps} SFT steps"
    )
    return state.params

  def _tell_skipped(self, first: int, last: int, skipped: int) -> None:
    """The one line a run logs when an update is first skipped (between steps `first` and
    `last`: the counts are fetched only every few steps)."""
    if jax.process_index() != 0:
      return
    when = f"step {last}" if first == last else f"steps {first}-{last}"
    self.log(
      f"[jaxrl] SFT {when}: an optimizer update was skipped (non-finite loss, gradient or "
      f"update; params and optimizer state kept), {skipped} skipped so far; later ones are only "
      f"counted (opt/nonfinite), and guard.max_nonfinite_updates={self.guard.limit} in a row "
      "stop the run"
    )
