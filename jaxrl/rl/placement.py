"""Where the sampler runs and which policy version it reads (rl.placement).

A `RolloutPipeline` hands the learner each step's rollouts (`Experience.rollouts`, the host
half of a step) and receives each new policy version from it (`publish`). Batch s is sampled
by policy version max(0, s - max_staleness), so

  colocated, max_staleness = 0   the sampler reads the learner's own arrays at step s, inline
                                 (no copy: the zero-copy path of a synchronous run);
  colocated, max_staleness = k   each version is copied when it is published and batch s is
                                 sampled, inline, with the copy of version s - k: an injected,
                                 known staleness for off-policy experiments;
  split                          the sampler has its own sub-mesh (`Run.sampler_mesh`) and runs
                                 in a thread of its own: each published version is pushed there
                                 in one `jax.device_put` of the whole pytree, and batch s starts
                                 as soon as version s - k has arrived, while the learner trains
                                 on earlier batches (one-step-off with k = 1, as verl and AReaL
                                 run it; ROLL Flash and AReaL describe the design);
                                 with several processes each process's own engine samples
                                 its share of the prompts, and the main thread samples while
                                 the learner's devices run the update (`ProcessShare`)

The lag is always the configured bound (once k steps have run), never "whatever was newest":
the version a batch reads does not depend on timing, so a run is reproducible, staleness is
a controlled variable, and a checkpoint resumes exactly. At a checkpoint after step s the
batches that read versions older than s (s .. s + k - 1) are finished and written with it
(`paused`), so a resumed run needs no old weights.

Each consumed batch reports its staleness (`async/*`), and with a copy or a push the time
spent in it and each side's busy share of the wall-clock (`time/*`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import distributed
from jaxrl.mesh import use_mesh
from jaxrl.rl.experience import Experience, StepRollouts
from jaxrl.rl.run import Run
from jaxrl.rollout.collect import GroupSampler
from jaxrl.rollout.driver import Completion


@jax.jit
def _copy(tree):
  """A fresh copy of every leaf (the learner donates its buffers at its next update)."""
  return jax.tree.map(lambda x: x.copy(), tree)


def _whole(idx: tuple, shape: tuple) -> bool:
  """Whether an index from `addressable_devices_indices_map` selects the whole array."""
  return all(i.indices(n) == (0, n, 1) for i, n in zip(idx, shape, strict=False))


class ProcessShare:
  """The split placement's sampler in a multi-process run: each process samples its share of
  every call's prompts (`distributed.share`, by prompt index) on its own engine, over its own
  sampler devices, and every process gets every completion (`distributed.gather_shares`, so a
  failure in one process reaches all). Request ids stay i * stride + j and the engine seeds each
  request from (seed, request id), so every sample is the draw one engine over all the prompts
  makes. `on_finished` sees the step's completions once all are in (sharing defers it to the
  end); the engine counters are summed over the processes (`compiles`: the most any made).
  Everything else is the wrapped GroupSampler's."""

  def __init__(self, sampler: GroupSampler):
    self.inner = sampler

  def __getattr__(self, name: str):
    return getattr(self.inner, name)

  __call__ = GroupSampler.__call__  # prompts -> groups, through `sample_indices` below

  def sample_indices(
    self, params, prompts, samples, *, on_finished=None, **kwargs
  ) -> tuple[dict[tuple[int, int], Completion], dict]:
    def mine(share: range):
      asked = [js if i in share else [] for i, js in enumerate(samples)]
      if not any(asked):  # fewer prompts than processes: nothing to sample here
        return {}, {}
      return self.inner.sample_indices(params, prompts, asked, **kwargs)

    parts = distributed.gather_shares(mine, len(prompts))
    got = {k: c for part, _ in parts for k, c in part.items()}
    stats: dict = {}
    for _, st in parts:
      for k, v in st.items():
        stats[k] = max(stats.get(k, 0), v) if k == "compiles" else stats.get(k, 0) + v
    if on_finished is not None and got:
      on_finished([got[k] for k in sorted(got, key=lambda k: got[k].request_id)])
    return got, stats


