"""Checkpointing of the training-state pytree plus a JSON side-car, on orbax CheckpointManager."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl import distributed
from jaxrl.guard import NonFiniteError, all_finite
from jaxrl.mesh import path_str

# How many offending leaves a mismatch error lists per category before eliding the rest.
_MAX_LISTED = 10


class CheckpointError(ValueError):
  """A checkpoint on disk cannot be restored into the requested target."""


class UnreadableCheckpointError(CheckpointError):
  """A checkpoint's files cannot be read (missing, truncated or corrupt), as opposed to a
  readable checkpoint of another layout (a `CheckpointError` that no older step would fix)."""


class Checkpointer:
  """Saves and restores `(state, meta)` pairs under `directory/<step>/`.

  `state` is any pytree of arrays (nnx.State, optax states, raw or typed PRNG keys);
  `meta` is a JSON-serialisable dict (data-iterator position, phase name, ...). Orbax
  writes each step into a temporary directory and renames it on commit, so a crash or
  error mid-save never leaves a step that `latest_step()` or `restore()` can see.

  Saves are asynchronous by default: `save` returns once device arrays are copied to
  host (so the caller may donate or overwrite them), and the disk write finishes in the
  background. `wait()` blocks until it is committed; `latest_step`, `restore` and `close`
  wait first, and a failed background write raises from whichever of them runs next.
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    max_to_keep: int | None = 3,
    save_every: int = 1,
    async_save: bool = True,
  ):
    if save_every < 1:
      raise ValueError(f"save_every must be >= 1, got {save_every}")
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep}")
    self.directory = Path(directory).absolute()
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      create=True,
      # Removes `<step>.orbax-checkpoint-tmp` leftovers of a crashed save when a run resumes.
      cleanup_tmp_directories=True,
      enable_async_checkpointing=async_save,
    )
    # Explicit handlers so that a fresh manager (a resumed run) can read item metadata
    # before anything has been saved or restored through it.
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=options,
      item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
    )
    self._closed = False

  def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
    """Saves `state` and `meta` as `step`; returns whether a save was started.

    Saves only when `step % save_every == 0` or `force`. A step that is already on disk is
    not overwritten (returns False): a forced final save right after a periodic one is a no-op.
    A state with a NaN or inf in any floating-point leaf is never written: `NonFiniteError`.
    """
    self._check_open()
    step = int(step)
    if not force and step % self.save_every != 0:
      return False
    try:
      json.dumps(meta)
    except (TypeError, ValueError) as e:
      raise TypeError(f"checkpoint meta must be JSON-serialisable, got {meta!r}: {e}") from e
    self.wait()
    if step in self._manager.all_steps():
      return False
    if not all_finite(state):
      raise NonFiniteError(
        f"not writing checkpoint {step} to {self.directory}: the state holds NaN or inf "
        f"values; the checkpoints already there are left as they are"
      )
    # Every process of a multi-process run calls this with the same state: orbax writes each
    # global array's shards from the processes that hold them; a host-local array (the same on
    # every process, e.g. the sampling key) goes as numpy.
    state = jax.tree.map(lambda x: np.asarray(x) if _host_local(x) else x, state)
    # `force=True` because the save_every decision is ours; orbax's own interval policy
    # would otherwise skip steps it did not expect.
    return bool(
      self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True,
      )
    )

  def wait(self) -> None:
    """Blocks until any in-flight save is committed; re-raises its error if it failed."""
    self._manager.wait_until_finished()

  def all_steps(self) -> list[int]:
    """All committed steps, ascending."""
    self.wait()
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed step, or None if there is none."""
    self.wait()
    return self._manager.latest_step()

  def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict]:
    """Restores `(state, meta)` of `step` (None: the latest) into `abstract_state`'s layout.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with `.sharding`) or of real
    arrays; restored arrays take its tree type, shapes and shardings. Dtypes follow the
    target too (orbax casts), so a float32 checkpoint can be loaded as bfloat16.
    """
    self._check_open()
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
      step = steps[-1]
    elif int(step) not in steps:
      raise FileNotFoundError(
        f"no checkpoint for step {step} in {self.directory}; available steps: {steps or 'none'}"
      )
    return self._restore(int(step), abstract_state, self._read_together)

  def _restore(self, step: int, abstract_state: Any, read) -> tuple[Any, dict]:
    """`restore` of a committed `step`, its data read by `read(step, target) -> (state, meta)`."""
    step_dir = self.directory / str(step)
    local = jax.tree.map(_host_local, abstract_state)
    target = jax.tree.map(
      lambda x, h: np.zeros(x.shape, x.dtype) if h else _as_abstract(x), abstract_state, local
    )
    try:
      saved = self._manager.item_metadata(step).state
    except Exception as e:
      raise UnreadableCheckpointError(f"cannot read checkpoint metadata in {step_dir}: {e}") from e
    if saved is None:
      raise UnreadableCheckpointError(f"checkpoint {step_dir} has no readable 'state' item")
    problems = _describe_mismatch(getattr(saved, "tree", saved), target)
    if problems:
      raise CheckpointError(
        f"checkpoint {step_dir} does not match the restore target:\n" + "\n".join(problems)
      )
    try:
      restored, meta = read(step, target)
    except Exception as e:
      # Whatever the structural check above could not see: missing or corrupt array data.
      raise UnreadableCheckpointError(f"cannot restore checkpoint {step_dir}: {e}") from e
    state = jax.tree.map(
      lambda x, want, h: jax.device_put(x, want.sharding) if h else x,
      restored, abstract_state, local,
    )  # fmt: skip
    return state, meta

  def _read_together(self, step: int, target: Any) -> tuple[Any, dict]:
    """orbax's restore: every process reads its shards, then waits for the others at a barrier."""
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
    )
    return restored.state, restored.meta

  def _read_alone(self, step: int, target: Any) -> tuple[Any, dict]:
    """This process's shards of `step` and its side-car, read with orbax's handlers and no
    barrier: a process whose read fails does not leave the others waiting at orbax's."""
    step_dir = self.directory / str(step)
    handler = ocp.StandardCheckpointHandler()
    try:
      state = handler.restore(step_dir / "state", args=ocp.args.StandardRestore(target))
    finally:
      handler.close()
    return state, ocp.JsonCheckpointHandler().restore(step_dir / "meta")

  def restore_newest_readable(self, abstract_state: Any, log=print) -> tuple[int, Any, dict] | None:
    """(step, state, meta) of the newest checkpoint that can be read; None if there is none.

    A newer step whose files cannot be read (`UnreadableCheckpointError`: a disk that lost or
    truncated files) is moved out of the way, to `<directory>.unreadable/<step>` (kept for
    inspection; later saves and restores no longer see it), with a log line, and the step
    before it is tried. If no step can be read nothing is moved and the newest step's error is
    raised. A readable checkpoint of another layout raises `CheckpointError` at once: an older
    step would not match either.

    In a multi-process run every process calls this together and all of them get the same
    step. Each reads its own shards of a step (a read may fail on one process only: a lost
    file holds one process's shards); the processes then exchange how their reads went, and
    a step is unreadable if it is for any of them. Process 0 alone moves the unreadable steps,
    while the others wait for it.
    """
    self._check_open()
    steps = self._agreed_steps()
    errors = []  # (step, the first process whose read failed, its message, this process's error)
    for step in reversed(steps):
      try:
        found, mine = self._restore(step, abstract_state, self._read_alone), None
      except UnreadableCheckpointError as e:
        found, mine = None, e
      except Exception as e:  # another layout, or a bug: every process stops, naming it
        _agree_on_outcome(step, e, self.directory)
        raise
      failed = _agree_on_outcome(step, mine, self.directory)
      if failed:
        errors.append((step, *failed, mine))
        continue
      if errors:
        self._move_aside(errors, log)
        log(f"[jaxrl] falling back to checkpoint {step} in {self.directory}")
      return step, *found
    if errors:
      newest, process, message, mine = errors[0]
      raise UnreadableCheckpointError(
        f"no checkpoint in {self.directory} can be read (steps {steps}); the newest, {newest}: "
        f"{_on(process)}{message}. Delete the directory to start the phase again, or use another "
        "workdir."
      ) from mine
    return None

  def _agreed_steps(self) -> list[int]:
    """The committed steps, which every process must see alike (one shared directory)."""
    steps = self.all_steps()
    every = distributed.allgather_objects(steps)
    for i, theirs in enumerate(every):
      if theirs != every[0]:
        raise CheckpointError(
          f"the processes see different checkpoints in {self.directory} (process 0: steps "
          f"{every[0]}, process {i}: {theirs}); every process must see the same directory, "
          "on a filesystem they share"
        )
    return steps

  def _move_aside(self, errors: list, log) -> None:
    """Process 0 moves the unreadable steps to `<directory>.unreadable/`; every process then
    sees the steps that are left."""
    aside = self.directory.with_name(self.directory.name + ".unreadable")
    problem = None
    if jax.process_index() == 0:
      try:
        aside.mkdir(exist_ok=True)
        for bad, process, message, _ in errors:
          dest = aside / str(bad)
          shutil.rmtree(dest, ignore_errors=True)  # an earlier run's copy of the same step
          os.replace(self.directory / str(bad), dest)
          log(
            f"[jaxrl] checkpoint {bad} cannot be read ({_on(process)}{_first_line(message)}); "
            f"moved to {dest}"
          )
      except OSError as e:
        problem = e
    # Also the others' barrier: none reads the directory again before process 0 is done.
    failed = distributed.allgather_objects(None if problem is None else str(problem))[0]
    if failed is not None:
      raise CheckpointError(
        f"cannot move the unreadable checkpoints {[e[0] for e in errors]} of {self.directory} "
        f"aside to {aside}: {failed}"
      ) from problem
    self._manager.reload()

  def restore_subtree(self, step: int, abstract_subtree: Any) -> Any:
    """Restores only the leaves of `abstract_subtree` (a pytree of dicts naming a part of the
    saved state, e.g. {"train": {"params": target}}) from `step`; the rest stays on disk.

    Reads exactly the bytes of the named leaves: a params-only restore for export or evaluation
    needs no optimizer to describe the optimizer state it skips.
    """
    self._check_open()
    if int(step) not in self.all_steps():
      raise FileNotFoundError(
        f"no checkpoint for step {step} in {self.directory}; available steps: "
        f"{self.all_steps() or 'none'}"
      )
    step_dir = self.directory / str(int(step))
    target = jax.tree.map(_as_abstract, abstract_subtree)
    try:
      saved = self._manager.item_metadata(int(step)).state
    except Exception as e:
      raise CheckpointError(f"cannot read checkpoint metadata in {step_dir}: {e}") from e
    problems = [
      p
      for p in _describe_mismatch(getattr(saved, "tree", saved), target)
      if not p.startswith("  in checkpoint but not in target")
    ]
    if problems:
      raise CheckpointError(
        f"checkpoint {step_dir} does not match the restore target:\n" + "\n".join(problems)
      )
    try:
      return ocp.PyTreeCheckpointer().restore(
        step_dir / "state",
        args=ocp.args.PyTreeRestore(
          item=target,
          restore_args=ocp.checkpoint_utils.construct_restore_args(target),
          partial_restore=True,
        ),
      )
    except Exception as e:
      raise CheckpointError(f"cannot restore {sorted(target)} from {step_dir}: {e}") from e

  def close(self) -> None:
    """Waits for in-flight saves and releases orbax's threads; safe to call twice."""
    if self._closed:
      return
    self._closed = True
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError(f"Checkpointer for {self.directory} is closed")


