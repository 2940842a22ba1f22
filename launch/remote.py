"""Launch a training run on a Cloud TPU VM or a GPU host: ship this checkout, install it with the
accelerator's jax extra, start `python -m launch.train` there. `--dry-run` prints the exact
commands instead of running them.

  python -m launch.remote tpu --name=my-tpu --zone=us-central2-b --accelerator=v4-8 --create \\
      --config=configs/grpo_gsm8k.py -- --config.rl.steps=200
  python -m launch.remote gpu --host=me@gpu-box --config=configs/grpo_gsm8k.py --dry-run

`tpu` drives `gcloud compute tpus tpu-vm` (create with --create; scp and ssh with
--worker=all, so every worker of the slice gets the code, the install and the same command);
`gpu` drives `ssh`/`scp` to one host and runs one process over all its GPUs (JAX sees every
local GPU; the config's mesh spreads over them). The checkout travels as a `git archive` of
HEAD (uncommitted changes do not travel: the run is reproducible from its commit, which the
remote command records as JAXRL_COMMIT). `launch/tpu/run.sh` and `launch/gpu/run.sh` wrap this.

One process per host drives one host's devices. On a slice of several hosts every worker runs
the same command with JAXRL_COMMIT and JAXRL_COORDINATOR=auto: `launch.train` joins JAX's
multi-controller runtime (`jaxrl.distributed`; JAX finds the slice's workers itself) and the
job runs over one global mesh of all their chips. That path is tested with processes on one
CPU machine (tests/multihost_test.py), not on a TPU pod.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REMOTE_DIR = "jaxrl"  # under the remote user's home
ARCHIVE = "jaxrl-src.tar.gz"
# TPU VM accelerator types that are one host (TPU VM docs: v2-8, v3-8, v4-8, v5e up to 8 chips,
# v5p-8, v6e up to 8 chips); larger slices have several workers, one process each.
SINGLE_HOST = re.compile(r"^(v2-8|v3-8|v4-8|v5p-8|v5litepod-(1|4|8)|v6e-(1|4|8))$")
KNOWN_TPU = re.compile(r"^(v2|v3|v4|v5p|v5litepod|v6e)-\d+$")


class LaunchError(ValueError):
  """A launch flag that cannot work, named with what is allowed."""


def _q(args: list[str]) -> str:
  return shlex.join(args)


def _commit() -> str:
  out = subprocess.run(
    ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
  )
  if out.returncode != 0:
    raise LaunchError(f"launch needs a git checkout to ship (git rev-parse failed in {ROOT})")
  return out.stdout.strip()


def _train_command(args, extra: str, commit: str) -> str:
  """The command every host runs, from inside the unpacked checkout."""
  train = ["python3", "-m", "launch.train", f"--config={args.config}", *args.train_args]
  env = f"JAXRL_COMMIT={commit} {extra}".strip()
  return f"cd ~/{REMOTE_DIR} && env {env} {_q(train)}"


def _install_command(extra_name: str) -> str:
  return (
    f"mkdir -p ~/{REMOTE_DIR} && tar -xzf ~/{ARCHIVE} -C ~/{REMOTE_DIR} && cd ~/{REMOTE_DIR} && "
    f'python3 -m pip install -q -e ".[{extra_name}]"'
  )


def tpu_commands(args, commit: str) -> list[list[str]]:
  if not KNOWN_TPU.match(args.accelerator):
    raise LaunchError(
      f"--accelerator={args.accelerator!r} is not a TPU VM accelerator type (e.g. v4-8, "
      "v5litepod-8, v5p-8, v6e-8)"
    )
  where = ["--zone", args.zone] + (["--project", args.project] if args.project else [])
  tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
  cmds = []
  if args.create:
    create = [*tpu, "create", args.name, *where, "--accelerator-type", args.accelerator]
    cmds.append(create + ["--version", args.runtime] + (["--spot"] if args.spot else []))
  cmds.append(
    ["git", "-C", str(ROOT), "archive", "--format=tar.gz", "-o", f"/tmp/{ARCHIVE}", commit]
  )
  scp = [*tpu, "scp", f"/tmp/{ARCHIVE}", f"{args.name}:~/{ARCHIVE}", *where, "--worker=all"]
  cmds.append(scp)
  ssh = [*tpu, "ssh", args.name, *where, "--worker=all", "--command"]
  cmds.append([*ssh, _install_command("tpu")])
  multi = "" if SINGLE_HOST.match(args.accelerator) else "JAXRL_COORDINATOR=auto"
  cmds.append([*ssh, _train_command(args, multi, commit)])
  return cmds


def gpu_commands(args, commit: str) -> list[list[str]]:
  if not args.host:
    raise LaunchError("gpu needs --host=[user@]hostname (the machine whose GPUs run the job)")
  visible = f"CUDA_VISIBLE_DEVICES={args.gpus}" if args.gpus else ""
  cmds = [["git", "-C", str(ROOT), "archive", "--format=tar.gz", "-o", f"/tmp/{ARCHIVE}", commit]]
  cmds.append(["scp", f"/tmp/{ARCHIVE}", f"{args.host}:~/{ARCHIVE}"])
  cmds.append(["ssh", args.host, _install_command("cuda")])
  cmds.append(["ssh", args.host, _train_command(args, visible, commit)])
  return cmds


def parse(argv: list[str]) -> argparse.Namespace:
  if "--" in argv:
    i = argv.index("--")
    argv, train_args = argv[:i], argv[i + 1 :]
  else:
    train_args = []
  ap = argparse.ArgumentParser(prog="python -m launch.remote", description=__doc__.split("\n")[0])
  sub = ap.add_subparsers(dest="target", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--config", default="configs/grpo_arith.py", help="as for launch.train")
  common.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  t = sub.add_parser("tpu", parents=[common], help="a Cloud TPU VM (gcloud)")
  t.add_argument("--name", required=True, help="the TPU VM's name")
  t.add_argument("--zone", required=True, help="e.g. us-central2-b")
  t.add_argument("--project", default=None, help="gcloud project (default: gcloud's)")
  t.add_argument("--accelerator", default="v4-8", help="accelerator type, e.g. v4-8, v5litepod-8")
  t.add_argument(
    "--runtime",
    default="tpu-ubuntu2204-base",
    help="TPU VM software version (v2-v4, v5p: tpu-ubuntu2204-base; v5e: v2-alpha-tpuv5-lite; "
    "v6e: v2-alpha-tpuv6e)",
  )
  t.add_argument("--create", action="store_true", help="create the TPU VM first")
  t.add_argument("--spot", action="store_true", help="with --create: a spot (preemptible) VM")
  g = sub.add_parser("gpu", parents=[common], help="one GPU host over ssh")
  g.add_argument("--host", default=None, help="[user@]hostname")
  g.add_argument("--gpus", default=None, help="CUDA_VISIBLE_DEVICES for the run (default: all)")
  args = ap.parse_args(argv)
  args.train_args = train_args
  if not args.config.split(":")[0].endswith(".py"):
    raise LaunchError(f"--config={args.config!r} must name a config file (configs/*.py[:variant])")
  if not (ROOT / args.config.split(":")[0]).is_file():
    raise LaunchError(f"--config={args.config!r}: no such file in this checkout ({ROOT})")
  return args


def _dirty() -> bool:
  out = subprocess.run(
    ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
    capture_output=True,
    text=True,
    check=False,
  )
  return bool(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
  try:
    args = parse(sys.argv[1:] if argv is None else argv)
    commit = _commit()
    if _dirty():
      print(f"warning: uncommitted changes stay here; the remote runs commit {commit[:12]}")
    cmds = (tpu_commands if args.target == "tpu" else gpu_commands)(args, commit)
  except LaunchError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  for i, cmd in enumerate(cmds, 1):
    print(f"[{i}/{len(cmds)}] {_q(cmd)}", flush=True)
    if not args.dry_run:
      rc = subprocess.run(cmd, check=False).returncode
      if rc != 0:
        print(f"error: step {i} exited {rc}; the steps after it did not run", file=sys.stderr)
        return rc
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
