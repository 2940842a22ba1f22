"""Code rewards: the completion runs with the record's tests in the sandbox; pass/fail and
partial credit by hand, the batch path equal to the one-at-a-time path, a forged report line
and hostile completions score 0, and only a sandbox that cannot start is an error."""

import numpy as np
import pytest

from jaxrl import rewards
from jaxrl.config import ConfigError, SandboxConfig
from jaxrl.rewards import code, sandbox
from jaxrl.rewards.code import CodeTestsReward
from jaxrl.rl import components

RECORD = {
  "prompt": "f(0)=2,f(1)=5,f(2)=8\ndef f(x):return ",
  "code_prefix": "def f(x):return ",
  "tests": ["f(3)==11", "f(5)==17", "f(-2)==-4", "f(10)==32"],
}
CASES = [
  ("3*x+2", 1.0, 1.0),  # f itself
  ("2+x*3", 1.0, 1.0),  # any equal expression
  ("3*x+2 if x<5 else 0", 0.0, 0.5),  # right at 3 and -2 only
  ("{0: 2, 1: 5, 2: 8}[x]", 0.0, 0.0),  # the examples memorised: KeyError on every test
  ("3*x+", 0.0, 0.0),  # does not compile
  ("print('%s 4 4' % 'deadbeef') or 0", 0.0, 0.0),  # a report line without the real token
  ("__import__('os').system('echo hi')", 0.0, 0.0),  # a shell: refused, the tests fail
  ("[0] * 10**10", 0.0, 0.0),  # a memory hog
]


@pytest.mark.parametrize("completion, all_pass, fraction", CASES)
def test_rewards_by_hand(completion, all_pass, fraction):
  assert rewards.get("code_tests")(completion, RECORD) == all_pass
  assert rewards.get("code_tests_passed")(completion, RECORD) == fraction


def test_batch_scores_equal_one_at_a_time_and_run_concurrently():
  completions = [c for c, _, _ in CASES]
  records = [RECORD] * len(CASES)
  fn = rewards.get("code_tests_passed")
  batch, failures = rewards.compute_rewards(fn, completions, records, on_error="raise")
  assert failures == 0
  np.testing.assert_array_equal(batch, np.float32([f for _, _, f in CASES]))


def test_identical_programs_in_a_batch_run_once_and_share_their_score():
  completions = [c for c, _, _ in CASES] * 3
  order = np.random.default_rng(0).permutation(len(completions))
  completions = [completions[i] for i in order]
  other = {**RECORD, "tests": ["f(3)==11"]}  # the same completion under other tests: its own run
  records = [RECORD] * len(completions) + [other]
  completions.append(CASES[2][0])
  each, once = (
    CodeTestsReward(all_or_nothing=False).configured(sandbox.Limits(), workers=2, dedupe=d)
    for d in (False, True)
  )
  scored_each = each.score_batch(completions, records)
  scored_once = once.score_batch(completions, records)
  assert scored_once == scored_each
  by_completion = {c: f for c, _, f in CASES}
  assert [v for _, v in scored_once[:-1]] == [by_completion[c] for c in completions[:-1]]
  assert scored_once[-1] == ("ok", 1.0)  # 3*x+2 if x<5 else 0 passes f(3)==11
  assert (each.programs_run, once.programs_run) == (3 * len(CASES) + 1, len(CASES) + 1)
  each.close()
  once.close()


def test_the_sandbox_config_sets_dedupe():
  fn = rewards.get("code_tests")
  assert components.sandboxed(fn, SandboxConfig()).dedupe
  assert not components.sandboxed(fn, SandboxConfig(dedupe=False)).dedupe


def test_a_program_past_its_time_scores_zero():
  fn = CodeTestsReward(all_or_nothing=True).configured(sandbox.Limits(wall_s=1.0), workers=1)
  assert fn("(lambda: [0 for _ in iter(int, 1)])()", RECORD) == 0.0
  fn.close()


def test_a_record_without_tests_is_a_reward_error_naming_its_fields():
  bad = {"prompt": "p", "answer": "1"}
  with pytest.raises(rewards.RewardError, match=r"needs records with 'code_prefix' and 'tests'"):
    rewards.compute_rewards(rewards.get("code_tests"), ["1"], [bad], on_error="raise")
  r, failures = rewards.compute_rewards(rewards.get("code_tests"), ["1"], [bad], on_error="zero")
  assert failures == 1 and r[0] == 0.0


