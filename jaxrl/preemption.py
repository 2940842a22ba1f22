"""Preemption: SIGTERM (what Cloud TPU, GKE and Slurm send before they take a machine back)
asks the run to stop at the end of the step in flight, checkpoint there and exit.

`StopRequest` installs the handler for the duration of a `with` block (main thread only: Python
delivers signals there) and restores the previous one after. The training loops read
`requested` after each step; on it they save a forced checkpoint of the step just finished and
raise `Preempted`, which `launch.train` turns into one line and exit code 143 (128 + SIGTERM),
so a scheduler sees a run that did not finish and the same command resumes it.
"""

from __future__ import annotations

import signal
import threading


class Preempted(Exception):
  """The run stopped on SIGTERM after checkpointing `step` of `phase`."""

  def __init__(self, phase: str, step: int, directory):
    self.phase, self.step, self.directory = phase, step, directory
    super().__init__(
      f"stopped on SIGTERM after {phase} step {step}, checkpointed in {directory}; run the same "
      "command (config.resume=True) to continue from there"
    )


class StopRequest:
  """`with StopRequest() as stop: ... stop.requested`: True once SIGTERM arrived."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def _handle(self, signum, frame) -> None:
    self.requested = True

  def __enter__(self) -> StopRequest:
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
