"""launch.sweep: argument checks, t quantiles and CIs, summaries, plots, paired diffs, runs."""

import json
import math
import sys
from pathlib import Path

import jax
import pytest
from xla_env import xla_flags

from launch import sweep
from launch.sweep_report import (
  SweepError,
  compare_runs,
  describe,
  load_runs,
  make_record,
  summarize,
  summarize_runs,
  t_quantile,
)

ROOT = Path(__file__).parent.parent
CONFIG = str(ROOT / "configs/grpo_arith.py")
IDENT = {"config": "configs/grpo_arith.py", "variant": "smoke", "overrides": ["rl.steps=2"]}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# A stand-in for launch.train: parses the flags the sweep passes, then writes what the trainer
# writes (metrics.jsonl, summary.json) in milliseconds. It records the XLA_FLAGS it saw, and
# fails for the seeds listed in FAKE_FAIL_SEEDS.
FAKE_TRAIN = r"""
import json, os, sys
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
seed, workdir = int(flags["config.seed"]), flags["config.workdir"]
os.makedirs(workdir)  # the sweep cleared any stale workdir, so this must not exist
print("fake train", sys.argv[1:])
if str(seed) in os.environ.get("FAKE_FAIL_SEEDS", "").split(","):
  sys.exit(f"boom: seed {seed} diverged")
sft = 0.5 + 0.1 * seed
with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
  f.write(json.dumps({"step": 3, "phase": "sft", "global_step": 3, "sft/loss": 1.0}) + "\n")
  f.write(json.dumps({"step": 4, "phase": "sft", "global_step": 4, "eval/accuracy": sft}) + "\n")
  for s in (1, 2):
    r = {"step": s, "phase": "rl", "global_step": 4 + s, "eval/accuracy": sft + 0.01 * s}
    f.write(json.dumps(r) + "\n")
summary = {"accuracy_init": 0.0, "accuracy_after_sft": sft, "accuracy_after_rl": sft + 0.02,
           "wall_s": 1.5, "seen_xla_flags": os.environ.get("XLA_FLAGS", ""),
           "seen_overrides": [a for a in sys.argv[1:] if a.startswith("--config.rl.")]}
with open(os.path.join(workdir, "summary.json"), "w") as f:
  json.dump(summary, f)
"""


def _fake_run(out: Path, isa: str, seed: int, *, sft=None, rl=None, curve=None, rc=0, sampled=None):
  """Writes OUT/runs/<isa>_seed<seed>.json as a finished run would have; `sampled`: the sampled
  accuracies (after SFT, after RL) of a run with eval.num_samples > 0."""
  summary = {}
  if rc == 0:
    summary = {"accuracy_init": 0.0, "accuracy_after_sft": sft, "accuracy_after_rl": rl}
    summary["wall_s"] = 10.0 + seed
    if sampled is not None:
      summary["sampled_accuracy_after_sft"], summary["sampled_accuracy_after_rl"] = sampled
  steps = curve or [4, 6, 8]
  metrics = [{"step": 4, "phase": "sft", "global_step": 4, "eval/accuracy": sft}] if rc == 0 else []
  metrics += [
    {"step": s - 4, "phase": "rl", "global_step": s, "eval/accuracy": rl} for s in steps[1:]
  ]
  record = make_record(
    ident=IDENT,
    seed=seed,
    isa=isa,
    xla_flags="",
    returncode=rc,
    wall_s=20.0,
    summary=summary,
    metrics=metrics if rc == 0 else [],
    log_tail=["Traceback", "boom"] if rc else None,
  )
  path = out / "runs" / f"{isa}_seed{seed}.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(record))


# ------------------------------------------------------------------------------------ statistics


@pytest.mark.parametrize(
  "df, t", [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042), (120, 1.980)]
)
def test_t_quantile_matches_the_table(df, t):
  assert round(t_quantile(0.975, df), 3) == t
  assert round(t_quantile(0.025, df), 3) == -t  # symmetric


def test_t_quantile_matches_scipy():
  from scipy import stats  # a dependency of jax; sweep_report itself does not import it

  for p in (0.55, 0.9, 0.975, 0.995, 0.01):
    for df in (0.7, 1, 2, 3, 7, 29, 31, 100, 10_000):
      assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-8, abs=1e-9)


