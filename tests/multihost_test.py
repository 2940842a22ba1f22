"""Two processes of two CPU devices each form one 4-device mesh (jax.distributed over gloo) and
take the learner's train steps with the params and the batch split across them: the losses and
the updates equal one process's with four devices; each process supplied only its own rows. Both
load an HF checkpoint onto that mesh first: each process reads only its devices' blocks of the
weights, and the params are those one process loads. Then both run the default job's smoke
(SFT, RL, evaluation, checkpoints) in one workdir and log what one process logs, each having
made half of the training records and scored half of the completions. The same job with the
split placement: each process gives one device to the learner's sub-mesh (across both) and one
to its own engine, which samples its half of every batch's prompts, and the two processes log
what one process with two devices a side logs, stopped and resumed included. Stopped by SIGTERM
at one process, or at each a step apart, both processes stop after the same step, checkpoint it
once and exit 143 (launch.train), and the run resumes from there. Over one checkpoint directory
whose newest steps cannot be read (one of them by one process only), both fall back to the same
step, and process 0 alone moves the unreadable ones aside."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import child_env, run_child, wait_children
from xla_env import xla_flags

from jaxrl import distributed

WORKER = Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _checkpoint(path: Path) -> Path:
  """A tiny random Qwen2 (biases: the FLAT transform too) saved as an HF checkpoint directory."""
  import torch
  import transformers

  cfg = transformers.Qwen2Config(
    vocab_size=131, hidden_size=48, intermediate_size=82, num_hidden_layers=2,
    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False,
  )  # fmt: skip
  torch.manual_seed(0)
  transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
  return path


def _jsonl_files(folder: Path) -> Path:
  """A 60-line GSM8K-style file (blank lines, multi-byte characters) and one whose line 50, in
  the second half of its bytes, lacks its answer; the same 51 records as Parquet files (the bad
  one's row 45 has no final answer)."""
  folder.mkdir()
  lines = [
    "" if i % 7 == 3 else json.dumps({"question": f"\u00e9t\u00e9 {i}?", "answer": f"x\n#### {i}"})
    for i in range(60)
  ]  # fmt: skip
  (folder / "good.jsonl").write_text("\n".join(lines) + "\n")
  rows = [json.loads(line) for line in lines if line]  # and as Parquet, in row groups of 8
  pq.write_table(pa.Table.from_pylist(rows), folder / "good.parquet", row_group_size=8)
  lines[49] = json.dumps({"question": "q?"})
  (folder / "bad.jsonl").write_text("\n".join(lines) + "\n")
  rows[44] = {"question": "q?", "answer": "no final answer"}
  pq.write_table(pa.Table.from_pylist(rows), folder / "bad.parquet", row_group_size=8)
  return folder


def _start(job: str, out: Path, processes: int, devices_each: int, **flags) -> list:
  """One run of the worker's `job`: `processes` processes of `devices_each` CPU devices."""
  out.mkdir(parents=True)
  env = child_env(XLA_FLAGS=xla_flags(devices_each), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, str(WORKER), f"--job={job}", f"--out={out}", f"--workdir={out / 'run'}"]
  cmd += [f"--{k}={v}" for k, v in flags.items()]
  if processes > 1:
    cmd += [f"--coordinator=127.0.0.1:{_free_port()}", f"--num-processes={processes}"]
  return [
    subprocess.Popen(
      cmd,
      env=env | {distributed.PROCESS_ID_ENV: str(i)},
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )  # fmt: skip
    for i in range(processes)
  ]


def _job(base: Path, job: str, **flags) -> tuple[list[dict], list[dict]]:
  """The worker's `job` run by one process of four devices and by two of two, side by side:
  what each process wrote (one list per run)."""
  one = _start(job, base / job / "one", 1, 4, **flags)
  two = _start(job, base / job / "two", 2, 2, **flags)
  runs = []
  for name, procs in (("one", one), ("two", two)):
    logs = wait_children(procs)
    for p, log in zip(procs, logs, strict=True):
      assert p.returncode == 0, log[-3000:]
    runs.append([json.loads((base / job / name / f"p{i}.json").read_text())
                 for i in range(len(procs))])  # fmt: skip
  return runs[0], runs[1]


# Three independent jobs, each a module fixture of its own xdist group: the suite's two workers
# run them side by side. Each job runs once per worker, however often pytest-xdist tears its
# module fixture down (a group's tests can reach the worker in several batches).
_DONE: dict[str, tuple[list[dict], list[dict]]] = {}


def _once(tmp_path_factory, job: str, **flags) -> tuple[list[dict], list[dict]]:
  if job not in _DONE:
    base = tmp_path_factory.mktemp("multihost")
    made = {k: f(base) for k, f in flags.items()}
    _DONE[job] = _job(base, job, **made)
  return _DONE[job]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The core job: train steps, an HF load, JSONL and Parquet reads, shares and a failure."""
  return _once(
    tmp_path_factory,
    "core",
    hf=lambda base: _checkpoint(base / "hf"),
    jsonl=lambda base: _jsonl_files(base / "files"),
  )


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
  """The default job's smoke (and, on two processes, stopped and resumed), then exchanges."""
  return _once(tmp_path_factory, "trainer")


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
  """The smoke with the split placement (and, on two processes, stopped and resumed)."""
  return _once(tmp_path_factory, "split")


def _of(job: str):
  """Marks a test asserting on `job`'s runs: end-to-end, in that job's xdist group."""

  def mark(test):
    return pytest.mark.e2e(pytest.mark.xdist_group(f"multihost_{job}")(test))

  return mark


core, trainer, split = _of("core"), _of("trainer"), _of("split")


@core
def test_two_processes_form_one_mesh_and_split_the_rows(runs):
  (one,), two = runs
  assert not one["joined"] and one["process_count"] == 1 and one["rows"] == list(range(16))
  for i, p in enumerate(two):
    assert p["joined"] and p["process_count"] == 2
    assert (p["devices"], p["local_devices"]) == (4, 2)
    assert p["rows"] == list(range(8 * i, 8 * i + 8))  # its own half of the batch, no more
    assert p["params_split_across_processes"] > 0  # FSDP over both hosts' devices
    assert p["compiles"] == 1
  assert one["params_split_across_processes"] == 0


@core
def test_two_processes_take_the_steps_of_one(runs):
  (one,), two = runs
  for p in two:  # every process sees the same (replicated) metrics and gathered params
    for step_one, step_two in zip(one["metrics"], p["metrics"], strict=True):
      for key in ("rl/loss", "rl/kl", "rl/pg_loss", "rl/entropy", "opt/grad_norm"):
        np.testing.assert_allclose(step_two[key], step_one[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert p["deltas"].keys() == one["deltas"].keys()
    for name, want in one["deltas"].items():
      # Two SGD steps' updates, per leaf, relative to the leaf's largest update (float32 sums
      # in another order across the processes' shards), as in train_step_sharded_test.
      want, got = np.asarray(want), np.asarray(p["deltas"][name])
      assert np.abs(want).max() > 0, name
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=name)


@core
def test_every_process_falls_back_to_the_same_readable_checkpoint(runs):
  _, two = runs
  directory = Path(two[0]["out"]) / "ckpt"
  for p in two:
    f = p["fallback"]
    assert f["error"] is None
    assert (f["step"], f["meta"]) == (2, {"step": 2})
    assert f["hash"] == f["saved"]["2"] != f["saved"]["3"]  # step 2's params, gathered whole
    assert (f["steps"], f["aside"]) == (["1", "2"], ["3", "4"])
    assert f["logged"][-1] == f"[jaxrl] falling back to checkpoint 2 in {directory}"
  # Step 3 lost only process 1's shards: process 0 read its own, and still let it go.
  assert "ocdbt.process_0" in two[0]["fallback"]["aside_step_3"]
  assert "ocdbt.process_1" not in two[0]["fallback"]["aside_step_3"]
  # Process 0 moved each unreadable step once; process 1 waited, and moved nothing.
  moved = two[0]["fallback"]["logged"][:-1]
  assert [line.split()[2] for line in moved] == ["4", "3"]
  assert all(line.endswith(f"moved to {directory}.unreadable/{line.split()[2]}") for line in moved)
  assert "(process 0: cannot read checkpoint metadata in" in moved[0]
  assert "(process 1: cannot restore checkpoint" in moved[1]
  assert len(two[1]["fallback"]["logged"]) == 1


@core
def test_each_process_reads_only_its_share_of_the_hf_weights(runs):
  (one,), two = runs
  # One process holds every block of every param (4 devices) and reads each distinct one once.
  assert one["hf"]["read"] == one["hf"]["held"] and one["hf"]["split"] == 0
  for p in two:
    h = p["hf"]
    assert h["split"] > 0  # FSDP over both processes' devices
    assert h["read"] == h["held"] < one["hf"]["read"]  # its own devices' blocks, no more
    assert h["hashes"] == one["hf"]["hashes"]  # gathered, the same params bit for bit
  # Replicated params (norms) are read by both; the split ones are shared between them.
  assert one["hf"]["read"] < two[0]["hf"]["read"] + two[1]["hf"]["read"] < 2 * one["hf"]["read"]


@core
def test_each_process_indexes_and_reads_only_its_share_of_a_jsonl_file(runs):
  (one,), two = runs
  size = (Path(one["out"]).parents[1] / "files" / "good.jsonl").stat().st_size
  scans = one["jsonl"]["scans"]  # good.jsonl, then bad.jsonl (read up to its bad line 50)
  assert scans[0] == [0, size, 60] and scans[1][2] == 50 and len(scans) == 2
  half = (size + 1) // 2
  for i, p in enumerate(two):
    # Its half of the bytes (of each file; bad.jsonl stops at its bad line), the lines that
    # start there: between them every line once.
    assert p["jsonl"]["scans"][0][:2] == [[0, half], [half, size]][i]
    assert p["jsonl"]["batches"] == one["jsonl"]["batches"]
    assert p["jsonl"]["held"] == one["jsonl"]["held"]
    # 3 batches of 6 and 4 held-out records: each process read half of each, no more.
    assert len(p["jsonl"]["read"]) == (3 * 6 + 4) // 2
    assert p["jsonl"]["error"] == one["jsonl"]["error"]
  assert sum(p["jsonl"]["scans"][0][2] for p in two) == 60
  assert 0 < two[0]["jsonl"]["scans"][0][2] < 60
  assert sorted(two[0]["jsonl"]["read"] + two[1]["jsonl"]["read"]) == sorted(one["jsonl"]["read"])
  assert one["jsonl"]["error"].startswith("RecordError: ")
  assert one["jsonl"]["error"].endswith(
    "bad.jsonl:50: missing field 'answer' (fields present: ['question'])"
  )


@core
def test_each_process_checks_only_its_share_of_a_parquet_files_row_groups(runs):
  (one,), two = runs
  # 51 rows in 7 groups of 8 (0-7, ..., 48-50): groups 0-3 are process 0's, 4-6 process 1's.
  assert one["parquet"]["scans"] == [[0, 7, list(range(7))], [0, 7, list(range(6))]]
  assert [p["parquet"]["scans"][0] for p in two] == [[0, 4, [0, 1, 2, 3]], [4, 7, [4, 5, 6]]]
  # bad.parquet: process 1 holds its bad row 45 (group 5) and stops there.
  assert [p["parquet"]["scans"][1] for p in two] == [[0, 4, [0, 1, 2, 3]], [4, 7, [4, 5]]]
  for p in two:
    assert p["parquet"]["batches"] == one["parquet"]["batches"] == one["jsonl"]["batches"]
    assert p["parquet"]["held"] == one["parquet"]["held"] == one["jsonl"]["held"]
    assert p["parquet"]["error"] == one["parquet"]["error"]
  assert one["parquet"]["error"].startswith("RecordError: ")
  assert one["parquet"]["error"].endswith("bad.parquet:45: field 'answer' must end with "
                                          "'#### <final answer>' (answer_format='gsm8k'), got "
                                          "'no final answer'")  # fmt: skip


@trainer
def test_two_processes_run_the_default_jobs_smoke_as_one(trainer_runs):
  (one,), two = trainer_runs
  base = Path(one["out"]).parent
  logs = {}
  for name in ("one", "two"):
    run = base / name / "run"
    logs[name] = _metrics(run / "metrics.jsonl")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["rl", "sft"]
  assert [r["phase"] for r in logs["two"]] == [r["phase"] for r in logs["one"]]
  assert {"sft/loss", "rl/loss", "rl/entropy", "eval/accuracy"} <= {
    k for r in logs["one"] for k in r
  }
  checked = 0
  for a, b in zip(logs["one"], logs["two"], strict=True):
    assert a.keys() == b.keys()
    for key, want in a.items():
      if key.startswith("time/") or not isinstance(want, float):
        continue
      np.testing.assert_allclose(b[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
      checked += 1
  assert checked > 50
  rl = [r for r in logs["one"] if "rl/loss" in r]
  assert all(r["opt/grad_norm"] > 0 for r in rl)  # the steps really moved the params


def _metrics(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_resumed_repeats(base: Path, full: str, resumed: str) -> None:
  """Workdir `resumed` (stopped by SIGTERM after an RL step, resumed) logged what `full`
  logged: every row once (the stopped try's rows kept, none repeated), every value but the
  timings equal."""
  a_rows, b_rows = (
    _metrics(base / full / "metrics.jsonl"),
    _metrics(base / resumed / "metrics.jsonl"),
  )
  assert [(r["phase"], r["step"]) for r in b_rows] == [(r["phase"], r["step"]) for r in a_rows]
  for a, b in zip(a_rows, b_rows, strict=True):
    assert {k: v for k, v in a.items() if not k.startswith("time/")} == {
      k: v for k, v in b.items() if not k.startswith("time/")
    }, a["step"]


@trainer
def test_a_resumed_two_process_run_repeats_the_uninterrupted_one(trainer_runs):
  (one,), _ = trainer_runs
  base = Path(one["out"]).parent / "two"
  _assert_resumed_repeats(base, "run", "run_resumed")
  summary = {n: json.loads((base / n / "summary.json").read_text()) for n in ("run", "run_resumed")}
  for key in ("accuracy_after_sft", "accuracy_after_rl", "sampled_accuracy_after_rl"):
    assert summary["run_resumed"][key] == summary["run"][key], key


def _assert_stopped_after_rl_step_1(two: list[dict], signalled: list[list[int]]) -> None:
  """Both processes of a try stopped by SIGTERM (launch.train, `signalled[i]`: the RL steps,
  0-based, at whose start process i sent itself the signal) stopped after RL step 1: each
  printed so and exited 143, step 1 was checkpointed and nothing after it, and the resumed
  run went on from there."""
  rl = Path(two[0]["out"]) / "run_resumed" / "checkpoints" / "rl"
  for p, sent in zip(two, signalled, strict=True):
    stopped = p["preempted"]["stopped"]
    assert stopped["sent"] == sent
    assert stopped["exit"] == 143
    assert stopped["said"] == [
      f"[jaxrl] stopped on SIGTERM after RL step 1, checkpointed in {rl}; run the same command "
      "(config.resume=True) to continue from there"
    ]
    assert stopped["rl_checkpoints"] == [1]
    assert f"[jaxrl] resumed RL from step 1 in {rl}" in p["preempted"]["logged"]


@trainer
def test_sigterm_at_one_process_stops_both_after_the_same_step(trainer_runs):
  _, two = trainer_runs
  _assert_stopped_after_rl_step_1(two, [[], [0]])  # process 1's signal only


# Each process's engine makes its own prefill and decode calls for its half of the prompts: these
# counters are summed over the engines, so they differ from one engine's over all of them.
ENGINE_CALLS = ("rollout/prefill_calls", "rollout/generate_calls", "rollout/decode_steps")


@split
def test_a_split_placement_over_two_processes_takes_the_steps_of_one(split_runs):
  (one,), two = split_runs
  # One process: 2 learner and 2 sampler devices. Two: each gives one device to each side.
  assert one["split_run"] == {
    "learner": {"processes": [0], "local": 2},
    "sampler": {"processes": [0], "local": 2},
    "lockstep": False,
  }
  for i, p in enumerate(two):
    assert p["split_run"]["learner"] == {"processes": [0, 1], "local": 1}
    assert p["split_run"]["sampler"] == {"processes": [i], "local": 1}  # its own engine
    assert p["split_run"]["lockstep"] is True
  assert two[0]["split_run"]["partial_error"] == (
    "config.rl.partial.enabled=True is not supported with rl.placement.kind='split' over 2 "
    "processes (each process's engine would hold its own groups in flight); allowed there: "
    "rl.placement.kind='colocated'"
  )
  base = Path(one["out"]).parent
  a = _metrics(base / "one" / "run" / "metrics.jsonl")
  b = _metrics(base / "two" / "run" / "metrics.jsonl")
  assert [(r["phase"], r["step"]) for r in b] == [(r["phase"], r["step"]) for r in a]
  rl = [r for r in b if r["phase"] == "rl"]
  assert len(rl) == 3 and [r["async/staleness_max"] for r in rl] == [0.0, 1.0, 1.0]
  # Lockstep: the host's sampling during the update and its wait after, not the learner's
  # busy share (its device time is not seen from the host).
  lockstep = {"time/sample_ahead_s", "time/update_wait_s"}
  assert all(lockstep <= r.keys() and "time/learner_busy_frac" not in r for r in rl)
  checked = 0
  for x, y in zip(a, b, strict=True):
    assert x.keys() - {"time/learner_busy_frac"} == y.keys() - lockstep
    for key, want in x.items():
      if key.startswith("time/") or key in ENGINE_CALLS or not isinstance(want, float):
        continue
      np.testing.assert_allclose(y[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
      checked += 1
    for key in ENGINE_CALLS:  # both engines worked: more calls than one engine's, never fewer
      if key in x:
        assert y[key] >= x[key] > 0, key
  assert checked > 60
  assert all(r["opt/grad_norm"] > 0 for r in rl)


@split
def test_a_resumed_split_placement_over_two_processes_repeats_the_uninterrupted_one(split_runs):
  (one,), _ = split_runs
  _assert_resumed_repeats(Path(one["out"]).parent / "two", "run", "run_resumed")


@split
def test_sigterm_at_each_process_a_step_apart_stops_both_after_the_first(split_runs):
  _, two = split_runs
  # Process 0's signal came during RL step 1, process 1's was due as step 2 started: acting on
  # its own flag, process 1 would have gone on into step 2 while process 0 saved step 1.
  _assert_stopped_after_rl_step_1(two, [[0], []])


@trainer
def test_each_process_reads_and_scores_only_its_share(trainer_runs):
  (one,), two = trainer_runs
  whole = one["work"]
  assert whole["records"] > 0 and whole["scored"] > 0
  for key in ("records", "scored"):
    # Every batch (SFT's, RL's prompts; RL's and evaluation's completions) has an even size:
    # each process did exactly half of one process's work, and they did it all between them.
    assert [p["work"][key] for p in two] == [whole[key] // 2] * 2, key


@core
def test_shares_are_exchanged_and_a_failure_reaches_every_process(runs):
  (one,), two = runs
  assert one["shares"] == [[[0, i] for i in range(5)]] and one["failure"] is None
  for p in two:
    assert p["shares"] == [[[0, 0], [0, 1], [0, 2]], [[1, 3], [1, 4]]]
  assert two[1]["failure"] == "ZeroDivisionError: division by zero"
  assert two[0]["failure"] == (
    "RuntimeError: process 1 failed on its share of 5 items: ZeroDivisionError: division by zero"
  )


@trainer
def test_exchanges_travel_in_chunks_and_leave_only_the_last_one_behind(trainer_runs):
  (one,), two = trainer_runs
  assert one["exchange"]["got"] == [[[i, 0, 3 << 20 if i == 1 else 0, [1] if i == 1 else []]]
                                    for i in range(3)]  # fmt: skip
  for p in two:
    assert p["exchange"]["got"] == [
      [[i, j, 3 << 20 if i == 1 else 0, [j + 1] if i == 1 else []] for j in range(2)]
      for i in range(3)
    ]
    # Every exchange of the run (its SFT, RL, evaluation and these) was deleted at the next
    # one but the last, which the next exchange would delete.
    (last,) = p["exchange"]["left"]
    assert int(last) > 10
  assert two[0]["exchange"]["left"] == two[1]["exchange"]["left"]


def test_share_splits_items_as_array_split():
  for n in (0, 1, 5, 16, 17):
    for count in (1, 2, 3, 4):
      want = [list(a) for a in np.array_split(np.arange(n), count)]
      got = [list(distributed.share(n, i, count)) for i in range(count)]
      assert got == want, (n, count)
  assert distributed.share(7) == range(7)  # one process: everything
  assert distributed.allgather_objects({"a": 1}) == [{"a": 1}]
  assert distributed.gather_shares(lambda rows: list(rows), 3) == [[0, 1, 2]]


def test_launch_train_names_a_bad_multiprocess_environment(tmp_path):
  env = child_env(JAX_PLATFORMS="cpu") | {distributed.COORDINATOR_ENV: "localhost:1234"}
  env.pop(distributed.NUM_PROCESSES_ENV, None)
  out = run_child(
    [sys.executable, "-m", "launch.train", "--config=configs/grpo_arith.py:smoke",
     f"--config.workdir={tmp_path / 'run'}"],
    env=env, cwd=WORKER.parent.parent,
  )  # fmt: skip
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1] == (
    "error in environment: JAXRL_NUM_PROCESSES='' must be the number of processes"
  )
  assert not (tmp_path / "run").exists()


def test_initialize_names_what_is_wrong(monkeypatch):
  assert distributed.initialize() is False  # one process: nothing to join
  with pytest.raises(ValueError, match="num_processes=2 needs a coordinator"):
    distributed.initialize("", 2)
  with pytest.raises(ValueError, match="must be 'host:port'"):
    distributed.initialize("localhost", 2, 0)
  with pytest.raises(ValueError, match="num_processes=1 must be an integer >= 2"):
    distributed.initialize("localhost:1234", 1, 0)
  with pytest.raises(ValueError, match=r"process_id=2 must be in 0\.\.1"):
    distributed.initialize("localhost:1234", 2, 2)
  monkeypatch.setenv(distributed.PROCESS_ID_ENV, "x")
  with pytest.raises(ValueError, match="JAXRL_PROCESS_ID='x' is not a process index"):
    distributed.initialize("localhost:1234", 2)
