"""Multi-turn rollouts with tools: the model writes, an environment answers, the model goes on.

    envs = [CalculatorEnv(answer=a) for a in answers]
    trajs = run_episodes(driver, params, prompts, envs, tokenizer=tok, max_turns=4,
                         max_new_tokens=32, seed=0)
    trajs[i].tokens / loss_mask / logprobs / versions: everything after the prompt, in order.

Each model turn is one engine request whose prompt is the episode so far as token ids: the
original prompt, every earlier turn's tokens exactly as the engine produced them, and each
observation's tokens. Nothing the model wrote is ever decoded and re-encoded into the context,
so the trajectory holds the very ids that were sampled, with their behaviour log-probs and the
policy version that drew each; observation tokens sit between them with `loss_mask` False (a
policy loss over the trajectory trains the model's tokens only). A turn ends at EOS, at one of
the environment's `stop_strings` (a tool call is complete) or at its token budget; the
environment's `step` then sees the turn's text and answers with an observation, a reward and
whether the episode is over.

Turns are not synchronised across episodes: `Driver.run` hands each finished turn to
`on_finished` while the device runs the next decode call, the environments step there (a batch
of them concurrently on `executor`), and a continuing episode's next turn joins the queue at once
(one `Driver.run` for the whole batch; no turn barrier). Request ids are `episode * max_turns +
turn`, so every turn's sampling is fixed by (seed, episode, turn). The environments here:
`CalculatorEnv` (GSM8K-style `<<48/2=` answered with `24>>`) and `PythonToolEnv` (code between
`<py>` and `</py>` run in the reward sandbox, its output returned between `<out>` and
`</out>`).
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Protocol

import numpy as np

from jaxrl.rollout.driver import Completion, Driver, Request
from jaxrl.rollout.sampling import SamplingParams

_DEFAULT_SAMPLING = SamplingParams()


@dataclasses.dataclass(frozen=True)
class EnvStep:
  """An environment's answer to one model turn: text to append (None: nothing), the turn's
  reward (summed over the episode) and whether the episode is over."""

  observation: str | None
  reward: float = 0.0
  done: bool = False


class Environment(Protocol):
  """One episode's environment. `stop_strings` end a model turn (a complete tool call)."""

  stop_strings: tuple[str, ...]

  def step(self, action: str, finish_reason: str) -> EnvStep: ...


@dataclasses.dataclass
class Trajectory:
  """One episode after its prompt: model turns and observations interleaved, as fed."""

  episode: int  # its episode id
  prompt_tokens: np.ndarray  # [P] int32
  tokens: np.ndarray  # [T] int32
  loss_mask: np.ndarray  # [T] bool: True on the model's own tokens
  logprobs: np.ndarray  # [T] float32 behaviour log-probs; 0 on observation tokens
  versions: np.ndarray  # [T] int32 the policy version that drew each token; -1 on observations
  turns: list[tuple[int, int]]  # [start, end) of each model turn in `tokens`
  reward: float
  finish_reason: str  # "done" (the environment ended it), "turns" (max_turns), "length"


@dataclasses.dataclass
class _Episode:
  env: Environment
  prompt: list[int]
  tokens: list = dataclasses.field(default_factory=list)
  mask: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  turns: list = dataclasses.field(default_factory=list)
  reward: float = 0.0
  finish: str | None = None


