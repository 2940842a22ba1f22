"""Training metrics: a JSONL log, TensorBoard scalars, curve plots and a tqdm progress bar."""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tqdm
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DEFAULT_PANELS = [("reward", ["rl/reward_mean"]), ("held-out accuracy", ["eval/accuracy"])]
_RESERVED = ("step", "phase")


def _to_json_value(key: str, value: Any) -> Any:
  """Turns numpy / jax scalars (and size-1 arrays) into Python numbers; strings pass through."""
  if isinstance(value, str | bool | type(None)):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"metric {key!r} must be a scalar, got an array of shape {arr.shape}")
  item = arr.reshape(()).item()
  if isinstance(item, bool | int | float):
    return item
  raise ValueError(f"metric {key!r} must be a number, bool or string, got {type(value).__name__}")


def _parse_lines(path: Path) -> list[tuple[str, dict]]:
  """(raw line, record) pairs; a torn final line (a crash mid-write) is dropped."""
  with open(path) as f:
    lines = [line.rstrip("\n") for line in f]
  out = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      out.append((line, json.loads(line)))
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:
        break
      raise ValueError(f"{path}:{i + 1}: not a JSON object: {e}") from e
  return out


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  """All records of a metrics JSONL file, in file order."""
  return [record for _, record in _parse_lines(Path(path))]


def _write_atomically(path: Path, text: str) -> None:
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


