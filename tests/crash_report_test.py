"""tests/crash_report.py in pytest runs of their own (2 xdist workers): a test whose worker dies
of a fatal signal fails with the faulting thread's frames in its failure and in the summary."""

import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import run_child

CRASHY = """
import os, signal

def test_crashes():
  os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))

def test_passes():
  pass
"""


def _run(tmp_path: Path, sig: str, uid: str) -> subprocess.CompletedProcess:
  (tmp_path / "pytest.ini").write_text("[pytest]\n")  # none of the repository's settings
  (tmp_path / "crashy_test.py").write_text(CRASHY)
  # (no PYTHONFAULTHANDLER: the plugin's own report of the crash is what is tested)
  env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent), SIGNAL=sig)
  cmd = [sys.executable, "-m", "pytest", "-n", "2", "-p", "crash_report", "-p", "no:cacheprovider"]
  cmd += [f"--testrunuid={uid}", "crashy_test.py"]
  return run_child(cmd, cwd=tmp_path, env=env)


def _left_behind(uid: str) -> list[str]:
  return glob.glob(os.path.join(tempfile.gettempdir(), f"jaxrl-test-fault-{uid}-*"))


@pytest.mark.e2e
def test_a_crashed_workers_test_fails_with_the_faulting_frames_printed(tmp_path):
  r = _run(tmp_path, "SIGSEGV", uid="crashsegv")
  out = r.stdout
  assert r.returncode == 1, out + r.stderr
  assert "1 failed, 1 passed" in out
  assert "FAILED crashy_test.py::test_crashes" in out
  summary = out[out.index("worker crashes: 1") : out.index("short test summary info")]
  assert "crashy_test.py::test_crashes: worker gw" in summary
  assert "Fatal Python error: Segmentation fault" in summary
  assert 'crashy_test.py", line 5 in test_crashes' in summary  # the os.kill
  assert "_pytest" not in summary and "Extension modules" not in summary  # the runner's frames
  failure = out[out.index("= FAILURES =") : out.index("worker crashes: 1")]
  assert 'crashy_test.py", line 5 in test_crashes' in failure
  assert not _left_behind("crashsegv")


@pytest.mark.e2e
def test_a_worker_killed_without_a_dump_is_named_so(tmp_path):
  r = _run(tmp_path, "SIGKILL", uid="crashkill")  # as the kernel's OOM killer does
  assert r.returncode == 1, r.stdout + r.stderr
  assert "1 failed, 1 passed" in r.stdout
  assert "no faulthandler dump: a signal Python cannot handle" in r.stdout
  assert not _left_behind("crashkill")
