"""A pytest plugin for crashed pytest-xdist workers (registered by tests/conftest.py).

A worker killed by a fatal signal (a native fault in XLA or another C extension) shows up only
as "worker 'gwN' crashed while running T", and its faulthandler dump goes to a stderr of which CI
keeps only the tail (the CI run of 2026-12-06 showed the dump's last lines: the extension module
list). Each worker writes its dump to a file of its own instead; when a worker dies the
controller reads it, adds the faulting thread's frames to T's failure and prints them again in a
"worker crashes" section just before the short summary. The test fails as before.
"""

import faulthandler
import os
import re
import tempfile

import pytest

_CRASHES: list[tuple[str, str, list[str]]] = []  # (test, worker, the dump's summary)
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
def pytest_handlecrashitem(crashitem, report):
  path = _fault_path(report.node.workerinput)
  try:
    with open(path) as f:
      lines = f.read().splitlines()
    os.remove(path)
  except OSError:
    lines = []
  summary = _fault_summary(lines) or [_NO_DUMP]
  report.longrepr = "\n".join([str(report.longrepr), *summary])
  _CRASHES.append((crashitem, report.node.gateway.id, summary))


def pytest_terminal_summary(terminalreporter):
  if not _CRASHES:
    return
  terminalreporter.write_sep("=", f"worker crashes: {len(_CRASHES)}", red=True)
  for test, worker, summary in _CRASHES:
    terminalreporter.write_line(f"{test}: worker {worker} crashed")
    for x in summary:
      terminalreporter.write_line(f"  {x}")
