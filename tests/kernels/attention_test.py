"""The one GQA attention function: both key layouts agree exactly and match a numpy softmax."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels.attention import dot_attention

B, T, S, N, K, H = 3, 5, 11, 6, 2, 14


def _case(seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k = rng.normal(size=(B, S, K, H)).astype(np.float32)
  v = rng.normal(size=(B, S, K, H)).astype(np.float32)
  mask = rng.random((B, T, S)) < 0.7
  mask[:, :, 0] = True  # every query sees at least one key
  return q, k, v, mask


def _numpy_reference(q, k, v, mask, scale, cap):
  g = N // K
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # HF repeat_kv: head n -> n // g
  s = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), k) * scale
  if cap is not None:
    s = cap * np.tanh(s / cap)
  s = np.where(mask[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", p, v)


@pytest.mark.parametrize("scale, cap", [(None, None), (20.0**-0.5, 2.0)])
def test_both_kv_layouts_agree_bit_for_bit_and_match_numpy(scale, cap):
  q, k, v, mask = _case()
  dense = dot_attention(*map(jnp.asarray, (q, k, v, mask)), scale=scale, logit_cap=cap)
  head_major = dot_attention(
    jnp.asarray(q),
    jnp.asarray(k.transpose(2, 0, 1, 3)),  # [K, B, S, H], the paged gather's layout
    jnp.asarray(v.transpose(2, 0, 1, 3)),
    jnp.asarray(mask),
    scale=scale,
    logit_cap=cap,
    kv_layout="KBSH",
  )
  np.testing.assert_array_equal(np.asarray(head_major), np.asarray(dense))
  ref = _numpy_reference(q, k, v, mask, H**-0.5 if scale is None else scale, cap)
  np.testing.assert_allclose(np.asarray(dense), ref, atol=1e-5, rtol=0)


def test_bad_kv_layout_names_the_allowed_ones():
  q, k, v, mask = map(jnp.asarray, _case())
  with pytest.raises(ValueError, match="kv_layout='SBKH'.*BSKH"):
    dot_attention(q, k, v, mask, kv_layout="SBKH")
