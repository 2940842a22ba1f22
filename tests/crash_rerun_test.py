"""tests/crash_rerun.py in pytest runs of their own (2 xdist workers): a test whose worker dies of
a fatal signal is reported with the faulting stack and run once more; a second crash fails it."""

import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CRASHY = """
import os, signal
from pathlib import Path

def test_crashes_then_passes():
  count = Path(os.environ["CRASH_COUNT"])
  n = int(count.read_text()) if count.exists() else 0
  count.write_text(str(n + 1))
  if n < int(os.environ["CRASHES"]):
    os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))

def test_never_crashes():
  pass
"""


def _run(tmp_path: Path, crashes: int, uid: str, sig="SIGSEGV") -> subprocess.CompletedProcess:
  (tmp_path / "pytest.ini").write_text("[pytest]\n")  # none of the repository's settings
  (tmp_path / "crashy_test.py").write_text(CRASHY)
  env = dict(
    os.environ,
    PYTHONPATH=str(Path(__file__).parent),
    CRASH_COUNT=str(tmp_path / "count"),
    CRASHES=str(crashes),
    SIGNAL=sig,
  )
  cmd = [sys.executable, "-m", "pytest", "-n", "2", "-p", "crash_rerun", "-p", "no:cacheprovider"]
  cmd += [f"--testrunuid={uid}", "crashy_test.py"]
  return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _left_behind(uid: str) -> list[str]:
  return glob.glob(os.path.join(tempfile.gettempdir(), f"jaxrl-test-fault-{uid}-*"))


def test_a_test_whose_worker_crashes_once_runs_again_and_the_fault_is_printed(tmp_path):
  r = _run(tmp_path, crashes=1, uid="crashonce")
  out = r.stdout
  assert r.returncode == 0, out + r.stderr
  assert (tmp_path / "count").read_text() == "2"  # run, crashed, run again
  assert "2 passed, 1 rerun" in out
  summary = out[out.index("worker crashes: 1") :]
  assert "crashy_test.py::test_crashes_then_passes: worker gw" in summary
  assert "crashed; the test run again" in summary
  assert "Fatal Python error: Segmentation fault" in summary
  assert 'crashy_test.py", line 10 in test_crashes_then_passes' in summary  # the os.kill
  assert "Extension modules" not in summary
  assert not _left_behind("crashonce")


def test_a_test_whose_worker_crashes_twice_fails(tmp_path):
  r = _run(tmp_path, crashes=2, uid="crashtwice")
  out = r.stdout
  assert r.returncode == 1, out + r.stderr
  assert (tmp_path / "count").read_text() == "2"  # not a third time
  assert "1 failed, 1 passed, 1 rerun" in out
  assert out.count("crashed; the test run again") == 1
  assert out.count("crashed; the test failed") == 1
  assert "FAILED crashy_test.py::test_crashes_then_passes" in out
  assert not _left_behind("crashtwice")


def test_a_worker_killed_without_a_dump_is_named_so(tmp_path):
  r = _run(tmp_path, crashes=1, uid="crashkill", sig="SIGKILL")  # as the OOM killer does
  assert r.returncode == 0, r.stdout + r.stderr
  assert "2 passed, 1 rerun" in r.stdout
  assert "no faulthandler dump: a signal Python cannot handle" in r.stdout
  assert not _left_behind("crashkill")
