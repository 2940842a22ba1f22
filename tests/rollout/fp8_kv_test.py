"""The engine's fp8 KV cache (kv_dtype='fp8'): float8_e4m3fn pages, scales per layer and kv head
recalibrated at every run from its first prefill, log-probs near the float cache's, and the
learner-side gap they leave bounded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_model, token_logprobs

from jaxrl.rollout.driver import Driver, Request
from jaxrl.rollout.engine import Engine
from jaxrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.integration

S = 32


def _engine(kv_dtype):
  cfg, graphdef, _ = tiny_model()
  return Engine(
    cfg, graphdef, max_concurrent_decodes=4, num_pages=32, page_size=4, max_prefill_length=12,
    max_target_length=S, kv_dtype=kv_dtype,
  )  # fmt: skip


def _requests(temperature=1.0, n=3):
  prompts = [[1, 5, 9, 17, 30], [1, 40, 41], [1, 100, 7, 8, 9, 10, 11]] * 2
  return [
    Request(p, i, sampling=SamplingParams(temperature=temperature), max_new_tokens=16)
    for i, p in enumerate(prompts[:n])
  ]


def _learner(params, c):
  _, graphdef, _ = tiny_model()
  seq = list(c.prompt_tokens) + list(c.tokens)
  tokens = np.zeros((1, S), np.int32)
  tokens[0, : len(seq)] = seq
  logp = token_logprobs(graphdef, params, tokens, np.arange(S)[None] < len(seq))
  return np.asarray(logp)[0, len(c.prompt_tokens) : len(seq)]


def test_fp8_pages_decode_near_the_float_cache_and_recalibrate_every_run():
  cfg, _, params = tiny_model()
  eng = _engine("fp8")
  driver = Driver(eng, steps_per_call=3, eos_id=None)
  out = driver.run(params, _requests(0.0), seed=0).finished
  st = driver._state
  assert st.k_pages[0].dtype == jnp.float8_e4m3fn and st.v_pages[0].dtype == jnp.float8_e4m3fn
  k_scale = np.asarray(st.k_scale)
  assert k_scale.shape == (cfg.num_layers, cfg.num_kv_heads) and np.all(k_scale > 0)
  # Greedy decoding over the fp8 cache: the learner (float, no cache) scores the same tokens
  # within e4m3's precision (3 mantissa bits: keys and values off by up to 2**-4 relative): a
  # few hundredths on average on this deliberately peaked model; the float cache shows none.
  gaps = np.concatenate([np.abs(c.logprobs - _learner(params, c)) for c in out])
  assert np.all(np.isfinite(gaps)) and 0.001 < gaps.mean() < 0.05 and gaps.max() < 0.25
  ref = Driver(_engine("auto"), steps_per_call=3).run(params, _requests(0.0), seed=0).finished
  float_gaps = np.concatenate([np.abs(c.logprobs - _learner(params, c)) for c in ref])
  assert float_gaps.max() < 1e-4
  # New weights, new scales: the next run's first insert recalibrates them, and only that one
  # (6 sequences through 4 slots: the run inserts more than once).
  flags, take = [], eng._take_calibration
  eng._take_calibration = lambda: flags.append(bool(take())) or np.bool_(flags[-1])
  bigger = jax.tree.map(lambda x: x * 1.5, params)
  driver.run(bigger, _requests(n=6), seed=1)
  assert flags[0] and not any(flags[1:]) and len(flags) >= 2
  assert not np.allclose(np.asarray(driver._state.k_scale), k_scale)


def test_bad_kv_dtype_and_margin_are_named():
  cfg, graphdef, _ = tiny_model()
  kw = dict(max_concurrent_decodes=1, num_pages=4, max_prefill_length=4, max_target_length=16)
  with pytest.raises(ValueError, match="kv_dtype='int4'"):
    Engine(cfg, graphdef, kv_dtype="int4", **kw)
  with pytest.raises(ValueError, match="kv_margin=0.5"):
    Engine(cfg, graphdef, kv_dtype="fp8", kv_margin=0.5, **kw)
