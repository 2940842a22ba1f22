"""Code-execution rewards: the completion, completed into a program by the record, runs in the
sandbox (jaxrl.rewards.sandbox), one contained process per completion, and the record's tests
are checked against it by a harness the program cannot reach (jaxrl.rewards._harness).

A record carries `code_prefix` (what the prompt opened, e.g. "def f(x):return ") and `tests`
(Python expressions that must evaluate to True, e.g. "f(3)==11"). The program is
`<code_prefix><completion>`; each test is evaluated outside the program's process, with the
program's functions called through a pipe and their results taken back as plain data only, so
the program cannot shadow what a test uses, return an object that equals anything, exit early
with success, print a report, or see a test's expected value. The threat model, and what each
fence costs: docs/rewards.md.

- "code_tests": 1.0 iff every test passes (verl's and TRL's pass/fail code reward);
- "code_tests_passed": the fraction of tests that pass (partial credit).

Identical programs in one batch (the same prefix, completion and tests: a group's samples often
agree) run once and share the outcome (`dedupe`, on by default): programs are taken to be
deterministic, so one that draws random numbers or reads the clock gets one draw for all its
copies. Set config.reward.sandbox.dedupe=False to run every copy.

A program that does not compile, raises before its tests, runs out of time or memory, or prints
past the output cap scores 0, and a test whose call raises fails: that is the completion's
failure, not the reward's. Only a sandbox that cannot start raises (an error per
`reward.on_error`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxrl.rewards import registry
from jaxrl.rewards.sandbox import Limits, Outcome, SandboxPool

_DEFAULT_LIMITS = Limits()


class SandboxError(RuntimeError):
  """The sandbox could not run a program (not the program's failure)."""


def program(completion: str, record: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
  """(the source run for `completion`: the record's prefix and the completion, the tests)."""
  try:
    prefix, tests = record["code_prefix"], record["tests"]
  except KeyError as e:
    raise KeyError(
      f"a code reward needs records with 'code_prefix' and 'tests' fields; this one has "
      f"{sorted(record)}"
    ) from e
  if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests) or not tests:
    raise ValueError(f"record['tests'] must be a non-empty list of strings, got {tests!r}")
  if not isinstance(prefix, str):
    raise ValueError(f"record['code_prefix'] must be a string, got {prefix!r}")
  return f"{prefix}{completion}\n", tuple(tests)


def tests_passed(outcome: Outcome, n: int) -> tuple[int, int] | None:
  """(passed, n) from the harness's report, or None if there is none covering all `n` tests
  (the sandbox ended the program before the harness finished)."""
  if outcome.status == "setup":
    raise SandboxError(f"the sandbox could not start: {outcome.stderr.strip()[-500:]}")
  if outcome.passed is None or len(outcome.passed) != n:
    return None
  return sum(outcome.passed), n


class CodeTestsReward:
  """A reward function (completion, record) -> float that runs programs in a SandboxPool;
  `score_batch` runs a whole batch's programs concurrently."""

  def __init__(
    self,
    *,
    all_or_nothing: bool,
    limits: Limits = _DEFAULT_LIMITS,
    workers: int = 2,
    dedupe: bool = True,
  ):
    self.all_or_nothing, self.limits, self.workers = all_or_nothing, limits, workers
    self.dedupe = dedupe
    self.programs_run = 0  # sandboxed programs started by score_batch (copies run once)
    self.__name__ = "code_tests" if all_or_nothing else "code_tests_passed"
    self._pool: SandboxPool | None = None

  def configured(self, limits: Limits, workers: int, dedupe: bool = True) -> CodeTestsReward:
    """The same reward under other limits (config.reward.sandbox); checks the isolation asked
    for is available here, before any work."""
    out = CodeTestsReward(
      all_or_nothing=self.all_or_nothing, limits=limits, workers=workers, dedupe=dedupe
    )
    out.pool()
    return out

  @property
  def isolation(self) -> str:
    """The isolation the programs run under on this host ("namespaces" or "limits")."""
    return self.pool().isolation

  def pool(self) -> SandboxPool:
    if self._pool is None:
      self._pool = SandboxPool(self.limits, workers=self.workers)
    return self._pool

  def __getstate__(self):  # to reward worker processes: the settings, not the threads
    return {**self.__dict__, "_pool": None}

  def _value(self, passed: tuple[int, int] | None) -> float:
    if passed is None:
      return 0.0
    k, n = passed
    return float(k == n) if self.all_or_nothing else k / n

  def __call__(self, completion: str, record: dict[str, Any]) -> float:
    source, tests = program(completion, record)
    (outcome,) = self.pool().run_many([source], [tests])
    return self._value(tests_passed(outcome, len(tests)))

  def score_batch(
    self, completions: Sequence[str], records: Sequence[dict[str, Any]]
  ) -> list[tuple[str, Any]]:
    """One ("ok", reward) or ("error", message) per sample, the programs run concurrently
    (with `dedupe`, each distinct program once)."""
    out: list = [None] * len(completions)
    first: dict[tuple, int] = {}  # (program, tests) -> its run's index
    runs: list[tuple[str, tuple[str, ...]]] = []
    copies = []  # per sample: (i, run index)
    for i, (completion, record) in enumerate(zip(completions, records, strict=True)):
      try:
        key = program(completion, record)
      except (KeyError, ValueError) as e:
        out[i] = ("error", f"{type(e).__name__}: {e}")
        continue
      if not self.dedupe or key not in first:
        first[key] = len(runs)
        runs.append(key)
      copies.append((i, first[key] if self.dedupe else len(runs) - 1))
    outcomes = self.pool().run_many([p for p, _ in runs], [t for _, t in runs])
    self.programs_run += len(runs)
    scored = []
    for outcome, (_, tests) in zip(outcomes, runs, strict=True):
      try:
        scored.append(("ok", self._value(tests_passed(outcome, len(tests)))))
      except SandboxError as e:
        scored.append(("error", f"SandboxError: {e}"))
    for i, r in copies:
      out[i] = scored[r]
    return out

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None


registry.register("code_tests")(CodeTestsReward(all_or_nothing=True))
registry.register("code_tests_passed")(CodeTestsReward(all_or_nothing=False))