class MetricsWriter:
  """Appends one JSON object per `write` to `workdir/metrics.jsonl`, mirrored to TensorBoard.

  Each record is `{"step": int, "phase": str, **metrics}`. TensorBoard scalars are named by
  the metric keys and indexed by the record's "global_step" if it has one, else by its
  step. Only process 0 writes by default, so multi-host runs produce one log.
  """

  def __init__(
    self,
    workdir: str | os.PathLike,
    *,
    use_tensorboard: bool = True,
    enabled: bool | None = None,
    wandb_project: str = "",
    wandb_config: Mapping[str, Any] | None = None,
  ):
    self.workdir = Path(workdir)
    # Weights & Biases (optional): one W&B run per workdir, resumed by the id kept beside the
    # metrics. W&B drops a step lower than one it has seen: steps re-run after a kill appear
    # once, from the earlier try (metrics.jsonl and TensorBoard hold the re-run's values).
    self.wandb_project, self.wandb_config, self._wandb = wandb_project, wandb_config, None
    self.path = self.workdir / "metrics.jsonl"
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.use_tensorboard = use_tensorboard
    self._file = None
    self._tb = None
    self._purge_step = None  # TensorBoard: hide events from here on (steps about to re-run)
    if self.enabled:
      self.workdir.mkdir(parents=True, exist_ok=True)

  def write(self, step: int, metrics: Mapping[str, Any], *, phase: str | None = "rl") -> dict:
    """Logs `metrics` at `step`; returns the record as written."""
    clash = [k for k in _RESERVED if k in metrics]
    if clash:
      raise ValueError(f"metric keys {clash} are reserved for the record's own fields")
    # One device-to-host transfer for the whole dict rather than one per scalar.
    host = jax.device_get(dict(metrics))
    record: dict[str, Any] = {"step": int(step)}
    if phase is not None:
      record["phase"] = phase
    # Iterate the caller's dict, not device_get's result, which comes back key-sorted.
    record.update({k: _to_json_value(k, host[k]) for k in metrics})
    if not self.enabled:
      return record
    if self._file is None:
      # Line-buffered so that each record reaches the file whole, even if the run dies.
      self._file = open(self.path, "a", buffering=1)
    self._file.write(json.dumps(record) + "\n")
    if self.use_tensorboard:
      self._write_tensorboard(record)
    if self.wandb_project:
      self._write_wandb(record)
    return record

  def _write_wandb(self, record: dict) -> None:
    if self._wandb is None:
      import wandb  # optional: config validation checked it is installed

      id_file = self.workdir / "wandb_id.txt"
      run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
      id_file.write_text(run_id + "\n")
      self._wandb = wandb.init(
        project=self.wandb_project,
        id=run_id,
        resume="allow",
        name=self.workdir.name,
        dir=str(self.workdir),
        config=dict(self.wandb_config or {}),
      )
    scalars = {
      k: float(v)
      for k, v in record.items()
      if k not in _RESERVED and k != "global_step" and isinstance(v, bool | int | float)
    }
    self._wandb.log(scalars, step=int(record.get("global_step", record["step"])))

  def _write_tensorboard(self, record: dict) -> None:
    if self._tb is None:
      # Imported lazily: tensorboardX pulls in protobuf, which plain JSONL logging never needs.
      from tensorboardX import SummaryWriter

      # purge_step writes TensorBoard's restart marker: events of the earlier try at steps
      # >= it are hidden, so re-run steps do not appear twice.
      # The suffix keeps a writer opened within the same second (the file name counts whole
      # seconds) from overwriting the earlier one's file.
      self._tb = SummaryWriter(
        logdir=str(self.workdir / "tb"),
        purge_step=self._purge_step,
        filename_suffix=f".{time.time_ns()}",
      )
    x = int(record.get("global_step", record["step"]))
    for key, value in record.items():
      if key in _RESERVED or key == "global_step":
        continue
      if isinstance(value, bool | int | float):
        self._tb.add_scalar(key, float(value), global_step=x)

  def truncate_after(self, phase: str, step: int) -> int:
    """Drops records of `phase` with step >= `step`; returns how many were dropped.

    Call on resume from checkpoint `step` (0: a phase starting over, having no checkpoint),
    before the first `write`, so the steps that are about to be re-run do not appear twice.
    Records of other phases are kept. TensorBoard hides the earlier try's events from the
    first dropped record's step on (its restart marker, written with the next event).
    """
    if not self.enabled or not self.path.exists():
      return 0
    self._close_file()
    lines = _parse_lines(self.path)
    kept, dropped = [], []
    for raw, r in lines:
      if r.get("phase") != phase or int(r["step"]) < step:
        kept.append(raw)
      else:
        dropped.append(int(r.get("global_step", r["step"])))
    if dropped and self.use_tensorboard:
      first = min(dropped) if self._purge_step is None else min(self._purge_step, *dropped)
      self._purge_step = first
      if self._tb is not None:  # reopened with the marker at the next write
        self._tb.close()
        self._tb = None
    # Rewrite through a temporary file and a rename, so a crash here loses nothing.
    _write_atomically(self.path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()

  def _close_file(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None

  def close(self) -> None:
    self._close_file()
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _global_x(records: list[dict]) -> list[float]:
  """Each record's position on one step axis across phases.

  "global_step" when a record has it. Otherwise its step, shifted past the end of the
  earlier phases when its phase restarts counting (RL step 0 after SFT step 99 -> 100).
  """
  phases: dict[Any, list[dict]] = {}
  for r in records:
    phases.setdefault(r.get("phase"), []).append(r)
  offset: dict[Any, float] = {}
  end = -math.inf
  for phase, rs in phases.items():
    own = [r["step"] for r in rs if "global_step" not in r]
    offset[phase] = end + 1 - min(own) if own and end >= min(own) else 0
    end = max(end, *(r.get("global_step", r["step"] + offset[phase]) for r in rs))
  return [r.get("global_step", r["step"] + offset[r.get("phase")]) for r in records]


def plot_curves(
  jsonl_path: str | os.PathLike,
  out_png: str | os.PathLike,
  *,
  panels: Sequence[tuple[str, Sequence[str]]] = DEFAULT_PANELS,
) -> Path:
  """Draws one panel per `(title, metric keys)` against the global step; returns `out_png`.

  Records lacking a key are skipped for that key, so sparse eval metrics still plot. The x
  axis is "global_step" when records carry it, else "step" continued across phases (see
  `_global_x`). A dashed vertical line marks where each later phase starts (SFT -> RL).
  """
  records = read_jsonl(jsonl_path)
  out_png = Path(out_png)
  fig = Figure(figsize=(7.0, 2.6 * max(len(panels), 1)), layout="constrained")
  FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch, safe off the main thread.
  axes = fig.subplots(max(len(panels), 1), 1, sharex=True, squeeze=False)[:, 0]

  xs_all = _global_x(records)
  # Where each phase starts, in order of first appearance.
  phase_start: dict[str, float] = {}
  for r, x in zip(records, xs_all, strict=True):
    if "phase" in r:
      phase_start[r["phase"]] = min(x, phase_start.get(r["phase"], x))
  names = list(phase_start)
  boundaries = [(f"{a}→{b}", phase_start[b]) for a, b in zip(names, names[1:], strict=False)]

  for ax, (title, keys) in zip(axes, panels, strict=False):
    drawn = False
    for key in keys:
      # One segment per phase, in one colour: without a global_step the phases' step axes
      # overlap, and a single sorted line would zig-zag between them.
      segments: dict[Any, list[tuple[float, float]]] = {}
      for r, x in zip(records, xs_all, strict=True):
        y = r.get(key)
        if isinstance(y, int | float) and not isinstance(y, bool) and math.isfinite(y):
          segments.setdefault(r.get("phase"), []).append((x, y))
      color = None
      for pts in segments.values():
        xs, ys = zip(*sorted(pts), strict=True)
        # Markers keep sparse series (eval every N steps) visible as points.
        (line,) = ax.plot(
          xs,
          ys,
          marker="o" if len(xs) <= 50 else None,
          markersize=3,
          color=color,
          label=key if color is None else None,
        )
        color = line.get_color()
        drawn = True
    for name, x in boundaries:
      ax.axvline(x, color="gray", linestyle="--", linewidth=1)
      ax.text(x, 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
    if drawn:
      ax.legend(fontsize=8, loc="best")
    else:
      ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center")
    ax.set_title(title)
    ax.grid(alpha=0.3)
  axes[-1].set_xlabel("global step")

  out_png.parent.mkdir(parents=True, exist_ok=True)
  # Render to a temporary name and rename, so a viewer never sees a half-written PNG.
  tmp = out_png.with_name(out_png.name + ".tmp")
  fig.savefig(tmp, format="png", dpi=100)
  os.replace(tmp, out_png)
  return out_png


def _compact(value: Any) -> str:
  if isinstance(value, str):
    return value
  value = _to_json_value("postfix", value)
  return f"{value:.4g}" if isinstance(value, float) else str(value)


class Progress:
  """A tqdm bar whose postfix shows a few metrics compactly (`rl/reward_mean` -> `reward_mean`)."""

  def __init__(self, total: int | None, desc: str = "", *, enabled: bool = True, initial: int = 0):
    self._bar = tqdm.tqdm(
      total=total, desc=desc, initial=initial, disable=not enabled, dynamic_ncols=True
    )

  def update(self, n: int = 1, **postfix: Any) -> None:
    if postfix and not self._bar.disable:
      host = jax.device_get(postfix)
      shown = {k.rsplit("/", 1)[-1]: _compact(host[k]) for k in postfix}
      self._bar.set_postfix(shown, refresh=False)
    self._bar.update(n)

  def close(self) -> None:
    self._bar.close()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
