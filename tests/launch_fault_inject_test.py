"""launch.fault_inject: SIGKILLs in the start-up, inside checkpoint writes and after a
checkpoint, restarts, and a run that ends bit-identical to an uninterrupted one, every metric
row once."""

import json
import shutil

import pytest
from xla_env import xla_flags

from launch import fault_inject

SMALL = [
  "model.preset=tiny",
  "sft.steps=10",
  "rl.steps=4",
  "eval.every=2",
  "eval.num_examples=16",
  "checkpoint.every=2",
]


@pytest.mark.e2e
def test_three_kills_end_identical_to_the_uninterrupted_run(tmp_path, monkeypatch):
  # A compilation cache of the job's own, as a production restart has: the uninterrupted run
  # compiles into it from nothing and every try loads from it, so the tries' start-ups (which
  # scale the start-up kills) are alike, and none is shortened by the suite's shared cache.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "xla-cache"))
  monkeypatch.setenv("XLA_FLAGS", xla_flags(None))  # one CPU device, as a user's command has
  args = ["--config=configs/grpo_arith.py:smoke", "--kills=3", f"--out={tmp_path}", "--seed=1"]
  assert fault_inject.main(args + [x for o in SMALL for x in ("--set", o)]) == 0
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["identical"] and not report["problems"]
  # Keyed on progress, every kill lands before the job ends: one inside a checkpoint write, one
  # in the start-up, one after the try's own checkpoint (7 in this job).
  assert report["kills_landed"] == len(report["kills"]) == 3
  assert report["kills_by_kind"] == dict.fromkeys(fault_inject.KINDS, 1)
  assert report["kills_inside_checkpoint_writes"] == 1
  # The start-up kill is timed from the tries' own start-ups (warm, from the job's cache), not
  # the uninterrupted run's cold one: at most the time the first try took to begin its first
  # checkpoint write.
  write, start_up = report["kills"][0], report["kills"][1]
  assert write["inside_checkpoint_write"] and start_up["kind"] == "start-up"
  assert start_up["after_s"] <= write["started_s"] + 0.5

  # The comparison can fail: a metric row written twice, or a changed value, is reported.
  bad = tmp_path / "bad"
  shutil.copytree(tmp_path / "killed", bad)
  lines = (bad / "metrics.jsonl").read_text().splitlines()
  (bad / "metrics.jsonl").write_text("\n".join([*lines, lines[-1]]) + "\n")
  problems = fault_inject.compare(tmp_path / "full", bad)
  assert any("written twice" in p for p in problems)
  row = json.loads(lines[-1])
  row["rl/reward_mean"] = row.get("rl/reward_mean", 0.0) + 1.0
  (bad / "metrics.jsonl").write_text("\n".join([*lines[:-1], json.dumps(row)]) + "\n")
  n = len(lines)
  expect = [f"metric rows differ ({n} rows vs {n} uninterrupted)"]
  assert fault_inject.compare(tmp_path / "full", bad) == expect
