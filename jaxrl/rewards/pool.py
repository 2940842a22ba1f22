"""Rewards in worker processes, each sample under a time limit: a reward function that hangs,
spins or crashes the interpreter costs its sample, never the run nor the samples beside it.

`RewardPool(fn, workers=..., timeout_s=...)` keeps `workers` processes (the forkserver start
method: started from a fresh interpreter, not forked from the multi-threaded JAX process), each
joined to the training process by a pipe. The training process hands a worker one sample at a
time and keeps the rest of the batch queued, so it knows which sample each worker runs and since
when:

- a sample runs in its worker's main thread under an interval timer (SIGALRM), so pure-Python
  work is interrupted at `timeout_s` and reported as a `TimeoutError`;
- work that never returns to the interpreter (a C extension in a loop, SIGALRM blocked) is caught
  by the training process: a worker still on a sample `timeout_s + grace_s` (`grace_s`: 5 s
  unless given) after it was handed it is killed, and that sample is reported as a
  `TimeoutError`;
- a worker that dies while scoring (`os._exit`, a segfault, the OOM killer) costs the sample it
  was scoring, reported as an error that names its exit code or signal.

Either way a fresh worker replaces the lost one (`restarts` counts them), and the samples still
queued go to the other workers and to the replacement: no sample is lost with another's worker,
and none is run twice. A worker's start-up (a new interpreter importing the reward's module) is
not the reward's time: a worker, a replacement included, is handed samples only once it reports
that it has imported the function. A function the workers cannot import there, or a worker that
dies while starting or has not started after 5 minutes, raises `RuntimeError` from `score`:
every sample would fail alike.

The function travels to the workers by reference (module and name, as pickle sends functions),
so it must be importable: a reward registered in a module of its own, not a lambda or a
function defined inside another.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import pickle
import signal
import time
from collections.abc import Sequence
from typing import Any

# How long past `timeout_s` a worker may take to report a sample its timer ended (scheduling lag
# on a loaded host); one still silent then is not coming back to the interpreter.
_GRACE_S = 5.0
# How long a fresh worker may take to start its interpreter and import the reward's module.
_START_S = 300.0


class _Timeout(Exception):
  pass


def _alarm(signum, frame):
  raise _Timeout


def _score(fn, completion: str, record: dict, timeout_s: float) -> tuple[str, Any]:
  """("ok", value) or ("error", message), in a worker; SIGALRM ends it at `timeout_s`."""
  try:
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
      value = fn(completion, record)
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)  # an alarm already due still lands in this try
    return "ok", value
  except _Timeout:
    return "error", f"TimeoutError: the reward took longer than reward.timeout_s={timeout_s:g}s"
  except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
    return "error", f"{type(e).__name__}: {e}"


def _serve(conn, fn_bytes: bytes, timeout_s: float) -> None:
  """A worker's main loop: reports ("ready", None) once `fn` is imported (or ("failed",
  message)), then answers each (completion, record) with `_score`'s pair until it reads None or
  the training process is gone."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
  signal.signal(signal.SIGALRM, _alarm)
  try:
    fn = pickle.loads(fn_bytes)
  except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
    conn.send(("failed", f"{type(e).__name__}: {e}"))
    return
  conn.send(("ready", None))
  while True:
    try:
      job = conn.recv()
    except EOFError:
      return
    if job is None:
      return
    result = _score(fn, *job, timeout_s)
    try:
      data = pickle.dumps(result)
    except Exception as e:
      data = pickle.dumps(("error", f"{type(e).__name__}: the reward's value cannot be sent ({e})"))
    conn.send_bytes(data)


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return f"signal {number}"


class _Worker:
  """One worker process, the training process's end of its pipe, and the sample it is on."""

  def __init__(self, context, fn_bytes: bytes, timeout_s: float):
    self.conn, child = context.Pipe()
    self.process = context.Process(
      target=_serve, args=(child, fn_bytes, timeout_s), name="reward-worker"
    )
    self.process.start()
    child.close()  # so that the worker's death reads as end-of-file here
    self.ready = False  # it has imported the function
    self.sample: int | None = None  # the index of the sample it is scoring
    self.since = time.monotonic()  # when it started, or was handed `sample`
    self.how: str | None = None  # how it ended, once it has

  def end(self, kill: bool) -> str:
    """Stops the process (`kill`: at once, as a stuck one ignores anything gentler) and says
    how it ended; once ended, says so again."""
    if self.how is None:
      if kill:
        self.process.kill()
      self.process.join(1.0)  # a dead worker's exit status arrives at once
      if self.process.exitcode is None:
        self.process.kill()
        self.process.join()
      code = self.process.exitcode
      self.conn.close()
      self.process.close()
      self.how = f"exit code {code}" if code >= 0 else f"killed by {_signal_name(-code)}"
    return self.how


def _stop(workers: list[_Worker]) -> None:
  """Ends `workers`: each is asked to exit, and killed if still running a second later."""
  for w in workers:
    if w.how is None:
      try:
        w.conn.send(None)
      except OSError:
        pass
  deadline = time.monotonic() + 1.0
  for w in workers:
    if w.how is None:
      w.process.join(max(deadline - time.monotonic(), 0.0))
      w.end(kill=w.process.exitcode is None)
  workers.clear()


