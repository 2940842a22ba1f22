"""bench/device_rehearsal.sh --smoke: every phase of the device rehearsal runs on a CPU at toy
shapes and reports what the GPU run will (the script is known to work before it meets a GPU)."""

import json
import math
import sys
from pathlib import Path

import pytest
from helpers import child_env, run_child

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
JAX_PHASES = ("bandwidth", "decode", "train", "export")


def test_smoke_runs_every_phase_and_reports_the_device_numbers(tmp_path):
  env = child_env(OUT=str(tmp_path), PYTHON=sys.executable, REHEARSAL_WHEELS=str(tmp_path / "none"))
  out = run_child(["bash", "bench/device_rehearsal.sh", "--smoke"], cwd=ROOT, env=env)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  report = json.loads((tmp_path / "device_rehearsal.json").read_text())
  phases = report["results"]
  assert list(phases) == [*JAX_PHASES, "hf", "trl"]
  for name in (*JAX_PHASES, "hf"):
    assert phases[name]["status"] == "ok", (name, phases[name])
    assert (tmp_path / "device_rehearsal_logs" / f"{name}.log").exists()
  # TRL is not in the test venv: skipped with the reason; where it is installed it must run.
  trl = phases["trl"]
  assert trl["status"] == "ok" or (trl["status"] == "skipped" and "trl" in trl["reason"]), trl

  decode = phases["decode"]
  assert decode["attention_kernel"] == "reference"  # the Triton kernel only on a GPU
  batches = report["settings"]["batches"]
  assert sorted(decode["batches"]) == sorted(str(b) for b in batches) and len(batches) == 2
  for b, row in decode["batches"].items():
    assert row["decode_tokens_per_s"] > 0 and row["call_tokens_per_s"] > 0, (b, row)
    assert math.isfinite(row["roofline_fraction"]) and row["roofline_fraction"] > 0, (b, row)
    assert row["compile"]["xla_compile_s"] > 0 and row["compile"]["programs"] >= 3
    assert row["timed_run_compiles"] == 0  # every timed run reuses the first call's programs
    summary = report["summary"]["decode"][b]
    assert summary["jaxrl_over_hf_call"] > 0 and summary["jaxrl_over_hf_step"] > 0

  train = phases["train"]
  assert train["mfu"] is None and train["peak_flops"] is None  # no peak for a CPU
  assert train["param_dtype"] == "float32" and train["dtype"] == "bfloat16"
  assert train["compile"]["xla_compile_s"] > 0 and train["step_s"] > 0
  assert train["metrics"]["opt/nonfinite"] == 0.0  # the step was applied, not skipped
  assert train["flops"]["model_flops"] > 0

  hf = phases["hf"]
  for row in hf["batches"].values():
    assert row["decode_tokens_per_s"] > 0
    # The same exported weights and greedy argmax: their first tokens agree.
    assert row["greedy_agreement_vs_jaxrl"]["mean_prefix"] >= 1

  for name in JAX_PHASES:  # no device statistics on a CPU: the process's peak RSS instead
    mem = phases[name]["memory"]
    assert mem["device_peak_bytes"] is None and mem["peak_rss_bytes"] > 0
  assert set(report["summary"]["compile_s"]) >= {"decode/init_compile", "train/compile"}
  assert report["summary"]["met"]["train_mfu"] is None