class RolloutPipeline:
  """The rollouts of every step of a run, sampled where and with what rl.placement says."""

  def __init__(self, run: Run, experience: Experience, *, steps: int):
    pl = run.cfg.rl.placement
    self.run, self.experience, self.steps = run, experience, steps
    self.max_staleness, self.split = pl.max_staleness, pl.kind == "split"
    self.sampler_mesh = run.sampler_mesh
    # Several processes: no sampler thread. Each process's sampler is an engine on its own
    # devices (`ProcessShare`); the main thread dispatches each update, samples the batches
    # the versions already here allow while the learner's devices run it (`publish`), then
    # pushes the new version: the same calls in the same order in every process.
    self.lockstep = self.split and jax.process_count() > 1
    if self.split and self.sampler_mesh is None:
      raise ValueError("rl.placement.kind='split' needs the run's sampler sub-mesh")
    self._cond = threading.Condition()
    self._versions: dict[int, Any] = {}  # policy version -> what the sampler reads
    self._ready: dict[int, StepRollouts] = {}  # batch index -> its rollouts
    self._next = 0  # the next batch to sample
    self._limit: int | None = None  # paused: start no batch past this one
    self._busy = False  # the sampler thread is in the middle of a batch
    self._stop = False
    self._error: BaseException | None = None
    self._thread: threading.Thread | None = None
    self._records: Iterator | None = None
    # Timing of the split / copied placements, for the time/* metrics.
    self._push_s = 0.0
    self._push_to = None  # split: where each leaf goes on the sampler's sub-mesh (made once)
    self._replicate = None  # split over several processes: the learner-side all-gather
    self._update_wait_s = 0.0  # publish's wait for the update that made the version
    self._ahead_s = 0.0  # lockstep: publish's sampling while that update ran
    self._sampler_busy_s = 0.0
    self._last: tuple[float, float] | None = None  # (wall clock, sampler busy s) at the last get

  @property
  def stateful(self) -> bool:
    """Whether the pipeline's state goes into checkpoints (anything but colocated, lag 0)."""
    return self.split or self.max_staleness > 0

  def version_for(self, batch: int) -> int:
    return max(0, batch - self.max_staleness)

  # --------------------------------------------------------------------------- the learner side

  def start(self, step: int, records: Iterator, params, queued: list[StepRollouts] = ()) -> None:
    """Begin at batch `step` with the learner's params (policy version `step`); `records` is
    the prompt stream (batches draw from it in order); `queued` are the batches restored from
    a checkpoint, `step` onwards."""
    self._records = records
    self._ready = {step + i: q for i, q in enumerate(queued)}
    self._next = step + len(queued)
    self._versions, self._limit, self._stop, self._error, self._last = {}, None, False, None, None
    self.publish(step, params)
    if self.split and not self.lockstep:
      self._thread = threading.Thread(target=self._loop, name="jaxrl-sampler", daemon=True)
      self._thread.start()

  def publish(self, version: int, params) -> None:
    """Make policy `version` (the learner's params after `version` updates) readable by the
    batches that use it: the learner's own arrays (colocated, lag 0), a copy (colocated,
    lag > 0) or a push to the sampler's sub-mesh (split). Versions no batch will read (older
    than the next batch's, newer than the last batch's) are skipped."""
    if self.lockstep:
      # The update that made `params` was only dispatched: sample every batch the versions
      # already here allow while the learner's devices run it.
      t0 = time.perf_counter()
      self._produce_ready()
      self._ahead_s = time.perf_counter() - t0
    with self._cond:
      if not self.version_for(self._next) <= version <= self.version_for(self.steps - 1):
        return
    if self.stateful:
      # The update that made `params` may still be running: wait for it first, so the push
      # time is the transfer's (the push could not start earlier anyway).
      t0 = time.perf_counter()
      jax.block_until_ready(params)
      self._update_wait_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    view = self.experience.sampler_params(params)
    if self.split:
      if self._push_to is None:  # the sampler's shardings: the same specs on its sub-mesh
        spec = lambda x: NamedSharding(self.sampler_mesh, getattr(x.sharding, "spec", P()))  # noqa: E731
        self._push_to = jax.tree.map(spec, view)
      if self.lockstep:
        view = jax.block_until_ready(self._push_across_processes(view))
      else:
        view = jax.block_until_ready(jax.device_put(view, self._push_to))
      self._push_s = time.perf_counter() - t0
    elif self.max_staleness > 0:
      view = jax.block_until_ready(_copy(view))
      self._push_s = time.perf_counter() - t0
    with self._cond:
      self._versions[version] = view
      self._cond.notify_all()

  def get(self, step: int) -> tuple[StepRollouts, dict]:
    """Batch `step`'s rollouts (waiting for the sampler thread if it is behind) and the
    pipeline's metrics for it."""
    t0 = time.perf_counter()
    if self.split and not self.lockstep:
      with self._cond:
        while step not in self._ready and self._error is None:
          self._cond.wait()
        self._raise()
    else:
      while step not in self._ready:
        self._produce_timed()
    with self._cond:
      rolled = self._ready.pop(step)
      busy_s = self._sampler_busy_s
    now = time.perf_counter()
    r = rolled.rollout
    lag = (step - np.asarray(r.versions))[r.model_tokens()]
    m = {
      "async/policy_version": float(np.asarray(r.versions)[r.model_tokens()].min(initial=step)),
      "async/staleness_mean": float(lag.mean()) if lag.size else 0.0,
      "async/staleness_max": float(lag.max(initial=0)),
    }
    if self.stateful:
      m["time/push_s"] = self._push_s
      m["time/learner_wait_s"] = now - t0
      if self.lockstep:  # the host sampled while the update ran, then waited for the rest
        m["time/sample_ahead_s"] = self._ahead_s
        m["time/update_wait_s"] = self._update_wait_s
      if self._last is not None:
        window = now - self._last[0]
        if not self.lockstep:  # lockstep: the learner's device time is not seen from the host
          m["time/learner_busy_frac"] = 1.0 - (now - t0) / window
        if self.split:
          m["time/sampler_busy_frac"] = min(1.0, (busy_s - self._last[1]) / window)
      self._last = (now, busy_s)
    return rolled, m

  @contextlib.contextmanager
  def paused(self, step: int):
    """For a checkpoint after `step` updates: finish every batch that reads a version older
    than `step`, hold the sampler (the prompt stream and the experience's stateful parts are
    then as of its last batch), and yield the batches not yet consumed, as JSON-ready values."""
    # The last batch that reads a version older than `step` (none past the run's last).
    need = min(step + self.max_staleness - 1, self.steps - 1)
    if self.split and not self.lockstep:
      with self._cond:
        self._limit = need
        self._cond.notify_all()
        while (self._next <= need or self._busy) and self._error is None:
          self._cond.wait()
        self._raise()
    else:
      while self._next <= need:
        self._produce_timed()
    try:
      with self._cond:
        queued = [self._ready[b].to_json() for b in sorted(self._ready) if b >= step]
      yield {"max_staleness": self.max_staleness, "queued": queued}
    finally:
      with self._cond:
        self._limit = None
        self._cond.notify_all()

  def load(self, state: dict | None, step: int) -> list[StepRollouts]:
    """The batches a checkpoint after `step` updates holds (`paused`), checked against this
    run's bound: a batch must not need weights the checkpoint does not have."""
    if state is None:
      if self.max_staleness > 0 and step > 0:
        raise ValueError(
          f"the RL checkpoint at step {step} was written without rl.placement.max_staleness: "
          f"it holds none of the batches versions older than {step} would sample; resume "
          "with max_staleness=0 or start a new run"
        )
      return []
    if int(state.get("max_staleness", -1)) != self.max_staleness:
      raise ValueError(
        f"the RL checkpoint at step {step} was written with rl.placement.max_staleness="
        f"{state.get('max_staleness')}; this run has {self.max_staleness}"
      )
    return [StepRollouts.from_json(q) for q in state["queued"]]

  def close(self) -> None:
    if self._thread is not None:
      with self._cond:
        self._stop = True
        self._cond.notify_all()
      self._thread.join()
      self._thread = None

  # --------------------------------------------------------------------------- the sampler side

  def _produce(self) -> None:
    """Sample the next batch with the version it reads (already published)."""
    b = self._next
    with self._cond:
      params = self._versions[self.version_for(b)]
    # The experience draws the batch's prompts itself (replay may need fewer than a batch).
    rolled = self.experience.rollouts(
      b, params, None, lambda: next(self._records), version=self.version_for(b)
    )
    with self._cond:
      self._ready[b] = rolled
      self._next = b + 1
      oldest = self.version_for(self._next)
      for v in [v for v in self._versions if v < oldest]:
        del self._versions[v]  # no later batch reads it
      self._cond.notify_all()

  def _produce_timed(self) -> None:
    """`_produce` in the calling thread (colocated; split over several processes), on the
    sampler's sub-mesh where there is one, counted as sampler time."""
    t0 = time.perf_counter()
    with use_mesh(self.sampler_mesh, self.run.rules) if self.split else contextlib.nullcontext():
      self._produce()
    self._sampler_busy_s += time.perf_counter() - t0

  def _produce_ready(self) -> None:
    """Every batch that may start now (its version is here; the checkpoint limit allows it)."""
    while self._may_start():
      self._produce_timed()

  def _push_across_processes(self, view):
    """The push when the learner's sub-mesh spans several processes and each process's
    sampler is on its own devices (`split_devices` gives each process a share of each side):
    jax 0.10's device_put refuses a move between disjoint device sets whose shards live in
    other processes, so each leaf is made whole on every learner device first (one all-gather
    program over the learner's mesh), and each process then copies its own local replica to its
    own sampler devices; no byte crosses a process boundary outside the all-gather. The replica
    is transient (the learner's arrays keep their sharding)."""
    if self._replicate is None:
      whole = NamedSharding(self.run.mesh, P())
      self._replicate = jax.jit(lambda t: t, out_shardings=jax.tree.map(lambda _: whole, view))
    full = self._replicate(view)

    def place(x, to: NamedSharding):
      local = x.addressable_shards[0].data  # the whole leaf, on one of this process's devices
      shards = [
        jax.device_put(local if _whole(idx, x.shape) else local[idx], d)
        for d, idx in to.addressable_devices_indices_map(x.shape).items()
      ]
      return jax.make_array_from_single_device_arrays(x.shape, to, shards)

    return jax.tree.map(place, full, self._push_to)

  def _may_start(self) -> bool:
    b = self._next
    return (
      b < self.steps
      and (self._limit is None or b <= self._limit)
      and self.version_for(b) in self._versions
    )

  def _loop(self) -> None:
    """The sampler thread (split): each batch as soon as its version has arrived."""
    try:
      with use_mesh(self.sampler_mesh, self.run.rules):
        while True:
          with self._cond:
            while not self._stop and not self._may_start():
              self._cond.wait()
            if self._stop:
              return
            self._busy = True
          t0 = time.perf_counter()
          try:
            self._produce()
          finally:
            with self._cond:
              self._busy = False
              self._sampler_busy_s += time.perf_counter() - t0
              self._cond.notify_all()
    except BaseException as e:  # noqa: BLE001 - handed to the learner, which raises it
      with self._cond:
        self._error = e
        self._cond.notify_all()

  def _raise(self) -> None:
    if self._error is not None:
      raise RuntimeError(f"the sampler thread failed: {self._error!r}") from self._error