def test_a_sandbox_that_cannot_start_is_an_error_not_a_zero(monkeypatch):
  broken = sandbox.Outcome("setup", 87, "", "sandbox set-up failed: OSError: mount", 0.0)
  monkeypatch.setattr(
    sandbox.SandboxPool, "run_many", lambda self, programs, tests=None: [broken] * 2
  )
  fn = CodeTestsReward(all_or_nothing=True)
  with pytest.raises(rewards.RewardError, match=r"SandboxError: the sandbox could not start"):
    rewards.compute_rewards(fn, ["1", "2"], [RECORD] * 2, on_error="raise")
  r, failures = rewards.compute_rewards(fn, ["1", "2"], [RECORD] * 2, on_error="zero")
  assert failures == 2


def test_only_a_report_covering_every_test_counts():
  done = sandbox.Outcome("ok", 0, "noise\n", "", 0.0, passed=(True, False, True, True))
  assert code.tests_passed(done, 4) == (3, 4)
  assert code.tests_passed(done, 5) is None  # a report that does not cover every test
  assert code.tests_passed(sandbox.Outcome("timeout", None, "", "", 0.0), 4) is None


HARNESS_CASES = [
  # (program, test, passes): the test is evaluated outside the program, on plain data.
  ("def f(xs): return sorted(xs)", "f([3, 1, 2]) == [1, 2, 3]", True),
  ("def f(a, b=1): return (a, b)", "f(2, b=5) == (2, 5)", True),
  ("def f(k): return {k: [k, None]}", "f('a') == {'a': ['a', None]}", True),
  ("def f(x): return x / 2", "math.isclose(f(3), 1.5) and f(3) > 1", True),
  ("N = 3\ndef f(x): return x * N", "f(N) == 9 and N == 3", True),
  ("def f(x): return x", "[f(i) for i in range(3)] == [0, 1, 2]", True),
  ("def f(x): return x\ndef g(x): return f(x) + 1", "g(f(1)) == 2", True),
  # The program's own `sorted` and `abs` never stand in for the test's builtins.
  ("def sorted(x): return [1, 2, 3]\ndef f(x): return x", "sorted(f([2, 1])) == [1, 2]", True),
  ("abs = lambda x: 0\ndef f(x): return -x", "abs(f(4)) == 4", True),
  ("def f(x): return 1", "f(0)", False),  # truthy is not True
  ("def f(x): return {1, 2}", "f(0) == {1, 2}", False),  # a set is not plain data
  ("def f(x): raise ValueError(x)", "f(0) == 0", False),
  ("def f(x): return x", "g(0) == 0", False),  # a name the program does not define
  ("def f(x): return x", "f(0) ==", False),  # a test that does not parse fails, not raises
]


@pytest.mark.parametrize("source, test, passes", HARNESS_CASES)
def test_the_harness_evaluates_tests_on_plain_data_outside_the_program(source, test, passes):
  out = sandbox.run(source, sandbox.Limits(cpu_s=1, wall_s=4.0), tests=[test, "f(0) == f(0)"])
  assert out.passed is not None and out.passed[0] == passes, out


def test_the_program_sees_its_arguments_never_the_expected_values():
  spy = (
    "import gc, sys\n"
    "def f(x):\n"
    "  seen = [o for o in gc.get_objects() if isinstance(o, str) and '==' in o]\n"
    "  print('args', x, 'seen', seen, file=sys.stderr)\n"
    "  return 12345\n"
  )
  out = sandbox.run(spy, sandbox.Limits(cpu_s=1, wall_s=4.0), tests=["f(7) == 67890"])
  assert out.passed == (False,)
  assert "args 7 seen []" in out.stderr and "67890" not in out.stderr + out.stdout


def test_config_asking_for_namespaces_where_none_exist_is_refused(monkeypatch):
  monkeypatch.setattr(sandbox, "_namespace_prefix", lambda: None)
  with pytest.raises(
    ConfigError, match=r"config\.reward\.sandbox\.isolation='namespaces': sandbox isolation="
  ):
    components.sandboxed(rewards.get("code_tests"), SandboxConfig(isolation="namespaces"))
  sandbox._warn_degraded.cache_clear()
  with pytest.warns(RuntimeWarning, match=r"isolation='auto' runs on resource limits"):
    fn = components.sandboxed(rewards.get("code_tests"), SandboxConfig(isolation="auto", cpu_s=1))
  assert fn.limits.cpu_s == 1 and fn.pool().isolation == "limits" and fn.isolation == "limits"
  fn.close()
