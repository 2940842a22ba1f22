"""Silences the stray reports a failed orbax read leaves behind on stderr.

When orbax restores a checkpoint whose array files cannot be read, the first failed read ends
the event loop the reads run on while the others are still in flight. The failure itself is
raised (and `Checkpointer.restore_newest_readable` logs it in one line and falls back to an
older step), but what is left of the other reads then reports itself, dozens of times for one
unreadable checkpoint: TensorStore's callbacks find the loop closed (`RuntimeError: Event loop
is closed`, through `sys.unraisablehook`), the read coroutines that never finished are
collected with their exception (`Exception ignored in: <coroutine ...>`, the same hook), and
asyncio logs the futures whose exception no one read ("... exception was never retrieved"), the
orbax coroutines' and TensorStore's own.

`silenced()` drops exactly those three kinds of report (counting them), and passes every other
one on.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import traceback
from collections import Counter
from collections.abc import Iterator

_ORBAX = f"{os.sep}orbax{os.sep}"


def _from_orbax(tb) -> bool:
  return any(_ORBAX in frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb))


def noise_kind(unraisable) -> str | None:
  """Which report of a failed orbax read a `sys.unraisablehook` report is, or None."""
  code = getattr(unraisable.object, "cr_code", None)
  if code is not None and _ORBAX in code.co_filename:
    return "coroutine"  # an orbax read coroutine collected with its exception
  # A read's completion callback scheduled onto the loop that the failed restore closed.
  frames = traceback.extract_tb(unraisable.exc_traceback)
  closed = isinstance(unraisable.exc_value, RuntimeError) and unraisable.object is None
  closed = closed and str(unraisable.exc_value) == "Event loop is closed"
  return "closed loop" if closed and frames and frames[0].name == "call_soon_threadsafe" else None


class _NeverRetrieved(logging.Filter):
  """asyncio's "... exception was never retrieved" for a future that an orbax read failed: its
  exception passed through orbax, or was set by native code (TensorStore's read, no Python
  frame at all)."""

  def __init__(self, counts: Counter):
    super().__init__()
    self.counts = counts

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    noise = exc is not None and (exc.__traceback__ is None or _from_orbax(exc.__traceback__))
    if noise and "exception was never retrieved" in record.getMessage():
      self.counts["never retrieved"] += 1
      return False
    return True


@contextlib.contextmanager
def silenced() -> Iterator[Counter]:
  """Drops the reports of failed orbax reads (`noise_kind`, and asyncio's log of their futures)
  while it is entered, counting them by kind in the Counter it yields. On leaving it collects
  the garbage first, so that the coroutines and futures of reads that failed inside it report
  (and are dropped) before it ends."""
  counts, previous = Counter(), sys.unraisablehook

  def hook(unraisable):
    kind = noise_kind(unraisable)
    if kind is None:
      previous(unraisable)
    else:
      counts[kind] += 1

  log, never_retrieved = logging.getLogger("asyncio"), _NeverRetrieved(counts)
  sys.unraisablehook = hook
  log.addFilter(never_retrieved)
  try:
    yield counts
  finally:
    gc.collect()
    sys.unraisablehook = previous
    log.removeFilter(never_retrieved)
