"""jaxrl's dependency ranges, installed and run at both ends.

setup.cfg states each dependency as a range (e.g. `jax>=0.10.0,<0.11`), so jaxrl installs next
to the jax[tpu] / jax[cuda] a machine needs. This resolves the ranges at one end with uv
(`lower`: every direct dependency at the lowest version its range allows, uv's
`--resolution=lowest-direct`; `upper`: the highest, which is also what a plain `pip install`
takes), builds a fresh venv holding exactly that set, installs jaxrl into it (a real install,
constrained to the set) and runs the default job's smoke there.

  python -m launch.deps resolve --end=lower              the pinned set, one `name==version` a line
  python -m launch.deps check --end=lower --venv=DIR [--steps=SFT,RL] [-- pytest args]
                                                         build, install, run the smoke (and pytest
                                                         with the given arguments, if any)

The test suite resolves both ends and runs `check --end=lower` on every CI run
(tests/launch_deps_test.py); the suite itself runs in the upper end's venv (launch/env.sh
installs with pip, which takes the highest versions allowed).
"""

from __future__ import annotations

import argparse
import configparser
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENDS = {"lower": "lowest-direct", "upper": "highest"}
_PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)")


class DepsError(RuntimeError):
  """A range that does not resolve, an install or a run that failed: what and its output."""


def requirements(setup_cfg: Path = ROOT / "setup.cfg") -> list[str]:
  """install_requires of setup.cfg, one requirement string each."""
  cfg = configparser.ConfigParser()
  cfg.read(setup_cfg)
  return [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]


def lower_bounds(reqs: list[str]) -> dict[str, str]:
  """{name: the version after `>=`} of every requirement that states a lower bound."""
  out = {}
  for r in reqs:
    m = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*>=\s*([^,\s]+)", r)
    if m:
      out[_name(m.group(1))] = m.group(2)
  return out


def _name(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _uv() -> str:
  uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
  if not Path(uv).exists():
    raise DepsError("uv is not installed: pip install uv (it is in jaxrl's [test] extra)")
  return uv


def resolve(end: str, reqs: list[str] | None = None) -> dict[str, str]:
  """{name: version} of every package (direct and indirect) at `end` ('lower' or 'upper') of
  the ranges, for this Python version."""
  if end not in ENDS:
    raise ValueError(f"end={end!r} is invalid; allowed: {sorted(ENDS)}")
  reqs = requirements() if reqs is None else reqs
  version = f"{sys.version_info.major}.{sys.version_info.minor}"
  cmd = [_uv(), "pip", "compile", "-", "--quiet", "--no-header", "--no-annotate",
         f"--resolution={ENDS[end]}", f"--python-version={version}"]  # fmt: skip
  out = subprocess.run(cmd, input="\n".join(reqs), capture_output=True, text=True)
  if out.returncode:
    raise DepsError(f"the {end} end of setup.cfg's ranges does not resolve:\n{out.stderr}")
  pins = {}
  for line in out.stdout.splitlines():
    m = _PIN.match(line.strip())
    if m:
      pins[_name(m.group(1))] = m.group(2)
  return pins


def _run(cmd: list[str], what: str, **kw) -> str:
  out = subprocess.run(cmd, capture_output=True, text=True, **kw)
  if out.returncode:
    raise DepsError(f"{what} failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
  return out.stdout


def build(end: str, venv: Path, *, log=print) -> dict[str, str]:
  """A fresh venv at `venv` with the `end` set and jaxrl installed from this checkout under
  that set as constraints (so the install itself checks that jaxrl's ranges admit it).
  Returns the versions installed there."""
  pins = resolve(end)
  venv = Path(venv)
  if venv.exists():
    shutil.rmtree(venv)
  uv = _uv()
  _run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], "creating the venv")
  python = venv / "bin" / "python"
  with tempfile.TemporaryDirectory() as tmp:
    constraints = Path(tmp) / "constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    log(f"[deps] installing jaxrl at the {end} end into {venv}")
    # A copy of the sources: building in the checkout would leave build/ and egg-info behind.
    src = Path(tmp) / "jaxrl"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "runs", "build", "*.egg-info"))
    _run([uv, "pip", "install", "--quiet", "--python", str(python), "-c", str(constraints),
          str(src), "pytest>=8"], f"installing jaxrl at the {end} end")  # fmt: skip
  code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"  # noqa: E501
  got = json.loads(_run([str(python), "-c", code, *sorted(lower_bounds(requirements()))], "import"))
  return {_name(k): v for k, v in got.items()}


def smoke(venv: Path, workdir: Path, *, sft_steps: int, rl_steps: int) -> dict:
  """The default job's smoke with `venv`'s Python and its installed jaxrl (run from `workdir`,
  outside the checkout, with only `launch/` taken from the checkout); its summary.json."""
  python = Path(venv) / "bin" / "python"
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  code = (
    f"import runpy, sys; sys.path.append({str(ROOT)!r}); import jaxrl; "
    f"assert not jaxrl.__file__.startswith({str(ROOT)!r}), jaxrl.__file__; "
    "sys.argv = ['launch.train', *sys.argv[1:]]; "
    "runpy.run_module('launch.train', run_name='__main__')"
  )
  _run([str(python), "-c", code, f"--config={ROOT / 'configs' / 'grpo_arith.py'}:smoke",
        f"--config.workdir={workdir / 'run'}", f"--config.sft.steps={sft_steps}",
        f"--config.rl.steps={rl_steps}", "--config.log.progress=False"],
       "the smoke job", cwd=workdir)  # fmt: skip
  return json.loads((workdir / "run" / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  extra = argv[argv.index("--") + 1 :] if "--" in argv else []
  argv = argv[: argv.index("--")] if "--" in argv else argv
  ap = argparse.ArgumentParser(prog="python -m launch.deps", description=__doc__.split("\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("resolve")
  r.add_argument("--end", choices=sorted(ENDS), required=True)
  c = sub.add_parser("check")
  c.add_argument("--end", choices=sorted(ENDS), required=True)
  c.add_argument("--venv", required=True, help="the venv to (re)create")
  c.add_argument("--steps", default="4,2", help="SFT,RL steps of the smoke run")
  args = ap.parse_args(argv)
  try:
    if args.cmd == "resolve":
      for name, version in sorted(resolve(args.end).items()):
        print(f"{name}=={version}")
      return 0
    sft, _, rl = args.steps.partition(",")
    if not (sft.isdigit() and rl.isdigit()):
      ap.error(f"--steps={args.steps!r} must be SFT,RL step counts, e.g. 4,2")
    got = build(args.end, Path(args.venv))
    print("[deps] " + " ".join(f"{n}=={v}" for n, v in sorted(got.items())))
    with tempfile.TemporaryDirectory() as tmp:
      s = smoke(Path(args.venv), Path(tmp), sft_steps=int(sft), rl_steps=int(rl))
    print(f"[deps] smoke at the {args.end} end: accuracy after RL {s['accuracy_after_rl']:.3f}")
    if extra:
      python = Path(args.venv) / "bin" / "python"
      return subprocess.run([str(python), "-m", "pytest", *extra], cwd=ROOT).returncode
    return 0
  except DepsError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