def _first_line(message: str) -> str:
  text = message.strip().splitlines()
  return text[0] if text else "(no message)"


def _on(process: int | None) -> str:
  """How a message names the process it came from: not at all in a one-process run."""
  return "" if process is None else f"process {process}: "


def _agree_on_outcome(step: int, error: Exception | None, directory) -> tuple | None:
  """Every process's outcome of reading `step`, exchanged: None if every read succeeded, else
  (the first process whose read failed, its message); the process is None in a one-process run.
  An error other than an unreadable step on another process raises a `CheckpointError` here
  (a process that had one raises its own)."""
  unreadable = isinstance(error, UnreadableCheckpointError)
  kind = "ok" if error is None else "unreadable" if unreadable else "error"
  mine = (kind, "" if error is None else str(error))
  if jax.process_count() == 1:
    return None if error is None else (None, mine[1])
  every = distributed.allgather_objects(mine)
  for i, (theirs, message) in enumerate(every):
    if theirs == "error" and kind != "error":
      raise CheckpointError(
        f"process {i} cannot restore checkpoint {step} in {directory}: {message}"
      )
  for i, (theirs, message) in enumerate(every):
    if theirs == "unreadable":
      return i, message
  return None


def _host_local(x: Any) -> bool:
  """An array on this process's devices only, in a multi-process run (orbax saves global
  arrays; such a leaf is saved and restored as numpy, then put back where it was)."""
  if jax.process_count() == 1 or not isinstance(x, jax.Array | jax.ShapeDtypeStruct):
    return False
  sharding = getattr(x, "sharding", None)
  return sharding is not None and all(
    d.process_index == jax.process_index() for d in sharding.device_set
  )


