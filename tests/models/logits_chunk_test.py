"""Log-probs by chunks of tokens (`model.logits_chunk`) against the whole batch's logits: values,
entropy, gradients, MoE routing, and the bytes the compiled backward pass keeps."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import graphdef_of, numpy_model

from jaxrl.config import ConfigError, validate
from jaxrl.models import ModelConfig
from jaxrl.models.transformer import token_logprobs, token_logprobs_and_routing
from jaxrl.rl import components
from jaxrl.tokenizer import ByteTokenizer

pytestmark = pytest.mark.integration

TEMPERATURE = 0.7


def _rows(cfg: ModelConfig, b: int = 3, t: int = 11, seed: int = 0):
  """tokens, valid [B, T] with left padding; B x (T-1) = 30 predicted tokens."""
  rng = np.random.default_rng(seed)
  valid = np.ones((b, t), bool)
  valid[1, :4] = False
  valid[2, :1] = False
  tokens = np.where(valid, rng.integers(3, cfg.vocab_size, size=(b, t)), 0)
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(valid)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _logp_and_entropy(graphdef, params, tokens, valid, with_entropy=True):
  return token_logprobs(
    graphdef, params, tokens, valid, temperature=TEMPERATURE, with_entropy=with_entropy
  )


def _loss(graphdef, tokens, valid):
  """A policy-gradient-shaped scalar of params: masked log-probs plus an entropy bonus."""
  mask = valid.at[:, 0].set(False)

  def loss(params):
    logp, ent = token_logprobs(
      graphdef, params, tokens, valid, temperature=TEMPERATURE, with_entropy=True
    )
    return jnp.sum(jnp.where(mask, logp + 0.1 * ent, 0.0))

  return loss


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(graphdef, params, tokens, valid):
  return jax.value_and_grad(_loss(graphdef, tokens, valid))(params)


# 30 tokens: one per chunk, 7 (5 chunks, the last padded), 10 (3 whole chunks), 64 (one chunk).
@pytest.mark.parametrize("chunk", [1, 7, 10, 64])
def test_chunked_logprobs_and_entropy_equal_the_whole_logits(tiny_model, chunk):
  cfg, graphdef, params = tiny_model
  tokens, valid = _rows(cfg)
  want_logp, want_ent = _logp_and_entropy(graphdef, params, tokens, valid)
  chunked = graphdef_of(cfg.replace(logits_chunk=chunk))
  logp, ent = _logp_and_entropy(chunked, params, tokens, valid)
  assert logp.shape == ent.shape == tokens.shape and logp.dtype == ent.dtype == jnp.float32
  np.testing.assert_array_equal(logp[:, 0], 0.0)
  np.testing.assert_array_equal(ent[:, 0], 0.0)
  np.testing.assert_allclose(logp, want_logp, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(ent, want_ent, rtol=1e-6, atol=1e-6)
  assert float(jnp.min(want_ent[:, 1:])) > 0.1  # not a degenerate (one-hot) distribution
  if chunk == 7:  # without the entropy: log-probs alone, as unchunked
    alone = _logp_and_entropy(chunked, params, tokens, valid, False)
    np.testing.assert_allclose(alone, want_logp, rtol=1e-6, atol=1e-6)


_GRAD_MODELS = {
  "untied": ModelConfig.tiny(),
  "tied": ModelConfig.tiny().replace(tie_embeddings=True),
  "softcap": ModelConfig.tiny().replace(tie_embeddings=True, final_logit_softcap=3.0),
}


@pytest.mark.parametrize("model", list(_GRAD_MODELS))
def test_chunked_gradients_equal_the_whole_logits(model):
  cfg = _GRAD_MODELS[model]
  graphdef, params = numpy_model(cfg, seed=1)
  tokens, valid = _rows(cfg, seed=1)
  want_loss, want_grads = _loss_and_grads(graphdef, params, tokens, valid)
  loss, grads = _loss_and_grads(graphdef_of(cfg.replace(logits_chunk=7)), params, tokens, valid)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
  for (path, want), got in zip(
    jax.tree.leaves_with_path(want_grads), jax.tree.leaves(grads), strict=True
  ):
    scale = float(jnp.max(jnp.abs(want)))
    assert scale > 0, path  # every param has a gradient to compare
    # The head's matmuls over chunks sum in another order than over the whole batch: float32
    # rounding, carried back through the layers, of a few 1e-7 of each leaf's largest entry.
    np.testing.assert_allclose(
      got, want, rtol=0, atol=5e-6 * scale, err_msg=jax.tree_util.keystr(path)
    )


def test_chunked_routing_variant_equals_the_whole_logits():
  cfg = ModelConfig.tiny_moe()
  graphdef, params = numpy_model(cfg, seed=2)
  tokens, valid = _rows(cfg, seed=2)
  run = jax.jit(
    functools.partial(token_logprobs_and_routing, temperature=TEMPERATURE, with_entropy=True),
    static_argnums=0,
  )
  (want_logp, want_ent), want = run(graphdef, params, tokens, valid)
  (logp, ent), got = run(graphdef_of(cfg.replace(logits_chunk=7)), params, tokens, valid)
  np.testing.assert_allclose(logp, want_logp, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(ent, want_ent, rtol=1e-6, atol=1e-6)
  assert got["experts"].shape == (cfg.num_layers, *tokens.shape, cfg.experts_per_token)
  np.testing.assert_array_equal(got["experts"], want["experts"])
  np.testing.assert_array_equal(got["router_logits"], want["router_logits"])


def _largest_vocab_intermediate(jaxpr, vocab: int) -> int:
  """Elements of the largest value with a trailing V axis made anywhere in `jaxpr`, the bodies
  of its scans, checkpoints and other sub-programs included."""
  largest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      shape = getattr(var.aval, "shape", ())
      if shape and shape[-1] == vocab:
        largest = max(largest, int(np.prod(shape)))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      largest = max(largest, _largest_vocab_intermediate(sub, vocab))
  return largest


def test_chunked_backward_never_holds_the_batch_logits():
  # Logits dominate: V = 8192 over 16 x 32 = 512 predicted tokens on a one-layer model, so the
  # [512, V] float32 logits (16 MiB) dwarf the rest of the program's temporaries.
  cfg = ModelConfig.tiny(vocab_size=8192).replace(num_layers=1)
  graphdef, params = numpy_model(cfg)
  tokens, valid = _rows(cfg, b=16, t=33)
  logits_bytes = 16 * 32 * cfg.vocab_size * 4
  chunk = 64
  temps, largest = {}, {}
  for c in (0, chunk):
    grad = jax.grad(_loss(graphdef_of(cfg.replace(logits_chunk=c)), tokens, valid))
    temps[c] = jax.jit(grad).lower(params).compile().memory_analysis().temp_size_in_bytes
    largest[c] = _largest_vocab_intermediate(jax.make_jaxpr(grad)(params).jaxpr, cfg.vocab_size)
  # Unchunked: the logits, their log-softmax and its cotangent are whole-batch buffers.
  assert temps[0] >= 2 * logits_bytes, temps
  # Chunked: a few [64, V] buffers; not even one batch's logits fit in all the temporaries.
  assert temps[chunk] < logits_bytes and temps[chunk] < temps[0] / 4, temps
  # No traced value with a V axis, forward or backward, is bigger than one chunk's logits
  # (the head weight's gradient, [D, V], is smaller still).
  assert largest[0] >= 16 * 32 * cfg.vocab_size, largest
  assert largest[chunk] == chunk * cfg.vocab_size, largest


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_logits_chunk_must_be_a_nonnegative_int(bad):
  with pytest.raises(ValueError, match=r"model\.logits_chunk=.*int >= 0"):
    ModelConfig.tiny().replace(logits_chunk=bad)


def test_logits_chunk_reaches_the_model_config_from_the_run_config():
  with pytest.raises(ConfigError, match="logits_chunk"):
    validate({"model": {"logits_chunk": -1}})
  section = validate({"model": {"preset": "tiny", "logits_chunk": 96}}).model
  assert components.model_config(section, ByteTokenizer()).logits_chunk == 96
  default = validate({"model": {"preset": "tiny"}}).model
  assert components.model_config(default, ByteTokenizer()).logits_chunk == 0