def test_describe_by_hand_and_undefined_cases():
  s = describe([0.9, 0.8, 0.95])
  # mean 2.65 / 3; s^2 = (0.0166667^2 + 0.0833333^2 + 0.0666667^2) / 2 = 0.00583333.
  assert s["n"] == 3
  assert s["mean"] == pytest.approx(0.8833333, abs=1e-6)
  assert s["std"] == pytest.approx(0.0763763, abs=1e-6)
  assert (s["min"], s["max"]) == (0.8, 0.95)
  # 0.8833333 -/+ 4.303 * 0.0763763 / sqrt(3); 4.303 is rounded, hence the 5e-5.
  assert s["ci95"] == pytest.approx([0.6935889, 1.0730778], abs=5e-5)
  one = describe([0.7])
  assert (one["n"], one["mean"], one["min"], one["max"]) == (1, 0.7, 0.7, 0.7)
  assert one["std"] is None and one["ci95"] is None
  assert describe([])["mean"] is None


def _summary_dir(out: Path) -> None:
  _fake_run(out, "native", 0, sft=0.8, rl=0.9)
  _fake_run(out, "native", 1, sft=0.75, rl=0.8)
  _fake_run(out, "native", 2, sft=0.85, rl=0.95, curve=[4, 5, 7, 8])  # other eval steps
  _fake_run(out, "avx2", 0, sft=0.8, rl=0.9)
  _fake_run(out, "avx2", 1, rc=1)


def test_summary_equals_hand_computed_statistics(tmp_path):
  _summary_dir(tmp_path)
  summary = summarize_runs(load_runs(tmp_path))
  assert list(summary["groups"]) == ["native", "avx2", "all"]
  assert summary["failed"] == ["avx2_seed1"]
  native = summary["groups"]["native"]
  assert native["seeds"] == [0, 1, 2]
  rl = native["metrics"]["accuracy_after_rl"]
  assert rl["values"] == [0.9, 0.8, 0.95]
  assert rl["n"] == 3 and (rl["min"], rl["max"]) == (0.8, 0.95)
  assert rl["mean"] == pytest.approx(0.8833333, abs=1e-6)
  assert rl["std"] == pytest.approx(0.0763763, abs=1e-6)
  assert rl["ci95"] == pytest.approx([0.6935889, 1.0730778], abs=5e-5)
  # Gains 0.1, 0.05, 0.1: mean 0.0833333, s = sqrt((2 * 0.0166667^2 + 0.0333333^2) / 2).
  gain = native["metrics"]["rl_gain"]
  assert gain["values"] == pytest.approx([0.1, 0.05, 0.1], abs=1e-12)
  assert gain["mean"] == pytest.approx(0.0833333, abs=1e-6)
  assert gain["std"] == pytest.approx(0.0288675, abs=1e-6)
  # 0.0833333 -/+ 4.303 * 0.0288675 / sqrt(3) = 0.0833333 -/+ 0.0717167.
  assert gain["ci95"] == pytest.approx([0.0116167, 0.1550500], abs=5e-5)
  assert native["metrics"]["wall_s"]["values"] == [10.0, 11.0, 12.0]
  # The failed avx2 run is left out: one seed, so no std and no CI.
  avx2 = summary["groups"]["avx2"]["metrics"]["accuracy_after_rl"]
  assert (avx2["n"], avx2["mean"], avx2["std"], avx2["ci95"]) == (1, 0.9, None, None)
  # Pooled: 0.9, 0.8, 0.95, 0.9; mean 0.8875, s^2 = (3 * 0.0125^2 + 0.0875^2) / 3 = 0.00395833;
  # 0.8875 -/+ 3.182 * 0.0629153 / 2.
  pooled = summary["groups"]["all"]["metrics"]["accuracy_after_rl"]
  assert pooled["n"] == 4 and pooled["runs"][-1] == "avx2_seed0"
  assert pooled["mean"] == pytest.approx(0.8875, abs=1e-9)
  assert pooled["std"] == pytest.approx(0.0629153, abs=1e-6)
  assert pooled["ci95"] == pytest.approx([0.7874018, 0.9875982], abs=5e-5)


