"""Tests for jaxrl.checkpoint: round trips, pruning, atomic saves and clear restore errors."""

import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.checkpoint import Checkpointer, CheckpointError, UnreadableCheckpointError

META = {"data": {"some": [1, 2]}, "phase": "rl"}


def make_state(seed: int = 0, din: int = 3, dout: int = 5):
  model = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))
  _, params = nnx.split(model)
  return {
    "params": params,
    "opt_state": optax.adamw(1e-3).init(params),
    "step": jnp.int32(5),
    "rng": jax.random.PRNGKey(3),
  }


def abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_bit_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def tmp_dirs(directory):
  return [n for n in os.listdir(directory) if "tmp" in n]


def test_round_trip_is_bit_identical(tmp_path):
  state = make_state()
  # Make the optimizer state non-trivial so mu/nu are not all zeros.
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), state["params"])
  _, state["opt_state"] = optax.adamw(1e-3).update(grads, state["opt_state"], state["params"])
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(5, state, META)
    assert ckpt.latest_step() == 5
    restored, meta = ckpt.restore(None, abstract(state))
  assert_bit_identical(restored, state)
  assert isinstance(restored["params"], nnx.State)
  assert type(restored["opt_state"][0]) is type(state["opt_state"][0])
  assert meta == META


def test_restore_in_fresh_checkpointer_with_real_array_target(tmp_path):
  state = make_state(seed=1)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(7, state, META)
  # A resumed run: new Checkpointer, target built from freshly initialised arrays.
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 7
    restored, meta = ckpt.restore(7, make_state(seed=2))
  assert_bit_identical(restored, state)
  assert meta == META


def test_restore_lands_on_target_sharding(tmp_path):
  mesh = jax.make_mesh((8,), ("fsdp",))
  x = jax.device_put(
    jnp.arange(8 * 12, dtype=jnp.float32).reshape(8, 12), NamedSharding(mesh, P("fsdp"))
  )
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"x": x}, {})
    other = jax.make_mesh((2, 4), ("data", "tensor"))
    want = NamedSharding(other, P("data", "tensor"))
    restored, _ = ckpt.restore(1, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=want)})
  assert restored["x"].sharding == want
  np.testing.assert_array_equal(np.asarray(restored["x"]), np.asarray(x))


def test_typed_prng_key_round_trips(tmp_path):
  state = {"key": jax.random.split(jax.random.key(11), 3)}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, {})
    restored, _ = ckpt.restore(1, abstract(state))
  assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(
    jax.random.key_data(restored["key"]), jax.random.key_data(state["key"])
  )


def test_save_every_force_and_existing_step(tmp_path):
  state = {"w": jnp.ones(3)}
  with Checkpointer(tmp_path, save_every=10, max_to_keep=None) as ckpt:
    assert not ckpt.save(5, state, {})
    assert ckpt.save(10, state, {})
    assert ckpt.save(13, state, {}, force=True)
    # Same step again (e.g. a forced final save right after a periodic one) is a no-op.
    assert not ckpt.save(13, state, {}, force=True)
    assert ckpt.all_steps() == [10, 13]


def test_max_to_keep_prunes_old_steps(tmp_path):
  state = {"w": jnp.ones(3)}
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    for step in range(1, 6):
      state = {"w": state["w"] + 1}
      ckpt.save(step, state, {"step": step})
    assert ckpt.all_steps() == [4, 5]
    restored, meta = ckpt.restore(None, abstract(state))
  assert sorted(n for n in os.listdir(tmp_path) if n.isdigit()) == ["4", "5"]
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.full(3, 6.0))
  assert meta == {"step": 5}


def test_nothing_to_restore_names_directory(tmp_path):
  with Checkpointer(tmp_path / "empty") as ckpt:
    with pytest.raises(FileNotFoundError, match="empty"):
      ckpt.restore(None, {"w": jnp.ones(3)})
    ckpt.save(2, {"w": jnp.ones(3)}, {})
    with pytest.raises(FileNotFoundError, match=r"step 9 .*empty.*\[2\]"):
      ckpt.restore(9, {"w": jnp.ones(3)})


def test_failed_save_leaves_no_visible_step(tmp_path, monkeypatch):
  state = make_state()
  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, state, {"phase": "rl"})
  ckpt.wait()

  partial_files = []
  original = ocp.StandardCheckpointHandler.finalize

  def fail_before_commit(self, tmp_dir):
    # finalize runs after every array is written into the step's temporary directory and
    # before the rename that commits it: failing here leaves a genuinely half-done step.
    partial_files.extend(f for _, _, files in os.walk(os.fspath(tmp_dir)) for f in files)
    raise OSError("disk full (simulated)")

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "finalize", fail_before_commit)
  with pytest.raises(OSError, match="disk full"):
    ckpt.save(2, jax.tree.map(lambda x: x + 1, state), {"phase": "rl"})
    ckpt.wait()
  assert partial_files, "the simulated failure never ran; orbax's save path changed"
  assert tmp_dirs(tmp_path) == ["2.orbax-checkpoint-tmp"]
  assert ckpt.latest_step() == 1
  assert not (tmp_path / "2").exists()

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "finalize", original)
  restored, meta = ckpt.restore(None, abstract(state))
  assert_bit_identical(restored, state)
  assert meta == {"phase": "rl"}
  ckpt.close()
  ckpt.close()  # closing twice is safe

  # A resumed run sees only the committed step, and orbax removes the partial leftovers
  # (in the background; its next save waits for that to finish).
  with Checkpointer(tmp_path) as resumed:
    assert resumed.all_steps() == [1]
    assert resumed.save(2, state, {})
    assert resumed.all_steps() == [1, 2]
    assert tmp_dirs(tmp_path) == []


