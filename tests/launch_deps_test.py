"""setup.cfg states its dependencies as ranges; they resolve at both ends, and jaxrl installs and
runs the default job's smoke at the lower end, in a venv of its own (launch/deps.py). The suite
itself runs at the upper end: launch/env.sh installs with pip, which takes the highest versions
the ranges allow."""

import importlib.metadata

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from xla_env import xla_flags

from launch import deps

CORE = {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "ml-collections", "numpy"}


@pytest.fixture(scope="module")
def reqs():
  return deps.requirements()


def test_the_core_dependencies_are_ranges_with_both_ends(reqs):
  specs = {deps._name(Requirement(r).name): Requirement(r).specifier for r in reqs}
  for name in CORE:
    ops = sorted(s.operator for s in specs[name])
    assert ops == ["<", ">="], (name, str(specs[name]))  # no exact pins, no open top


def test_each_lower_bound_is_what_the_lower_end_resolves_to(reqs):
  lower, bounds = deps.resolve("lower", reqs), deps.lower_bounds(reqs)
  assert CORE <= set(bounds)
  for name, bound in bounds.items():
    # A bound that resolves higher states a version nothing was ever tested with.
    assert Version(lower[name]) == Version(bound), name


def test_the_upper_end_resolves_within_the_ranges_and_the_suite_runs_inside_them(reqs):
  upper = deps.resolve("upper", reqs)
  for r in map(Requirement, reqs):
    name = deps._name(r.name)
    assert r.specifier.contains(upper[name]), (name, upper[name])
    assert r.specifier.contains(importlib.metadata.version(r.name)), name


@pytest.mark.e2e
def test_jaxrl_installs_and_runs_the_default_smoke_at_the_lower_end(reqs, tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", xla_flags(None))  # one CPU device, as a user's install has
  got = deps.build("lower", tmp_path / "venv", log=lambda *_: None)
  lower = deps.resolve("lower", reqs)
  assert got == {name: lower[name] for name in deps.lower_bounds(reqs)}
  summary = deps.smoke(tmp_path / "venv", tmp_path / "smoke", sft_steps=4, rl_steps=2)
  assert 0.0 <= summary["accuracy_after_rl"] <= 1.0 and "accuracy_after_sft" in summary


def test_bad_arguments_are_named(capsys):
  with pytest.raises(SystemExit):
    deps.main(["check", "--end=middle", "--venv=/tmp/x"])
  assert "invalid choice: 'middle'" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    deps.main(["check", "--end=lower", "--venv=/tmp/x", "--steps=4"])
  assert "--steps='4' must be SFT,RL step counts" in capsys.readouterr().err
  with pytest.raises(ValueError, match="end='middle' is invalid"):
    deps.resolve("middle", [])