def test_summarize_writes_json_markdown_and_a_png(tmp_path):
  _summary_dir(tmp_path)
  md = summarize(tmp_path)
  assert (tmp_path / "accuracy.png").read_bytes()[:8] == PNG_MAGIC
  assert (tmp_path / "summary.md").read_text() == md
  assert "| native | accuracy_after_rl | 3 | 0.883 |" in md
  assert "| avx2 | accuracy_after_rl | 1 | 0.900 | n/a |" in md
  assert "avx2_seed1 (failed)" in md
  on_disk = json.loads((tmp_path / "summary.json").read_text())
  assert on_disk["groups"]["all"]["metrics"]["accuracy_after_sft"]["n"] == 4
  assert not list(tmp_path.glob("*.tmp"))


def test_run_records_hold_the_eval_curve_and_the_gain(tmp_path):
  _fake_run(tmp_path, "native", 0, sft=0.8, rl=0.9)
  (run,) = load_runs(tmp_path)
  assert run["eval_curve"] == [[4, 0.8], [6, 0.9], [8, 0.9]]
  assert run["sft_end_step"] == 4
  assert run["rl_gain"] == pytest.approx(0.1)
  assert run["sampled_rl_gain"] is None  # eval.num_samples was 0
  assert run["ok"] and "log_tail" not in run


def test_sampled_accuracy_gain_is_summarized_beside_the_greedy_one(tmp_path):
  # Greedy accuracy at its ceiling after SFT; the sampled one is what RL still moves.
  _fake_run(tmp_path, "native", 0, sft=1.0, rl=1.0, sampled=(0.80, 0.95))
  _fake_run(tmp_path, "native", 1, sft=0.9, rl=0.92, sampled=(0.70, 0.80))
  run0 = load_runs(tmp_path)[0]
  assert run0["rl_gain"] == 0.0 and run0["sampled_rl_gain"] == pytest.approx(0.15)
  metrics = summarize_runs(load_runs(tmp_path))["groups"]["native"]["metrics"]
  gain = metrics["sampled_rl_gain"]
  assert gain["n"] == 2 and gain["mean"] == pytest.approx(0.125)
  assert gain["min"] == pytest.approx(0.10) and gain["max"] == pytest.approx(0.15)
  # Two values 0.05 apart: sample std sqrt(2 * 0.025**2 / 1); t(0.975, df=1) = 12.7062.
  half = 12.7062 * math.sqrt(2 * 0.025**2) / math.sqrt(2)
  assert gain["ci95"] == pytest.approx([0.125 - half, 0.125 + half], abs=1e-4)
  assert metrics["sampled_accuracy_after_sft"]["mean"] == pytest.approx(0.75)
  assert "| native | sampled_rl_gain | 2 | +0.125 |" in summarize(tmp_path)


def test_load_runs_rejects_an_empty_dir_and_a_foreign_json(tmp_path):
  with pytest.raises(SweepError, match="holds no runs"):
    load_runs(tmp_path)
  (tmp_path / "runs").mkdir()
  (tmp_path / "runs" / "x.json").write_text('{"seed": 0}')
  with pytest.raises(SweepError, match="lacks"):
    load_runs(tmp_path)


# ---------------------------------------------------------------------------------- comparison


def _compare_dirs(tmp_path):
  a, b = tmp_path / "base", tmp_path / "new"
  for seed, sft, rl in [(0, 0.8, 0.9), (1, 0.7, 0.8), (2, 0.9, 0.95)]:
    _fake_run(a, "native", seed, sft=sft, rl=rl)
  _fake_run(a, "avx2", 0, sft=0.8, rl=0.9)
  for seed, sft, rl in [(1, 0.7, 0.85), (2, 0.9, 0.95), (3, 0.9, 0.99)]:
    _fake_run(b, "native", seed, sft=sft, rl=rl)
  _fake_run(b, "avx2", 0, sft=0.8, rl=0.8)
  _fake_run(b, "avx2", 2, rc=1)
  return a, b


def test_paired_comparison_by_hand(tmp_path):
  a, b = _compare_dirs(tmp_path)
  result = compare_runs(load_runs(a), load_runs(b), "accuracy_after_rl")
  # Pairs: native 1, 2 and avx2 0; native 0 is only in A, native 3 only in B, avx2 2 failed.
  assert [(p["isa"], p["seed"]) for p in result["pairs"]] == [
    ("native", 1),
    ("native", 2),
    ("avx2", 0),
  ]
  assert [p["diff"] for p in result["pairs"]] == pytest.approx([0.05, 0.0, -0.1], abs=1e-12)
  assert (result["wins"], result["ties"], result["losses"]) == (1, 1, 1)
  assert result["n"] == 3
  assert result["mean_diff"] == pytest.approx(-0.0166667, abs=1e-6)
  assert (result["min"], result["max"]) == pytest.approx((-0.1, 0.05), abs=1e-12)
  # -0.0166667 -/+ 4.303 * 0.0763763 / sqrt(3).
  assert result["ci95"] == pytest.approx([-0.2064111, 0.1730778], abs=5e-5)
  assert result["unpaired_a"] == ["native_seed0"]
  assert result["unpaired_b"] == ["native_seed3"]


