"""Where a JAX process's first step goes: tracing, lowering and XLA compilation, per program.

Imports only jax, so the Tunix peer's venv can use it too. Inside `with CompileLog() as log:`
JAX logs every compilation (`jax_log_compiles`, kept off the console) and reports its durations
through `jax.monitoring`; `log.summary()` then gives the totals and each program's XLA compile
seconds (programs of the same name summed: eager ops compile one small program per shape).
"""

from __future__ import annotations

import collections
import logging
import re

import jax

_FINISHED = re.compile(r"Finished XLA compilation of (.+?) in ([0-9.eE+-]+) sec")
_EVENTS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace_s",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
  "/jax/core/compile/backend_compile_duration": "xla_compile_s",
}


class _Handler(logging.Handler):
  def __init__(self, log: CompileLog):
    super().__init__(logging.DEBUG)
    self.log = log

  def emit(self, record: logging.LogRecord) -> None:
    m = _FINISHED.search(record.getMessage())
    if m:
      self.log.programs[m.group(1)] += float(m.group(2))
      self.log.counts[m.group(1)] += 1


class CompileLog:
  """Compile time by phase and by program while the context is active."""

  def __init__(self):
    self.totals = dict.fromkeys(_EVENTS.values(), 0.0)
    self.programs: collections.Counter = collections.Counter()
    self.counts: collections.Counter = collections.Counter()

  def _on_event(self, event: str, duration: float, **_) -> None:
    if event in _EVENTS:
      self.totals[_EVENTS[event]] += duration

  def __enter__(self) -> CompileLog:
    self._logger = logging.getLogger("jax")
    self._saved = (self._logger.propagate, self._logger.level, jax.config.jax_log_compiles)
    self._handler = _Handler(self)
    self._logger.addHandler(self._handler)
    self._logger.propagate = False  # the log lines are data here, not console output
    self._logger.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_event)
    self._logger.removeHandler(self._handler)
    self._logger.propagate, level, log_compiles = self._saved
    self._logger.setLevel(level)
    jax.config.update("jax_log_compiles", log_compiles)

  def summary(self, top: int = 8) -> dict:
    """Totals (seconds) and the `top` programs by XLA compile seconds; the rest summed."""
    ranked = self.programs.most_common()
    rest = ranked[top:]
    return {
      **{k: round(v, 3) for k, v in self.totals.items()},
      "programs": len(ranked),
      "compilations": sum(self.counts.values()),
      "top_xla_compile_s": {
        f"{name} x{self.counts[name]}" if self.counts[name] > 1 else name: round(s, 3)
        for name, s in ranked[:top]
      },
      "other_xla_compile_s": round(sum(s for _, s in rest), 3),
      "other_programs": len(rest),
    }
