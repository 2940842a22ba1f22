"""Shared test fixtures: jitted forwards, tiny random models, greedy and cached decoding, counts
of what an HF load reads."""

import contextlib
import functools
import json
import math
import os
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from xla_env import xla_flags

from jaxrl.models import ModelConfig, Transformer
from jaxrl.models.transformer import apply as _apply
from jaxrl.models.transformer import init_cache, make_model, positions_from_mask
from jaxrl.models.transformer import token_logprobs as _token_logprobs

# Jitted with the graphdef static: an eager forward dispatches op by op and is slow on CPU.
# `temperature` stays traced.
apply = jax.jit(_apply, static_argnums=0)
token_logprobs = jax.jit(_token_logprobs, static_argnums=0)


def graphdef_of(cfg: ModelConfig) -> nnx.GraphDef:
  """The graphdef `make_model(cfg)` builds, without drawing any weights."""
  return nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def numpy_model(cfg: ModelConfig, seed: int = 0, *, zero_lora_b: bool = True):
  """(graphdef, params) of `cfg` with weights drawn in numpy (jax.random init compiles a kernel
  per leaf shape, seconds of CPU). Larger than at init, so outputs are far from uniform; norm
  scales (zero-centred ones around 0) are perturbed, so a misplaced one shows. LoRA B is zero
  (a fresh adapter) unless zero_lora_b=False."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)
  centre = 0.0 if cfg.zero_centered_norms else 1.0

  def draw(path, leaf):
    z = rng.normal(size=leaf.shape)  # drawn for every leaf, so zeroing B moves no other draw
    key = jax.tree_util.keystr(path)
    if zero_lora_b and "['b']" in key:
      return jnp.zeros(leaf.shape, leaf.dtype)
    return jnp.asarray(centre + 0.1 * z if "'scale'" in key else 0.15 * z, leaf.dtype)

  return graphdef, jax.tree_util.tree_map_with_path(draw, abstract)


@functools.cache
def tiny_model(seed: int = 0):
  """(cfg, graphdef, params): `ModelConfig.tiny()` with `numpy_model` weights."""
  cfg = ModelConfig.tiny()
  return (cfg, *numpy_model(cfg, seed))


def perturbed_model(cfg: ModelConfig, seed: int = 0, *, from_init: bool = False):
  """(graphdef, params) with no leaf at a value that could hide a wiring error: `numpy_model`'s
  weights with the LoRA B factors drawn too (not zero), so a misplaced adapter shows as well as a
  misplaced norm; no init program is compiled (a jax.random init compiles a kernel per leaf
  shape, seconds per config). from_init=True: `make_model`'s init with every leaf moved by
  0.1 x N(0, 1), for a check whose tolerance is stated at init's scale."""
  if not from_init:
    return numpy_model(cfg, seed, zero_lora_b=False)
  graphdef, params = make_model(cfg, seed=seed)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
  return graphdef, jax.tree.unflatten(treedef, leaves)


def decode_through_cache(graphdef, params, cfg: ModelConfig, tokens, valid, p: int):
  """Prefill the first p columns of tokens [B, T] into a contiguous cache, then feed the rest one
  at a time: logits [B, T, V], as the full forward would give them."""
  b, t = tokens.shape
  pos = positions_from_mask(valid)
  cache = init_cache(cfg, b, t)
  kv_valid = jnp.concatenate([valid[:, :p], jnp.zeros((b, t - p), bool)], axis=1)
  logits, cache = apply(
    graphdef, params, tokens[:, :p], pos[:, :p], kv_valid, cache=cache, cache_index=0
  )
  steps = [logits]
  for i in range(p, t):
    kv_valid = kv_valid.at[:, i].set(valid[:, i])
    logits, cache = apply(
      graphdef,
      params,
      tokens[:, i : i + 1],
      pos[:, i : i + 1],
      kv_valid,
      cache=cache,
      cache_index=i,
    )
    steps.append(logits)
  return jnp.concatenate(steps, axis=1)