def test_compare_cli_writes_json_and_rejects_disjoint_sweeps(tmp_path, capsys):
  a, b = _compare_dirs(tmp_path)
  assert sweep.main(["compare", str(a), str(b), "--metric=rl_gain"]) == 0
  assert "wins/ties/losses 1/1/1" in capsys.readouterr().out
  written = json.loads((b / "compare_base.json").read_text())
  assert written["metric"] == "rl_gain"
  assert [p["diff"] for p in written["pairs"]] == pytest.approx([0.05, 0.0, -0.1], abs=1e-12)
  c = tmp_path / "other"
  _fake_run(c, "native", 7, sft=0.5, rl=0.6)
  with pytest.raises(SweepError, match=r"no \(isa, seed\) pair"):
    compare_runs(load_runs(a), load_runs(c))
  with pytest.raises(SystemExit, match="native_seed7"):
    sweep.main(["compare", str(a), str(c)])


# ---------------------------------------------------------------------------- arguments and runs


def test_parse_seeds_and_xla_flags():
  assert sweep.parse_seeds("0,1,2") == [0, 1, 2]
  assert sweep.parse_seeds("0-4") == [0, 1, 2, 3, 4]
  assert sweep.parse_seeds("0-2, 7") == [0, 1, 2, 7]
  assert sweep.xla_flags_for("native", "--a=1") == "--a=1"
  assert sweep.xla_flags_for("avx2", "--a=1") == "--a=1 --xla_cpu_max_isa=AVX2"
  assert sweep.xla_flags_for("avx2", "") == "--xla_cpu_max_isa=AVX2"


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--seeds=0-x"], "'0-x'"),
    (["--seeds=3-1"], "'3-1' is not a seed"),
    (["--seeds=0,1,1"], "seed 1 is listed twice"),
    (["--seeds="], "'' is not a seed"),
    (["--isa=native,avx9"], "'avx9' is unknown; allowed: native, avx2"),
    (["--config=configs/nope.py"], "no such file 'configs/nope.py'"),
    (["--config=configs/grpo_arith.py:huge"], "unknown config variant 'huge'"),
    (["--set", "rl.stepz=3"], "config.rl has no field 'stepz'"),
    (["--set", "config.rl.steps=abc"], "config.rl.steps needs a int"),
    (["--set", "seed=3"], "config.seed is set by the sweep"),
    (["--", "rl.steps=3"], "only --config.KEY=VALUE"),
    (["--parallel=0"], "--parallel=0 is invalid"),
  ],
)
def test_bad_arguments_fail_before_anything_is_created(flags, message, tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(sweep, "TRAIN_COMMAND", ("false",))  # a run would fail the test's checks
  out = tmp_path / "out"
  argv = ["run", "--config=configs/grpo_arith.py:smoke", "--seeds=0", f"--out={out}"]
  extra = flags[flags.index("--") :] if "--" in flags else []
  with pytest.raises(SystemExit) as e:
    sweep.main([*argv, *[f for f in flags if f not in extra], *extra])
  assert message in str(e.value.code)
  assert not out.exists()


def test_sweep_runs_skips_retries_and_reports_failures(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(sweep, "TRAIN_COMMAND", (sys.executable, "-c", FAKE_TRAIN))
  monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
  monkeypatch.setenv("FAKE_FAIL_SEEDS", "1")
  out = tmp_path / "sweep"
  argv = ["run", f"--config={CONFIG}:smoke", "--seeds=0-2", "--isa=native,avx2", f"--out={out}"]
  argv += ["--parallel=2", "--set", "rl.steps=2", "--", "--config.rl.kl.beta=0.0"]
  with pytest.raises(SystemExit) as e:
    sweep.main(argv)
  assert "2 of 6 runs failed: native_seed1 (rc=1), avx2_seed1 (rc=1)" in str(e.value.code)
  printed = capsys.readouterr().out
  assert "start avx2_seed2" in printed and "FAILED native_seed1" in printed

  ok = json.loads((out / "runs" / "avx2_seed2.json").read_text())
  assert ok["ok"] and ok["returncode"] == 0
  assert ok["xla_flags"] == "--xla_foo=1 --xla_cpu_max_isa=AVX2"
  assert ok["summary"]["seen_xla_flags"] == ok["xla_flags"]  # what the process was given
  assert ok["summary"]["seen_overrides"] == ["--config.rl.kl.beta=0.0", "--config.rl.steps=2"]
  assert ok["overrides"] == ["rl.kl.beta=0.0", "rl.steps=2"]
  assert ok["eval_curve"] == [[4, 0.7], [5, 0.71], [6, 0.72]]
  assert ok["rl_gain"] == pytest.approx(0.02)
  native = json.loads((out / "runs" / "native_seed0.json").read_text())
  assert native["xla_flags"] == "--xla_foo=1"
  bad = json.loads((out / "runs" / "native_seed1.json").read_text())
  assert bad["returncode"] == 1 and not bad["ok"]
  assert "boom: seed 1 diverged" in bad["log_tail"]
  assert "boom: seed 1 diverged" in (out / "logs" / "native_seed1.log").read_text()
  summary = json.loads((out / "summary.json").read_text())
  assert summary["groups"]["avx2"]["seeds"] == [0, 2]
  assert summary["groups"]["all"]["metrics"]["accuracy_after_sft"]["n"] == 4
  assert summary["failed"] == ["native_seed1", "avx2_seed1"]
  assert (out / "accuracy.png").read_bytes()[:8] == PNG_MAGIC

  # Re-run: the finished runs are skipped, the failed ones retried (their stale workdirs are
  # cleared, or the fake trainer's makedirs would fail).
  before = (out / "runs" / "native_seed0.json").read_text()
  monkeypatch.setenv("FAKE_FAIL_SEEDS", "")
  assert sweep.main(argv) == 0
  printed = capsys.readouterr().out
  assert printed.count("[sweep] skip") == 4 and printed.count("[sweep] start") == 2
  assert (out / "runs" / "native_seed0.json").read_text() == before
  assert json.loads((out / "summary.json").read_text())["failed"] == []

  # The same --out with other overrides is refused before anything runs.
  with pytest.raises(SystemExit, match="holds runs of another sweep"):
    sweep.main([*argv[:-1], "--config.rl.kl.beta=0.5"])
  assert "start" not in capsys.readouterr().out


# A stand-in that, like the trainer with resume=True, finds a finished warm-start and adds RL.
FAKE_RL_ONLY = r"""
import json, os, sys
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
workdir = flags["config.workdir"]
sft_ckpt = os.path.isdir(os.path.join(workdir, "checkpoints", "sft", "60"))
with open(os.path.join(workdir, "metrics.jsonl")) as f:
  sft = [json.loads(line) for line in f]
with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
  f.write(json.dumps({"step": 1, "phase": "rl", "global_step": 61, "eval/accuracy": 0.8}) + "\n")
summary = {"accuracy_init": 0.0, "accuracy_after_sft": sft[-1]["eval/accuracy"],
           "accuracy_after_rl": 0.8, "wall_s": 1.0, "resume": flags["config.resume"],
           "found_sft_checkpoint": sft_ckpt}
with open(os.path.join(workdir, "summary.json"), "w") as f:
  json.dump(summary, f)
"""


def _source_sweep(tmp_path, overrides=()):
  """A finished sweep's directory: sweep.json and native_seed0's SFT checkpoint and metrics."""
  src = tmp_path / "src"
  ident = {"config": CONFIG, "variant": "smoke", "overrides": list(overrides)}
  (src / "work" / "native_seed0" / "checkpoints" / "sft" / "60").mkdir(parents=True)
  (src / "sweep.json").write_text(json.dumps(ident))
  records = [
    {"step": 60, "phase": "sft", "global_step": 60, "eval/accuracy": 0.6},
    {"step": 1, "phase": "rl", "global_step": 61, "eval/accuracy": 0.1},  # the source's own RL
  ]
  metrics = "".join(json.dumps(r) + "\n" for r in records)
  (src / "work" / "native_seed0" / "metrics.jsonl").write_text(metrics)
  return src


def test_sft_from_starts_rl_from_the_source_sweeps_warm_starts(tmp_path, monkeypatch):
  monkeypatch.setattr(sweep, "TRAIN_COMMAND", (sys.executable, "-c", FAKE_RL_ONLY))
  src, out = _source_sweep(tmp_path), tmp_path / "out"
  argv = ["run", f"--config={CONFIG}:smoke", "--seeds=0", f"--out={out}", f"--sft-from={src}"]
  assert sweep.main([*argv, "--set", "rl.optim.learning_rate=3e-5"]) == 0
  run = json.loads((out / "runs" / "native_seed0.json").read_text())
  assert run["ok"] and run["sft_from"] == str(src)
  assert run["summary"]["resume"] == "True" and run["summary"]["found_sft_checkpoint"]
  # The source's SFT records were copied, its RL records were not.
  assert run["eval_curve"] == [[60, 0.6], [61, 0.8]]
  assert run["rl_gain"] == pytest.approx(0.2)

  # Refused before anything runs: an override of the warm-start, a source that overrode it,
  # a seed the source lacks, a directory that is not a sweep.
  cases = [
    (["--seeds=0", "--set", "sft.steps=10"], src, "change the warm-start"),
    (["--seeds=0"], _source_sweep(tmp_path / "b", ["sft.learning_rate=0.1"]), "change the warm"),
    (["--seeds=0-1"], src, "no final SFT checkpoint (step 60) for ['native_seed1']"),
    (["--seeds=0"], tmp_path, "no sweep.json there"),
  ]
  for extra, source, message in cases:
    other = tmp_path / "refused"
    flags = ["run", f"--config={CONFIG}:smoke", f"--out={other}", f"--sft-from={source}", *extra]
    with pytest.raises(SystemExit) as e:
      sweep.main(flags)
    assert message in str(e.value.code)
    assert not other.exists()


@pytest.mark.e2e
def test_end_to_end_smoke_run_then_skip(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(ROOT)
  # The run reuses the session's persistent compilation cache (tests/conftest.py): compiling
  # is most of its time on CPU.
  cache = jax.config.jax_compilation_cache_dir
  if cache:
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", cache)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  monkeypatch.setenv("XLA_FLAGS", xla_flags(None))  # one CPU device, as a user's sweep has
  out = tmp_path / "sweep"
  argv = ["run", "--config=configs/grpo_arith.py:smoke", "--seeds=0", "--isa=native"]
  argv += [f"--out={out}"]
  for o in [
    "model.preset=tiny",
    "sft.steps=10",
    "sft.batch_size=8",
    "rl.steps=2",
    "rl.prompts_per_step=4",
    "rl.group_size=2",
    "eval.every=1",
    "eval.num_examples=16",
    "checkpoint.every=1",
    "log.tensorboard=False",
  ]:
    argv += ["--set", o]
  assert sweep.main(argv) == 0, (out / "logs" / "native_seed0.log").read_text()[-3000:]
  run = json.loads((out / "runs" / "native_seed0.json").read_text())
  assert run["ok"] and run["returncode"] == 0
  assert {"accuracy_init", "accuracy_after_sft", "accuracy_after_rl", "wall_s"} <= set(
    run["summary"]
  )
  # One SFT eval at step 10, then RL evals at global steps 11 and 12.
  assert [x for x, _ in run["eval_curve"]] == [10, 11, 12]
  assert run["sft_end_step"] == 10
  assert all(0.0 <= y <= 1.0 for _, y in run["eval_curve"])
  assert math.isclose(
    run["rl_gain"], run["summary"]["accuracy_after_rl"] - run["summary"]["accuracy_after_sft"]
  )
  summary = json.loads((out / "summary.json").read_text())
  assert summary["groups"]["native"]["metrics"]["accuracy_after_rl"]["n"] == 1
  assert summary["groups"]["native"]["metrics"]["accuracy_after_rl"]["ci95"] is None
  assert (out / "accuracy.png").read_bytes()[:8] == PNG_MAGIC
  capsys.readouterr()

  def no_subprocess(*args, **kwargs):
    raise AssertionError("a finished run was started again")

  monkeypatch.setattr(sweep.subprocess, "run", no_subprocess)
  assert sweep.main(argv) == 0
  assert "[sweep] skip native_seed0" in capsys.readouterr().out
