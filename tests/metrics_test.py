"""Tests for jaxrl.metrics: JSONL records, resume truncation, TensorBoard files, plots, progress."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.metrics import MetricsWriter, Progress, _global_x, plot_curves, read_jsonl

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_write_converts_scalars_and_appends(tmp_path):
  with MetricsWriter(tmp_path, use_tensorboard=False) as w:
    w.write(0, {"rl/kl": jnp.float32(0.5), "opt/grad_norm": np.float64(2.0), "n": np.int32(3)})
    w.write(1, {"sft/loss": jnp.array([1.25]), "ok": np.bool_(True)}, phase="sft")
  with MetricsWriter(tmp_path, use_tensorboard=False) as w:  # a resumed run appends
    w.write(2, {"rl/kl": 0.25})
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == [
    {"step": 0, "phase": "rl", "rl/kl": 0.5, "opt/grad_norm": 2.0, "n": 3},
    {"step": 1, "phase": "sft", "sft/loss": 1.25, "ok": True},
    {"step": 2, "phase": "rl", "rl/kl": 0.25},
  ]
  assert isinstance(json.loads(lines[0])["n"], int)
  assert list(json.loads(lines[0])) == ["step", "phase", "rl/kl", "opt/grad_norm", "n"]
  assert read_jsonl(tmp_path / "metrics.jsonl") == [json.loads(line) for line in lines]


def test_write_rejects_bad_metrics(tmp_path):
  with MetricsWriter(tmp_path, use_tensorboard=False) as w:
    with pytest.raises(ValueError, match="'rl/adv'.*shape \\(3,\\)"):
      w.write(0, {"rl/adv": jnp.zeros(3)})
    with pytest.raises(ValueError, match="reserved"):
      w.write(0, {"step": 1})


def test_truncate_after_drops_only_rerun_steps_of_that_phase(tmp_path):
  with MetricsWriter(tmp_path, use_tensorboard=False) as w:
    for s in range(4):
      w.write(s, {"sft/loss": float(s)}, phase="sft")
    for s in range(5):
      w.write(s, {"rl/reward_mean": float(s)}, phase="rl")
  # Resume RL from the checkpoint at step 3: steps 3 and 4 will be re-run.
  with MetricsWriter(tmp_path, use_tensorboard=False) as w:
    assert w.truncate_after("rl", 3) == 2
    w.write(3, {"rl/reward_mean": 30.0})
  got = [(r["phase"], r["step"]) for r in read_jsonl(tmp_path / "metrics.jsonl")]
  assert got == [("sft", s) for s in range(4)] + [("rl", s) for s in range(4)]
  assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["rl/reward_mean"] == 30.0


def test_torn_last_line_is_ignored_and_dropped_on_truncate(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 0, "phase": "rl", "x": 1.0}\n{"step": 1, "pha')
  assert read_jsonl(path) == [{"step": 0, "phase": "rl", "x": 1.0}]
  with MetricsWriter(tmp_path, use_tensorboard=False) as w:
    w.truncate_after("rl", 1)
    w.write(1, {"x": 2.0})
  assert [r["step"] for r in read_jsonl(path)] == [0, 1]


def test_corrupt_middle_line_names_file_and_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
  with pytest.raises(ValueError, match="metrics.jsonl:2"):
    read_jsonl(path)


def test_tensorboard_event_files_exist(tmp_path):
  with MetricsWriter(tmp_path) as w:
    w.write(0, {"rl/kl": 0.1, "opt/grad_norm": 1.0, "note": "text is skipped"})
    w.write(1, {"rl/kl": 0.2, "opt/grad_norm": 0.9})
    w.flush()
  events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
  assert events and all(e.stat().st_size > 0 for e in events)


def test_disabled_writer_writes_nothing(tmp_path):
  with MetricsWriter(tmp_path / "w", enabled=False) as w:
    assert w.write(0, {"x": 1.0}) == {"step": 0, "phase": "rl", "x": 1.0}
  assert not (tmp_path / "w").exists()


def test_plot_curves_writes_png_for_both_phases(tmp_path):
  with MetricsWriter(tmp_path, use_tensorboard=False) as w:
    for s in range(6):
      w.write(s, {"sft/loss": 2.0 - 0.2 * s, "global_step": s}, phase="sft")
    for s in range(10):
      metrics = {"rl/reward_mean": 0.1 * s, "global_step": 6 + s}
      if s % 3 == 0:  # eval metrics only every few steps
        metrics["eval/accuracy"] = 0.3 + 0.02 * s
      w.write(s, metrics, phase="rl")
  out = plot_curves(
    tmp_path / "metrics.jsonl",
    tmp_path / "plots" / "curves.png",
    panels=[
      ("reward", ["rl/reward_mean"]),
      ("held-out accuracy", ["eval/accuracy"]),
      ("sft loss", ["sft/loss", "missing/key"]),
    ],
  )
  data = out.read_bytes()
  assert out == tmp_path / "plots" / "curves.png"
  assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
  assert not list(out.parent.glob("*.tmp"))


def test_plot_curves_without_global_step_or_data(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 0, "phase": "rl", "rl/reward_mean": 0.5}\n')
  out = plot_curves(path, tmp_path / "c.png", panels=[("a", ["rl/reward_mean"]), ("b", ["x"])])
  assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_global_x_continues_steps_across_phases():
  sft = [{"step": s, "phase": "sft"} for s in range(3)]
  # RL restarting at 0 continues after SFT; RL already counting globally is left alone.
  assert _global_x(sft + [{"step": s, "phase": "rl"} for s in range(2)]) == [0, 1, 2, 3, 4]
  assert _global_x(sft + [{"step": s, "phase": "rl"} for s in (3, 4)]) == [0, 1, 2, 3, 4]
  explicit = [{"step": s, "phase": "rl", "global_step": 10 + s} for s in range(2)]
  assert _global_x(sft + explicit) == [0, 1, 2, 10, 11]


def test_progress_shows_compact_postfix(capsys):
  with Progress(total=3, desc="rl") as p:
    p.update(1, **{"rl/reward_mean": jnp.float32(0.123456), "opt/grad_norm": 2})
    p.update(2)
    assert p._bar.n == 3
    assert p._bar.postfix == "reward_mean=0.1235, grad_norm=2"
  with Progress(total=3, enabled=False) as p:
    p.update(3, loss=1.0)
  assert capsys.readouterr().out == ""


def _tb_events(logdir):
  """Every event of every TensorBoard file under `logdir`, in writing order (TFRecord framing:
  length, its CRC, the Event proto, its CRC)."""
  import struct

  from tensorboardX.proto import event_pb2

  events = []
  for path in sorted(logdir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
    data, i = path.read_bytes(), 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i : i + 8])
      e = event_pb2.Event()
      e.ParseFromString(data[i + 12 : i + 12 + n])
      events.append(e)
      i += 12 + n + 4
  return events


def _scalars(events):
  return [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]


def test_rerun_steps_are_hidden_from_tensorboard_after_a_restart(tmp_path):
  # A try killed after RL steps 1-2 (global 21-22) and before any RL checkpoint: the next
  # try drops those rows (truncate_after(phase, 0)) and TensorBoard gets its restart marker
  # at global step 21, which hides the first try's events from there on.
  with MetricsWriter(tmp_path) as w:
    w.write(20, {"sft/loss": 1.0, "global_step": 20}, phase="sft")
    for s in (1, 2):
      w.write(s, {"rl/reward_mean": float(s), "global_step": 20 + s})
  n_first = len(_tb_events(tmp_path / "tb"))
  assert not any(e.HasField("session_log") for e in _tb_events(tmp_path / "tb"))
  with MetricsWriter(tmp_path) as w:
    assert w.truncate_after("rl", 0) == 2
    w.write(1, {"rl/reward_mean": 10.0, "global_step": 21})
  assert [(r["phase"], r["step"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
    ("sft", 20),
    ("rl", 1),
  ]
  later = _tb_events(tmp_path / "tb")[n_first:]
  marker = [e for e in later if e.HasField("session_log")]
  assert len(marker) == 1 and marker[0].step == 21
  assert marker[0].session_log.status == marker[0].session_log.START
  assert _scalars(later) == [(21, "rl/reward_mean", 10.0)]
  # Without anything dropped, a resumed writer writes no marker.
  n = len(_tb_events(tmp_path / "tb"))
  with MetricsWriter(tmp_path) as w:
    assert w.truncate_after("rl", 5) == 0
    w.write(5, {"rl/reward_mean": 5.0, "global_step": 25})
  assert not any(e.HasField("session_log") for e in _tb_events(tmp_path / "tb")[n:])


def test_wandb_logs_every_record_and_resumes_the_same_run(tmp_path, monkeypatch):
  """log.wandb_project: records go to W&B at their global step, numbers only; a writer opened
  again on the workdir resumes the same W&B run (its id is kept beside metrics.jsonl)."""
  import sys
  import types

  calls = []

  class FakeRun:
    def log(self, data, step):
      calls.append(("log", data, step))

    def finish(self):
      calls.append(("finish",))

  def init(**kwargs):
    calls.append(("init", kwargs))
    return FakeRun()

  ids = iter(["run-a", "run-b"])
  fake = types.SimpleNamespace(init=init, util=types.SimpleNamespace(generate_id=lambda: next(ids)))
  monkeypatch.setitem(sys.modules, "wandb", fake)
  for _ in range(2):
    with MetricsWriter(
      tmp_path, use_tensorboard=False, wandb_project="p", wandb_config={"a": 1}
    ) as w:
      w.write(3, {"rl/loss": 0.5, "note": "text", "global_step": 13}, phase="rl")
  inits = [c[1] for c in calls if c[0] == "init"]
  assert [i["id"] for i in inits] == ["run-a", "run-a"] and inits[0]["project"] == "p"
  assert inits[0]["resume"] == "allow" and inits[0]["config"] == {"a": 1}
  assert [c for c in calls if c[0] == "log"] == [("log", {"rl/loss": 0.5}, 13)] * 2
  assert sum(c[0] == "finish" for c in calls) == 2


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
  import importlib.util

  from jaxrl.config import ConfigError, validate

  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
  )
  with pytest.raises(ConfigError, match=r"config\.log\.wandb_project='p' is invalid; allowed: ''"):
    validate({"log": {"wandb_project": "p"}})