def _as_abstract(x: Any) -> Any:
  # Real arrays become ShapeDtypeStructs carrying their sharding, so restored arrays land
  # exactly where the caller's live arrays are.
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x


def _stored_shape(x: Any) -> tuple[int, ...] | None:
  # Typed PRNG keys are stored as their uint32 key data, which has trailing key dims.
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, x).shape)
  shape = getattr(x, "shape", None)
  return tuple(shape) if shape is not None else tuple(np.shape(x))


def _describe_mismatch(saved_tree: Any, target: Any) -> list[str]:
  """Lists leaves missing on either side and shape differences; empty if they agree.

  Paths are compared as strings because orbax's metadata tree turns NamedTuples and
  nnx.Variables into plain dicts, so the treedefs themselves never match.
  """
  saved = {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
  wanted = {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(target)[0]}
  problems = []

  def listing(title: str, items: list[str]) -> None:
    if items:
      shown = items[:_MAX_LISTED]
      more = f" (and {len(items) - len(shown)} more)" if len(items) > len(shown) else ""
      problems.append(f"  {title}: " + ", ".join(shown) + more)

  listing("in target but not in checkpoint", sorted(wanted.keys() - saved.keys()))
  listing("in checkpoint but not in target", sorted(saved.keys() - wanted.keys()))
  shapes = []
  for key in sorted(wanted.keys() & saved.keys()):
    saved_shape = getattr(saved[key], "shape", None)
    want_shape = _stored_shape(wanted[key])
    if saved_shape is not None and tuple(saved_shape) != want_shape:
      shapes.append(f"{key} (checkpoint {tuple(saved_shape)} vs target {want_shape})")
  listing("shape differs", shapes)
  return problems
