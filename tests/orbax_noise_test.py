"""A checkpoint fallback inside `silenced()` prints its log lines and nothing of the failed
reads, which it counts; other unraisable reports still pass through."""

import json
import sys
import types

from helpers import run_child

from jaxrl import orbax_noise

# Two steps of 30 arrays; the newer loses its array files, so the fallback's first read fails
# while the others are in flight (in a child: the reports come from threads and garbage
# collection, and pytest has an unraisable hook of its own).
_CHILD = r"""
import gc, json, sys, time
from pathlib import Path
import jax, numpy as np
from jaxrl.checkpoint import Checkpointer
from jaxrl.orbax_noise import silenced

d = Path(sys.argv[1])
rng = np.random.default_rng(0)
state = {f"w{i}": jax.numpy.asarray(rng.standard_normal((256, 128), np.float32)) for i in range(30)}
target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
with Checkpointer(d) as ck:
  ck.save(1, state, {"step": 1})
  ck.save(2, state, {"step": 2})
for f in (d / "2" / "state").rglob("*"):
  if f.is_file() and f.parent.name == "d" and f.parent.parent.name.startswith("ocdbt"):
    f.unlink()
with silenced() as counts:
  with Checkpointer(d) as ck:
    # Whether the other reads are still in flight when the first fails is a race: read until
    # some are (each try reports what it left behind once it is collected).
    for _ in range(20):
      try:
        ck.restore(2, target)
      except Exception:
        gc.collect()
      if counts:
        break
    step, _, _ = ck.restore_newest_readable(target, log=lambda m: print(m, file=sys.stderr))
  time.sleep(0.2)  # the reads' callbacks come from TensorStore's threads: let the late ones land
print(json.dumps({"step": step, "dropped": dict(counts)}))
"""


def test_a_fallback_from_an_unreadable_checkpoint_prints_only_its_log_lines(tmp_path):
  done = run_child([sys.executable, "-c", _CHILD, str(tmp_path / "ck")])
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert out["step"] == 1
  assert out["dropped"].get("closed loop", 0) + out["dropped"].get("coroutine", 0) > 0, out
  assert "checkpoint 2 cannot be read" in done.stderr
  assert "falling back to checkpoint 1" in done.stderr
  for report in ("Traceback", "Exception ignored", "exception was never retrieved"):
    assert report not in done.stderr, done.stderr[-3000:]


def test_other_unraisable_reports_pass_through():
  seen = []
  real, sys.unraisablehook = sys.unraisablehook, seen.append
  try:
    with orbax_noise.silenced() as counts:
      other = types.SimpleNamespace(
        exc_type=ValueError, exc_value=ValueError("x"), exc_traceback=None, object=None
      )
      sys.unraisablehook(other)
  finally:
    sys.unraisablehook = real
  assert seen == [other] and not counts