def test_non_json_meta_is_rejected_before_writing(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(TypeError, match="JSON-serialisable"):
      ckpt.save(1, {"w": jnp.ones(3)}, {"bad": object()})
    assert ckpt.latest_step() is None


def test_shape_mismatch_names_directory_and_leaf(tmp_path):
  with Checkpointer(tmp_path / "run") as ckpt:
    ckpt.save(3, make_state(din=3), META)
    with pytest.raises(CheckpointError) as e:
      ckpt.restore(3, abstract(make_state(din=4)))
  msg = str(e.value)
  assert str(tmp_path / "run" / "3") in msg
  assert "params/kernel/value (checkpoint (3, 5) vs target (4, 5))" in msg
  assert "opt_state/0/mu/kernel/value" in msg


def test_structure_mismatch_names_missing_and_extra_leaves(tmp_path):
  state = make_state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(3, state, META)
    target = abstract(state)
    del target["rng"]
    target["extra"] = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(CheckpointError) as e:
      ckpt.restore(3, target)
  msg = str(e.value)
  assert str(tmp_path) in msg
  assert "in target but not in checkpoint: extra" in msg
  assert "in checkpoint but not in target: rng" in msg


# When one tensorstore read fails, orbax closes its event loop while sibling reads are still
# in flight; their completions then raise "Event loop is closed" in a tensorstore thread.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupted_checkpoint_names_directory(tmp_path):
  state = make_state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(4, state, META)
  # Lose the array data but keep the metadata, as after a partial copy between filesystems.
  for name in os.listdir(tmp_path / "4" / "state"):
    path = tmp_path / "4" / "state" / name
    if path.is_dir():
      shutil.rmtree(path)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CheckpointError, match=str(tmp_path / "4")):
      ckpt.restore(4, abstract(state))
  # Let those stray completions land inside this test, where the warning is filtered, rather
  # than in whichever test runs next.
  time.sleep(0.5)


def _lose_array_data(step_dir):
  for name in os.listdir(step_dir / "state"):
    if (step_dir / "state" / name).is_dir():
      shutil.rmtree(step_dir / "state" / name)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unreadable_newest_checkpoints_fall_back_to_the_newest_readable(tmp_path):
  d = tmp_path / "rl"
  states = {s: make_state(seed=s) for s in (2, 4, 6)}
  with Checkpointer(d, max_to_keep=3) as ckpt:
    for s, st in states.items():
      ckpt.save(s, st, {**META, "step": s})
  _lose_array_data(d / "6")
  (d / "4" / "meta" / "metadata").write_text("{ truncated")  # a torn JSON side-car
  logged = []
  with Checkpointer(d, max_to_keep=3) as ckpt:
    step, state, meta = ckpt.restore_newest_readable(abstract(make_state()), log=logged.append)
    assert (step, meta["step"]) == (2, 2)
    assert_bit_identical(state, states[2])
    # The unreadable steps were moved aside, with a line each; the run saves 4 and 6 anew.
    assert ckpt.all_steps() == [2]
    assert sorted(p.name for p in (tmp_path / "rl.unreadable").iterdir()) == ["4", "6"]
    assert any("checkpoint 6 cannot be read" in x for x in logged)
    assert logged[-1].endswith(f"falling back to checkpoint 2 in {d}")
    assert ckpt.save(4, states[4], META)
    assert ckpt.all_steps() == [2, 4]
  time.sleep(0.5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_no_readable_checkpoint_raises_and_moves_nothing(tmp_path):
  with Checkpointer(tmp_path / "sft") as ckpt:
    assert ckpt.restore_newest_readable(abstract(make_state())) is None  # nothing yet: None
    ckpt.save(3, make_state(), META)
  _lose_array_data(tmp_path / "sft" / "3")
  with Checkpointer(tmp_path / "sft") as ckpt:
    with pytest.raises(UnreadableCheckpointError, match=r"no checkpoint in .*sft can be read"):
      ckpt.restore_newest_readable(abstract(make_state()))
    assert ckpt.all_steps() == [3]
  assert not (tmp_path / "sft.unreadable").exists()
  # A readable checkpoint of another layout is not "unreadable": no older step would fit.
  with Checkpointer(tmp_path / "other") as ckpt:
    ckpt.save(1, make_state(din=3), META)
    ckpt.save(2, make_state(din=3), META)
    with pytest.raises(CheckpointError, match="shape differs") as e:
      ckpt.restore_newest_readable(abstract(make_state(din=4)))
    assert not isinstance(e.value, UnreadableCheckpointError)
    assert ckpt.all_steps() == [1, 2]
  time.sleep(0.5)