def run_episodes(
  driver: Driver,
  params,
  prompts: Sequence[Sequence[int]],
  envs: Sequence[Environment],
  *,
  tokenizer,
  max_turns: int,
  max_new_tokens: int,
  max_total_tokens: int | None = None,
  sampling: SamplingParams = _DEFAULT_SAMPLING,
  seed: int = 0,
  policy_version: int = 0,
  executor: Executor | None = None,
  episode_ids: Sequence[int] | None = None,
  group_ids: Sequence[int] | None = None,
  stop_token_ids: tuple[int, ...] = (),
  stats: dict | None = None,
) -> list[Trajectory]:
  """Run one episode per (prompt, env) to its end; see the module docstring.

  max_new_tokens: each turn's budget. max_total_tokens: the episode's budget after the prompt
  (model and observation tokens; default the engine's room after the longest prompt). An
  observation that would not leave a turn at least one token, or a context longer than the
  engine prefills, ends the episode ("length"); an observation no turn reads (the episode ends)
  is not appended, so a trajectory is exactly what the model was fed. `episode_ids` (default
  0, 1, ...; unique) name the episodes' random streams: turn t of episode k is request
  k * max_turns + t. `group_ids` (optional, one per episode): episodes of one group share
  their prompt, and their first turns are prefilled once and decoded side by side (a GRPO
  group's G episodes: one prefill per prompt, as single-turn sampling); later turns' contexts
  differ and are prefilled each. `stop_token_ids`: stop tokens besides the driver's EOS.
  `stats`, if given, receives the driver's counters and the episodes' turn and tool-call
  counts."""
  if len(prompts) != len(envs):
    raise ValueError(f"run_episodes: {len(prompts)} prompts but {len(envs)} environments")
  if max_turns < 1 or max_new_tokens < 1:
    raise ValueError(f"max_turns ({max_turns}) and max_new_tokens ({max_new_tokens}) must be >= 1")
  ids = list(range(len(prompts))) if episode_ids is None else [int(k) for k in episode_ids]
  if len(ids) != len(prompts) or len(set(ids)) != len(ids):
    raise ValueError("run_episodes: episode_ids must be unique, one per prompt")
  index = {k: e for e, k in enumerate(ids)}
  if group_ids is not None:
    if len(group_ids) != len(prompts):
      raise ValueError(f"run_episodes: {len(group_ids)} group_ids for {len(prompts)} prompts")
    first_prompt: dict[int, list[int]] = {}
    for p, g in zip(prompts, group_ids, strict=True):
      if first_prompt.setdefault(int(g), list(p)) != list(p):
        raise ValueError(f"run_episodes: the episodes of group {g} do not share their prompt")
  room = driver.engine.max_target_length
  eps = [_Episode(env, list(p)) for p, env in zip(prompts, envs, strict=True)]
  budget = max_total_tokens or room - max(len(p) for p in prompts)

  def request(e: int) -> Request | None:
    ep = eps[e]
    turn = len(ep.turns)
    left = min(budget - len(ep.tokens), room - len(ep.prompt) - len(ep.tokens))
    if turn >= max_turns:
      ep.finish = "turns"
    elif left < 1 or len(ep.prompt) + len(ep.tokens) > driver.engine.max_prefill_length:
      ep.finish = "length"
    if ep.finish is not None:
      return None
    return Request(
      ep.prompt + ep.tokens,
      ids[e] * max_turns + turn,
      group_id=None if group_ids is None or turn else int(group_ids[e]),
      sampling=sampling,
      max_new_tokens=min(max_new_tokens, left),
      stop_token_ids=tuple(stop_token_ids),
      stop_strings=tuple(ep.env.stop_strings),
    )

  def turn_done(c: Completion) -> tuple[int, str, str]:
    e = index[c.request_id // max_turns]
    ep = eps[e]
    start = len(ep.tokens)
    ep.tokens += c.tokens.tolist()
    ep.mask += [True] * len(c.tokens)
    ep.logprobs += c.logprobs.tolist()
    ep.versions += c.versions.tolist()
    ep.turns.append((start, len(ep.tokens)))
    return e, tokenizer.decode(c.tokens.tolist()), c.finish_reason

  def answer(e: int, step: EnvStep) -> Request | None:
    ep = eps[e]
    ep.reward += float(step.reward)
    if step.done:
      ep.finish = "done"
      return None
    if len(ep.turns) >= max_turns:
      ep.finish = "turns"  # no turn would read the observation: it is not appended
      return None
    obs = tokenizer.encode(step.observation) if step.observation else []
    end = len(ep.tokens) + len(obs)
    fits = end < min(budget, room - len(ep.prompt))
    if not fits or len(ep.prompt) + end > driver.engine.max_prefill_length:
      ep.finish = "length"  # no room for the observation and a token after it
      return None
    ep.tokens += obs
    ep.mask += [False] * len(obs)
    ep.logprobs += [0.0] * len(obs)
    ep.versions += [-1] * len(obs)
    return request(e)

  def on_finished(completions: list[Completion]) -> list[Request]:
    acts = [turn_done(c) for c in completions]
    calls = [lambda a=a: eps[a[0]].env.step(a[1], a[2]) for a in acts]
    steps = list(executor.map(lambda f: f(), calls)) if executor else [f() for f in calls]
    return [r for (e, _, _), s in zip(acts, steps, strict=True) if (r := answer(e, s))]

  first = [r for e in range(len(eps)) if (r := request(e))]
  result = driver.run(
    params, first, policy_version=policy_version, seed=seed, on_finished=on_finished
  )
  if stats is not None:
    stats.update({k: float(v) for k, v in result.stats.items()})
    stats["turns"] = float(sum(len(ep.turns) for ep in eps))
    stats["tool_calls"] = float(sum(getattr(ep.env, "calls", 0) for ep in eps))
  return [
    Trajectory(
      ids[e],
      np.asarray(ep.prompt, np.int32),
      np.asarray(ep.tokens, np.int32),
      np.asarray(ep.mask, bool),
      np.asarray(ep.logprobs, np.float32),
      np.asarray(ep.versions, np.int32),
      ep.turns,
      ep.reward,
      ep.finish or "length",
    )
    for e, ep in enumerate(eps)
  ]


# ----------------------------------------------------------------------------------- calculator

_OPS = {
  ast.Add: operator.add,
  ast.Sub: operator.sub,
  ast.Mult: operator.mul,
  ast.Div: operator.truediv,
  ast.FloorDiv: operator.floordiv,
  ast.Mod: operator.mod,
}
_LIMIT = 10**12
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def calculate(expr: str) -> str | None:
  """The value of an arithmetic expression (+ - * / // %, unary -, parentheses, numbers), as
  the calculator prints it; None for anything else, a division by zero or a value beyond 1e12."""
  if len(expr) > 200:
    return None
  try:
    tree = ast.parse(expr.strip(), mode="eval")
  except SyntaxError:
    return None

  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
      v = ev(node.operand)
      return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      v = _OPS[type(node.op)](ev(node.left), ev(node.right))
      if abs(v) > _LIMIT:
        raise OverflowError
      return v
    raise ValueError(type(node).__name__)

  try:
    v = ev(tree)
  except (ValueError, ZeroDivisionError, OverflowError, TypeError):
    return None
  if isinstance(v, float) and v.is_integer():
    v = int(v)
  return str(round(v, 6) if isinstance(v, float) else v)


def last_number(text: str) -> str | None:
  found = _NUMBER.findall(text)
  return found[-1] if found else None


@dataclasses.dataclass
class CalculatorEnv:
  """GSM8K's calculator annotations as a tool: a turn that ends in `<<EXPR=` is answered with
  `VALUE>>` (or `?>>` for an expression the calculator refuses); any other turn ends the
  episode with reward 1.0 if the last number the model wrote in it equals `answer`. In an RL
  run (rl.rollout.env='calculator') the task's own reward scores the whole trajectory's text."""

  answer: str | None = None  # None: the episode's last turn scores 0 (a task reward scores it)
  stop_strings: tuple[str, ...] = ("=",)
  calls: int = 0

  def step(self, action: str, finish_reason: str) -> EnvStep:
    call = re.search(r"<<([^<>=]*)=$", action)
    if call and finish_reason == "stop_string":
      self.calls += 1
      value = calculate(call.group(1))
      return EnvStep(f"{value if value is not None else '?'}>>")
    if finish_reason == "stop_string":
      return EnvStep(None)  # an "=" outside a call: go on writing
    won = self.answer is not None and last_number(action) == self.answer
    return EnvStep(None, reward=float(won), done=True)


@dataclasses.dataclass
class PythonToolEnv:
  """A Python tool: a turn that ends in `<py>CODE</py>` has CODE run in the reward sandbox
  (`jaxrl.rewards.sandbox`: limits, no network, an empty environment) and is answered with
  `<out>STDOUT</out>` (stdout, else the last line of stderr, cut at `max_output` characters).
  Any other turn ends the episode, scored by `score(text)` (default 0)."""

  limits: object = None  # jaxrl.rewards.sandbox.Limits (default limits when None)
  score: Callable[[str], float] | None = None
  max_output: int = 200
  stop_strings: tuple[str, ...] = ("</py>",)
  calls: int = 0

  def step(self, action: str, finish_reason: str) -> EnvStep:
    from jaxrl.rewards import sandbox

    call = re.search(r"<py>(.*)</py>$", action, re.S)
    if call and finish_reason == "stop_string":
      self.calls += 1
      out = sandbox.run(call.group(1), self.limits or sandbox.Limits())
      text = out.stdout or (out.stderr.strip().splitlines() or [out.status])[-1]
      return EnvStep(f"<out>{text[: self.max_output]}</out>")
    return EnvStep(None, reward=float(self.score(action)) if self.score else 0.0, done=True)