class RewardPool:
  """Worker processes that score `(completion, record)` pairs with `fn`, `timeout_s` each."""

  def __init__(self, fn, *, workers: int, timeout_s: float, grace_s: float = _GRACE_S):
    if workers < 1 or not timeout_s > 0:
      raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
    try:
      self._fn_bytes = pickle.dumps(fn)
    except Exception as e:
      name = getattr(fn, "__qualname__", repr(fn))
      raise ValueError(
        f"reward function {name} cannot be sent to worker processes ({e}); with "
        "reward.timeout_s > 0 it must be importable by module and name (not a lambda or a "
        "nested function), or set reward.timeout_s=0 to score in the training process"
      ) from e
    self.fn, self.workers, self.timeout_s, self.grace_s = fn, workers, timeout_s, grace_s
    self._context = multiprocessing.get_context("forkserver")
    self._workers: list[_Worker] = []  # mutated in place: the finalizer below holds it
    # Workers still running at interpreter exit would be joined forever by multiprocessing.
    multiprocessing.util.Finalize(self, _stop, args=(self._workers,), exitpriority=10)
    self.restarts = 0  # workers replaced: killed past a hard deadline, or died scoring

  def score(self, completions: Sequence[str], records: Sequence[dict]) -> list[tuple[str, Any]]:
    """One ("ok", value) or ("error", message) per sample, in order.

    Raises:
      RuntimeError: a worker could not import the function, or died or hung while starting.
    """
    jobs = list(zip(completions, records, strict=True))
    out: list[Any] = [None] * len(jobs)
    queue = collections.deque(range(len(jobs)))
    while len(self._workers) < self.workers:
      self._workers.append(_Worker(self._context, self._fn_bytes, self.timeout_s))
    try:
      while True:
        for k in range(len(self._workers)):  # (`_hand` may put a fresh worker in slot k)
          while queue and self._workers[k].ready and self._workers[k].sample is None:
            self._hand(k, queue, jobs, out)
        if not queue and all(w.sample is None for w in self._workers):
          return out
        self._wait(out)
    except BaseException:
      # A worker still on a sample would answer it into the next batch: end those.
      busy = [w for w in self._workers if w.sample is not None]
      self._workers[:] = [w for w in self._workers if w.sample is None]
      for w in busy:
        w.end(kill=True)
      raise

  def _hand(self, k: int, queue: collections.deque, jobs: list, out: list) -> None:
    """Sends worker `k` the next queued sample."""
    i = queue.popleft()
    try:
      data = pickle.dumps(jobs[i])
    except Exception as e:
      out[i] = ("error", f"{type(e).__name__}: the sample cannot be sent to a worker ({e})")
      return
    try:
      self._workers[k].conn.send_bytes(data)
    except OSError:  # it died idle: the sample never reached it
      queue.appendleft(i)
      self._replace(k, kill=False)
      return
    self._workers[k].sample, self._workers[k].since = i, time.monotonic()

  def _wait(self, out: list) -> None:
    """Waits for a message, a worker's death or the nearest deadline, and deals with each."""
    hard_s = self.timeout_s + self.grace_s
    deadlines = [w.since + hard_s for w in self._workers if w.sample is not None]
    deadlines += [w.since + _START_S for w in self._workers if not w.ready]
    timeout = max(min(deadlines) - time.monotonic(), 0.0)
    waits = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
    woken = set(multiprocessing.connection.wait(waits, timeout))
    for k, w in enumerate(self._workers):
      if w.conn in woken or w.process.sentinel in woken:
        self._read(k, out)
    now = time.monotonic()
    for k, w in enumerate(self._workers):
      if w.sample is not None and now > w.since + hard_s:
        out[w.sample] = (
          "error",
          f"TimeoutError: the reward ran past reward.timeout_s={self.timeout_s:g}s without "
          f"returning to the interpreter; its worker was killed at {hard_s:g}s",
        )
        self._replace(k, kill=True)
      elif not w.ready and now > w.since + _START_S:
        self._fail(f"a reward worker process did not start within {_START_S:g}s")

  def _read(self, k: int, out: list) -> None:
    """Takes worker `k`'s message: it is ready, or a result; or finds it dead."""
    w = self._workers[k]
    try:
      if not w.conn.poll():  # woken by its exit alone
        raise EOFError
      kind, payload = w.conn.recv()
    except (EOFError, OSError):
      if not w.ready:
        self._fail(f"a reward worker process died while starting ({w.end(kill=False)})")
      if w.sample is not None:
        out[w.sample] = (
          "error",
          f"the reward worker process died scoring this sample ({w.end(kill=False)})",
        )
      self._replace(k, kill=False)
      return
    if kind == "failed":
      self._fail(f"the reward function cannot be imported in a worker process: {payload}")
    elif kind == "ready":
      w.ready = True
    elif w.sample is not None:
      out[w.sample], w.sample = (kind, payload), None

  def _replace(self, k: int, kill: bool) -> None:
    """Ends worker `k` and starts a fresh one in its place."""
    self._workers[k].end(kill=kill)
    self.restarts += 1
    self._workers[k] = _Worker(self._context, self._fn_bytes, self.timeout_s)

  def _fail(self, message: str) -> None:
    """Ends every worker (the next batch starts afresh) and raises `message`."""
    _stop(self._workers)
    raise RuntimeError(message)

  def close(self) -> None:
    """Ends the workers; a later `score` starts fresh ones."""
    _stop(self._workers)
