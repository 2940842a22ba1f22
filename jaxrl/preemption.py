"""Preemption: SIGTERM (what Cloud TPU, GKE and Slurm send before they take a machine back)
asks the run to stop at the end of the step in flight, checkpoint there and exit.

`StopRequest` installs the handler for the duration of a `with` block (main thread only: Python
delivers signals there) and restores the previous one after. The training loops ask
`requested_anywhere()` after each step; on it they save a forced checkpoint of the step just
finished and raise `Preempted`, which `launch.train` turns into one line and exit code 143
(128 + SIGTERM), so a scheduler sees a run that did not finish and the same command resumes it.

In a multi-process run the signal may reach one host only, or reach the hosts on either side of
a step's end: each process acting on its own flag would enter different collectives (one a
checkpoint save, another the next step) and the run would hang. So after every step the
processes exchange their flags and all stop at the first step after which any of them had one:
every process saves the same step's checkpoint (orbax's saves are collective) and raises
`Preempted`. The exchange goes through the coordinator's key-value store
(`distributed.allgather_objects`), not through a program on the devices, so it never meets a
program still running on a sub-mesh; one process exchanges nothing. JAX's own preemption sync
manager (`multihost_utils.reached_preemption_sync_point`) works on CPU as well, but it hears
SIGTERM through a handler of its own (which this one replaces), picks its step some time after
the signal from the steps the hosts have reached by then, and has no answer in one process.
"""

from __future__ import annotations

import signal
import threading

import jax

from jaxrl import distributed


class Preempted(Exception):
  """The run stopped on SIGTERM after checkpointing `step` of `phase`."""

  def __init__(self, phase: str, step: int, directory):
    self.phase, self.step, self.directory = phase, step, directory
    super().__init__(
      f"stopped on SIGTERM after {phase} step {step}, checkpointed in {directory}; run the same "
      "command (config.resume=True) to continue from there"
    )


class StopRequest:
  """`with StopRequest() as stop: ... stop.requested`: True once SIGTERM arrived here;
  `stop.requested_anywhere()`: True once it arrived at any process of the run."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def _handle(self, signum, frame) -> None:
    self.requested = True

  def requested_anywhere(self) -> bool:
    """Whether SIGTERM has reached any process of the run. Every process must ask at the same
    point of every step (they exchange their flags); one process reads its own flag."""
    if jax.process_count() == 1:
      return self.requested
    # What was exchanged decides: a signal landing here after this process's flag was sent
    # counts at the next step, on every process alike.
    anywhere = any(distributed.allgather_objects(self.requested))
    if anywhere:
      self.requested = True
    return anywhere

  def __enter__(self) -> StopRequest:
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
