"""launch.remote (launch/tpu/run.sh, launch/gpu/run.sh): the dry-run prints the exact commands,
every remote step reaches every worker and carries the config; a real run executes the same
commands in order and stops at the first failure; bad flags are named before anything runs."""

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import child_env, run_child

from launch import remote

ROOT = Path(__file__).resolve().parent.parent
TPU = ["tpu", "--name=t1", "--zone=us-central2-b", "--accelerator=v4-8"]


def _printed(capsys) -> list[list[str]]:
  lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[")]
  return [shlex.split(ln.split("] ", 1)[1]) for ln in lines]


def test_tpu_dry_run_reaches_every_worker_with_the_config(capsys, monkeypatch):
  ran = []
  real = subprocess.run
  monkeypatch.setattr(remote.subprocess, "run", lambda c, **k: (ran.append(c), real(c, **k))[1])
  argv = [*TPU, "--create", "--spot", "--config=configs/grpo_gsm8k.py", "--dry-run"]
  assert remote.main([*argv, "--", "--config.rl.steps=7", "--config.seed=3"]) == 0
  cmds = _printed(capsys)
  assert all(c[0] == "git" for c in ran)  # only git was asked (HEAD, dirty?): nothing launched
  create, archive, scp, install, train = cmds
  assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "t1"]
  assert {"--accelerator-type", "v4-8", "--spot", "us-central2-b"} <= set(create)
  commit = archive[-1]
  assert archive[:3] == ["git", "-C", str(ROOT)] and len(commit) == 40
  for remote_step in (scp, install, train):  # every worker gets the code, the install, the run
    assert "--worker=all" in remote_step and remote_step[remote_step.index("--zone") + 1]
  assert 'pip install -q -e ".[tpu]"' in install[-1]
  run = train[-1]
  assert f"JAXRL_COMMIT={commit}" in run
  assert run.endswith(
    "python3 -m launch.train --config=configs/grpo_gsm8k.py --config.rl.steps=7 --config.seed=3"
  )


@pytest.mark.parametrize(("accelerator", "multi"), [("v4-32", True), ("v5litepod-8", False)])
def test_a_multi_host_slice_runs_one_process_per_worker_that_joins_jax_distributed(
  accelerator, multi, capsys
):
  assert remote.main([*TPU[:3], f"--accelerator={accelerator}", "--dry-run"]) == 0
  *_, train = _printed(capsys)
  assert "--worker=all" in train
  # launch.train joins from the environment (jaxrl.distributed.initialize_from_env); 'auto':
  # JAX finds the slice's workers and this worker's index itself.
  assert ("JAXRL_COORDINATOR=auto" in train[-1]) == multi


def test_gpu_dry_run_targets_one_host_and_its_gpus(capsys):
  argv = ["gpu", "--host=me@box", "--gpus=0,1", "--config=configs/grpo_arith.py:smoke"]
  assert remote.main([*argv, "--dry-run"]) == 0
  archive, scp, install, train = _printed(capsys)
  assert scp == ["scp", "/tmp/jaxrl-src.tar.gz", "me@box:~/jaxrl-src.tar.gz"]
  assert install[:2] == ["ssh", "me@box"] and '".[cuda]"' in install[2]
  assert train[:2] == ["ssh", "me@box"]
  assert "CUDA_VISIBLE_DEVICES=0,1" in train[2]
  assert train[2].endswith("launch.train --config=configs/grpo_arith.py:smoke")


def test_a_real_run_executes_the_steps_in_order_and_stops_at_a_failure(tmp_path):
  log = tmp_path / "calls.log"
  gcloud = tmp_path / "gcloud"  # records its arguments; fails at ssh when FAIL_AT_SSH is set
  gcloud.write_text(
    f'#!/bin/sh\necho "$@" >> {log}\n'
    'if [ -n "$FAIL_AT_SSH" ] && [ "$4" = ssh ]; then exit 1; fi\nexit 0\n'
  )
  gcloud.chmod(gcloud.stat().st_mode | stat.S_IEXEC)
  env = child_env(PATH=f"{tmp_path}:{os.environ['PATH']}")
  cmd = [sys.executable, "-m", "launch.remote", *TPU, "--config=configs/grpo_arith.py"]
  out = run_child(cmd, cwd=ROOT, env=env)
  assert out.returncode == 0, out.stderr
  calls = log.read_text().splitlines()
  assert [c.split()[3] for c in calls] == ["scp", "ssh", "ssh"]  # no create without --create
  assert calls[-1].endswith("launch.train --config=configs/grpo_arith.py")
  log.unlink()
  out = run_child(cmd, cwd=ROOT, env={**env, "FAIL_AT_SSH": "1"})
  assert out.returncode == 1
  assert "step 3 exited 1; the steps after it did not run" in out.stderr
  assert [c.split()[3] for c in log.read_text().splitlines()] == ["scp", "ssh"]


@pytest.mark.parametrize(
  ("argv", "message"),
  [
    ([*TPU[:3], "--accelerator=a100"], "'a100' is not a TPU VM accelerator type (e.g. v4-8"),
    (["gpu"], "gpu needs --host=[user@]hostname"),
    ([*TPU, "--config=configs/nope.py"], "--config='configs/nope.py': no such file in this"),
    ([*TPU, "--config=grpo_arith"], "must name a config file (configs/*.py[:variant])"),
  ],
)
def test_bad_flags_are_named_before_anything_runs(argv, message, capsys):
  assert remote.main([*argv, "--dry-run"]) == 2
  captured = capsys.readouterr()
  assert message in captured.err and captured.out.count("[1/") == 0


def test_the_accelerator_extras_take_the_jax_range_the_cpu_install_uses():
  # launch.remote installs ".[tpu]" / ".[cuda]": they must allow exactly the jax versions the
  # CPU default allows (the range tests/launch_deps_test.py installs at both ends).
  import configparser
  import re

  cfg = configparser.ConfigParser()
  cfg.read(ROOT / "setup.cfg")
  (jax_range,) = re.findall(r"^jax(>=\S+)$", cfg["options"]["install_requires"], re.M)
  extras = cfg["options.extras_require"]
  assert extras["tpu"].split() == [f"jax[tpu]{jax_range}"]
  assert extras["cuda"].split() == [f"jax[cuda]{jax_range}"]
