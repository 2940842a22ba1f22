"""A pytest plugin for crashed pytest-xdist workers (registered by tests/conftest.py).

A worker killed by a fatal signal (a native fault in XLA or another C extension) shows up only
as "worker 'gwN' crashed while running T", and its faulthandler dump goes to a stderr of which CI
keeps the tail. Each worker writes its dump to a file of its own instead; the controller reads
it when the worker dies, prints the faulting thread's stack in the summary, and hands T out once
more (to a live worker or the one xdist starts in the crashed one's place). A test whose worker
crashes twice fails, and every crash is listed in the summary and counted in the final line
("1 rerun"). Written for a crash CI saw once (2026-12-06, in tests/rollout/multiturn_test.py)
that a fresh-clone run of the same commit and 35 repeats of the test did not reproduce.
"""

import faulthandler
import os
import re
import tempfile

import pytest

_CRASHES: list[tuple[str, str, str, list[str]]] = []  # (test, worker, outcome, dump lines)
_RERUN: set[str] = set()
_NO_DUMP = "no faulthandler dump: a signal Python cannot handle (SIGKILL, e.g. out of memory)"


def _fault_path(workerinput) -> str:
  name = f"jaxrl-test-fault-{workerinput['testrunuid']}-{workerinput['workerid']}.txt"
  return os.path.join(tempfile.gettempdir(), name)


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin has enabled it
def pytest_configure(config):
  workerinput = getattr(config, "workerinput", None)
  if workerinput is not None:
    config._jaxrl_fault_file = open(_fault_path(workerinput), "w")  # noqa: SIM115
    faulthandler.enable(file=config._jaxrl_fault_file, all_threads=True)


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin has disabled it
def pytest_unconfigure(config):
  f = getattr(config, "_jaxrl_fault_file", None)
  if f is not None:
    f.close()
    os.remove(f.name)  # a worker that ends normally leaves nothing behind


# Frames of the test runner itself (pytest, pluggy, xdist, execnet): the same in every dump.
_HARNESS = re.compile(r"/(_pytest|pluggy|xdist|execnet)/|File \"<string>\"")


def _fault_summary(lines: list[str]) -> list[str]:
  """The signal line and the stack of the thread that faulted (every thread's stack when the
  fault was in a thread with no Python frames), without the test runner's own frames and the
  extension module list."""
  head = [x for x in lines if x.startswith("Fatal Python error")][:1]
  blocks, block = [], []
  for x in lines:
    if x.startswith(("Thread 0x", "Current thread 0x", "Extension modules")):
      blocks.append(block)
      block = []
    if x.strip():
      block.append(x)
  blocks.append(block)
  current = [b for b in blocks if b and b[0].startswith("Current thread")]
  threads = [b for b in blocks if b and b[0].startswith(("Thread 0x", "Current thread"))]
  frames = [x for b in (current or threads) for x in b if not _HARNESS.search(x)]
  return head + frames[:40]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, run by the controller
def pytest_handlecrashitem(crashitem, report, sched):
  path = _fault_path(report.node.workerinput)
  try:
    with open(path) as f:
      lines = f.read().splitlines()
    os.remove(path)
  except OSError:
    lines = []
  worker = report.node.gateway.id
  rerun = crashitem not in _RERUN and hasattr(sched, "mark_test_pending")
  if rerun:
    try:
      sched.mark_test_pending(crashitem)
    except NotImplementedError:  # a scheduler that cannot hand a test out again
      rerun = False
  if rerun:
    _RERUN.add(crashitem)
    report.outcome = "rerun"
  summary = _fault_summary(lines) or [_NO_DUMP]
  report.longrepr = "\n".join([str(report.longrepr), *summary])
  _CRASHES.append((crashitem, worker, "run again" if rerun else "failed", summary))


def pytest_report_teststatus(report, config):
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN", {"yellow": True})
  return None


def pytest_terminal_summary(terminalreporter):
  if not _CRASHES:
    return
  terminalreporter.write_sep("=", f"worker crashes: {len(_CRASHES)}", red=True)
  for test, worker, outcome, summary in _CRASHES:
    terminalreporter.write_line(f"{test}: worker {worker} crashed; the test {outcome}")
    for x in summary:
      terminalreporter.write_line(f"  {x}")