@functools.partial(jax.jit, static_argnums=0)
def greedy_rows(graphdef, params, tokens, lengths, n):
  """n argmax steps, each a full forward over the whole [B, S] row (no cache); the filler
  columns are in the causal future of every position read. Returns (tokens, min top-2 gap [B])."""
  b, s = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(s), (b, s))

  def step(i, carry):
    tokens, gap = carry
    length = lengths + i
    logits, _ = _apply(graphdef, params, tokens, positions, jnp.arange(s)[None] < length[:, None])
    last = jnp.take_along_axis(logits, (length - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    top2 = jax.lax.top_k(last, 2)[0]
    tokens = tokens.at[jnp.arange(b), length].set(jnp.argmax(last, axis=-1).astype(tokens.dtype))
    return tokens, jnp.minimum(gap, top2[:, 0] - top2[:, 1])

  return jax.lax.fori_loop(0, n, step, (tokens, jnp.full((b,), jnp.inf)))


def right_padded(seqs, width: int) -> tuple[np.ndarray, np.ndarray]:
  """Sequences laid out in [B, width] rows from column 0: (tokens int32, valid bool)."""
  tokens = np.zeros((len(seqs), width), np.int32)
  for b, seq in enumerate(seqs):
    tokens[b, : len(seq)] = seq
  return tokens, np.arange(width)[None] < np.array([len(s) for s in seqs])[:, None]


def greedy_completions(graphdef, params, prompts, n: int, width: int):
  """Argmax decoding of each unpadded prompt by repeated full forwards over [B, width] rows:
  (completions [B, n], the smallest top-1 vs top-2 logit gap met, so callers can refuse a
  near tie)."""
  if max(len(p) for p in prompts) + n > width:
    raise ValueError(f"prompt + {n} tokens exceed the row width {width}")
  tokens, _ = right_padded(prompts, width)
  lengths = np.array([len(p) for p in prompts], np.int32)
  out, gap = greedy_rows(graphdef, params, tokens, lengths, np.int32(n))
  out = np.asarray(out)
  completions = np.stack([out[b, k : k + n] for b, k in enumerate(lengths)])
  return completions, float(np.min(gap))


def rl_metric_lines(workdir) -> list[dict]:
  """The RL phase's rows of a run's metrics.jsonl, timings left out (they differ run to run)."""
  out = []
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    if r["phase"] == "rl":
      out.append({k: v for k, v in r.items() if not k.startswith("time/")})
  return out


def hf_config_dict(**kw) -> dict:
  """A small Llama-layout HF config.json (as a dict), `kw` overriding fields."""
  d = dict(
    model_type="llama",
    vocab_size=131,
    hidden_size=48,
    intermediate_size=82,
    num_hidden_layers=2,
    num_attention_heads=6,
  )
  return {**d, **kw}


@contextlib.contextmanager
def counting_hf_reads():
  """Inside: jaxrl.models.hf.read_block counted. Yields a list that gets, per call, (elements it
  read from the file, elements of the block it returned)."""
  from jaxrl.models import hf

  calls, read = [], hf.read_block

  class Counting:
    def __init__(self, lazy):
      self.lazy, self.elements = lazy, 0

    def __getitem__(self, key):
      x = self.lazy[key]
      self.elements += x.size
      return x

  def counted(kind, lazy, slot, index):
    wrapped = Counting(lazy)
    out = read(kind, wrapped, slot, index)
    calls.append((wrapped.elements, out.size))
    return out

  hf.read_block = counted
  try:
    yield calls
  finally:
    hf.read_block = read


def distinct_block_elements(x, *, addressable: bool = False) -> int:
  """Elements of the distinct blocks the devices of global array `x` hold (this process's
  devices only with `addressable`): a block replicated on several devices counts once."""
  index = (x.sharding.addressable_devices_indices_map if addressable
           else x.sharding.devices_indices_map)(x.shape)  # fmt: skip
  seen = {}
  for idx in index.values():
    key = tuple(s.indices(n)[:2] for s, n in zip(idx, x.shape, strict=True))
    seen[key] = math.prod(b - a for a, b in key)
  return sum(seen.values())


def gsm8k_rows(n: int, prefix: str = "q") -> list[dict]:
  """`n` GSM8K-style records: {"question": "q 0?", "answer": "work\\n#### 0"}, ..."""
  return [{"question": f"{prefix} {i}?", "answer": f"work\n#### {i}"} for i in range(n)]


def as_processes(monkeypatch, count: int) -> None:
  """Every `jaxrl.distributed.gather_shares` runs `count` processes' shares here, in process
  order, as it does across real processes (tests/multihost_test.py runs two)."""
  from jaxrl import distributed

  shares = lambda fn, n: [fn(distributed.share(n, p, count)) for p in range(count)]  # noqa: E731
  monkeypatch.setattr(distributed, "gather_shares", shares)


def small_engine(cfg: ModelConfig, graphdef=None, *, kv_dtype="auto", mesh=None):
  """The kernel tests' rollout engine: 4 slots, 32 pages of 4 positions, prompts up to 12."""
  from jaxrl.rollout.engine import Engine  # here: most tests using these helpers need no engine

  return Engine(
    cfg, graphdef_of(cfg) if graphdef is None else graphdef, max_concurrent_decodes=4,
    num_pages=32, page_size=4, max_prefill_length=12, max_target_length=32, kv_dtype=kv_dtype,
    mesh=mesh,
  )  # fmt: skip


# A bound on a child process's wall time: generous (many times what the slowest child takes
# alone on a busy 2-core machine), so that it only ever ends a hang, never a slow run.
CHILD_TIMEOUT_S = 1800


def child_env(**extra) -> dict:
  """This process's environment for a child process (tests/conftest.py has put the suite's
  compilation cache in it), plus `extra`, with Python's faulthandler on: a child aborted at its
  bound prints every thread's stack. The child sees one CPU device, as a user's command does
  (XLA_FLAGS in `extra` chooses otherwise), and compiles as the session does."""
  return {**os.environ, "PYTHONFAULTHANDLER": "1", "XLA_FLAGS": xla_flags(None), **extra}


def wait_children(procs, timeout: float = CHILD_TIMEOUT_S) -> list[str]:
  """Wait for child processes started with stdout=PIPE (stderr=STDOUT, text=True): their output,
  in order. At `timeout` seconds (one deadline for all) each child still running is sent SIGABRT
  (with `child_env`, its faulthandler prints where every thread was), and the test fails with
  the tail of every child's output."""
  deadline = time.monotonic() + timeout
  logs = []
  try:
    for p in procs:
      try:
        logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0])
      except subprocess.TimeoutExpired:
        for q in procs:
          if q.poll() is None:
            q.send_signal(signal.SIGABRT)
        tails = []
        for i, q in enumerate(procs):
          try:
            out = q.communicate(timeout=30)[0]
          except subprocess.TimeoutExpired:
            q.kill()
            out = q.communicate()[0]
          tails.append(f"--- child {i} ({' '.join(map(str, q.args))[:200]}):\n{out[-6000:]}")
        raise AssertionError(
          f"child processes still running after {timeout:.0f}s (the bound against a hang); "
          "each was sent SIGABRT, their stacks and output follow:\n" + "\n".join(tails)
        ) from None
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return logs


def run_child(
  cmd, *, timeout: float = CHILD_TIMEOUT_S, env=None, **kw
) -> subprocess.CompletedProcess:
  """`subprocess.run(cmd, capture_output=True, text=True)` under `wait_children`'s bound and
  report: the completed process (stdout and stderr apart)."""
  p = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    env=child_env() if env is None else env, **kw,
  )  # fmt: skip
  try:
    out, err = p.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    p.send_signal(signal.SIGABRT)
    try:
      out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
      p.kill()
      out, err = p.communicate()
    raise AssertionError(
      f"{' '.join(map(str, cmd))[:300]} still running after {timeout:.0f}s (the bound against a "
      f"hang); sent SIGABRT, its stack and output follow:\n{out[-3000:]}\n{err[-6000:]}"
    ) from None
  return subprocess.CompletedProcess(cmd, p.returncode, out, err)
