"""Paged attention tests: the paged path against plain dot attention over the gathered keys."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl.kernels.paged_attention import PagedKV, _gpu_blocks, paged_attention, write_kv
from jaxrl.models.layers import dot_attention

P, PS, K, N, H, M = 23, 4, 2, 6, 14, 5  # pages, page size, kv heads, q heads, head dim, table width


def _case(seed, b=3, t=1):
  rng = np.random.default_rng(seed)
  k_pages = rng.normal(size=(K, P, PS, H)).astype(np.float32)  # kv-head-major pool
  v_pages = rng.normal(size=(K, P, PS, H)).astype(np.float32)
  # Each row gets distinct random pages; ragged lengths, one row a single key.
  table = np.stack([rng.permutation(P)[:M] for _ in range(b)]).astype(np.int32)
  lengths = np.array([1, 11, M * PS][:b], np.int32)
  q = rng.normal(size=(b, t, N, H)).astype(np.float32)
  # The last t positions of each row are the queries (decode: t = 1, the newest key).
  q_pos = np.maximum(lengths[:, None] - t + np.arange(t)[None], 0).astype(np.int32)
  return q, k_pages, v_pages, table, lengths, q_pos


def _fp8_pages(pages, spread: float):
  """float8_e4m3fn pages and a float32 scale per kv head ([K]) that fits each head's values
  (the heads' ranges made to differ by `spread`): x ~= stored * scale, nothing saturated."""
  pages = pages * np.array([1.0, spread], np.float32)[:, None, None, None]
  scale = np.abs(pages).max(axis=(1, 2, 3)) / 400.0
  stored = (pages / scale[:, None, None, None]).astype(ml_dtypes.float8_e4m3fn)
  assert np.all(np.isfinite(stored.astype(np.float32)))
  return stored, scale.astype(np.float32)


def _gathered(k_pages, table):
  b = table.shape[0]
  # [B, S, K, H] in position order: row b's block m is page table[b, m] of every head.
  return np.stack([k_pages[:, table[i]].reshape(K, M * PS, H) for i in range(b)]).transpose(
    0, 2, 1, 3
  )


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("soft_cap", [None, 2.5])
def test_paged_equals_dot_attention_on_gathered_keys(t, window, soft_cap):
  q, kp, vp, table, lengths, q_pos = _case(0, t=t)
  cache = PagedKV(jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), jnp.asarray(lengths))
  out = paged_attention(jnp.asarray(q), cache, jnp.asarray(q_pos), window=window, soft_cap=soft_cap)
  s = np.arange(M * PS)[None, None, :]
  mask = (s < lengths[:, None, None]) & (s <= q_pos[:, :, None])
  if window is not None:
    mask &= s > q_pos[:, :, None] - window
  ref = dot_attention(
    jnp.asarray(q),
    jnp.asarray(_gathered(kp, table)),
    jnp.asarray(_gathered(vp, table)),
    jnp.asarray(mask),
    logit_cap=soft_cap,
  )
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6, rtol=0)


def test_paged_matches_numpy_softmax_reference():
  q, kp, vp, table, lengths, q_pos = _case(1)
  cache = PagedKV(jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), jnp.asarray(lengths))
  out = np.asarray(paged_attention(jnp.asarray(q), cache, jnp.asarray(q_pos)))
  k, v = _gathered(kp, table).astype(np.float64), _gathered(vp, table).astype(np.float64)
  for b in range(q.shape[0]):
    n_keys = lengths[b]
    for n in range(N):
      kv = n // (N // K)  # GQA: query head n reads kv head n // (N / K)
      scores = k[b, :n_keys, kv] @ q[b, 0, n] / np.sqrt(H)
      p = np.exp(scores - scores.max())
      np.testing.assert_allclose(out[b, 0, n], (p / p.sum()) @ v[b, :n_keys, kv], atol=1e-5)


def test_write_kv_scatters_to_pages_and_drops_padding():
  rng = np.random.default_rng(2)
  table = np.array([[3, 7, 1, 0, 0], [9, 4, 0, 0, 0]], np.int32)
  zeros = jnp.zeros((K, P, PS, H))
  k = rng.normal(size=(2, 6, K, H)).astype(np.float32)
  pos = np.array([[2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5]], np.int32)
  lengths = np.array([7, 4], np.int32)  # row 0 drops position 7, row 1 positions 4 and 5
  cache = write_kv(PagedKV(zeros, zeros, jnp.asarray(table), jnp.asarray(lengths)), k, 2 * k, pos)
  kp = np.asarray(cache.k_pages)
  expect = np.zeros((K, P, PS, H), np.float32)
  for b in range(2):
    for t in range(6):
      p = pos[b, t]
      if p < lengths[b]:
        expect[:, table[b, p // PS], p % PS] = k[b, t]
  np.testing.assert_array_equal(kp, expect)
  np.testing.assert_array_equal(np.asarray(cache.v_pages), 2 * expect)


def test_bad_impl_and_window_are_named():
  q, kp, vp, table, lengths, q_pos = _case(3)
  cache = PagedKV(*map(jnp.asarray, (kp, vp, table, lengths)))
  with pytest.raises(ValueError, match="impl"):
    paged_attention(jnp.asarray(q), cache, jnp.asarray(q_pos), impl="pallas_v9")
  with pytest.raises(ValueError, match="window"):
    paged_attention(jnp.asarray(q), cache, jnp.asarray(q_pos), window=0)


def test_jitted_equals_eager():
  q, kp, vp, table, lengths, q_pos = _case(4)
  cache = PagedKV(*map(jnp.asarray, (kp, vp, table, lengths)))
  f = jax.jit(lambda c, x: paged_attention(x, c, jnp.asarray(q_pos)))
  np.testing.assert_allclose(
    np.asarray(f(cache, jnp.asarray(q))),
    np.asarray(paged_attention(jnp.asarray(q), cache, jnp.asarray(q_pos))),
    atol=1e-6,
  )


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("window, soft_cap", [(None, None), (3, 2.5)])
def test_pallas_kernel_reads_pages_in_place_like_the_reference(t, window, soft_cap):
  # The Mosaic TPU kernel through the Pallas interpreter: flash-decoding over the page table.
  q, kp, vp, table, lengths, q_pos = _case(3, t=t)
  cache = PagedKV(jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), jnp.asarray(lengths))
  args = (jnp.asarray(q), cache, jnp.asarray(q_pos))
  kw = dict(window=window, soft_cap=soft_cap)
  want = np.asarray(paged_attention(*args, impl="reference", **kw))
  got = np.asarray(paged_attention(*args, impl="pallas_tpu", interpret=True, **kw))
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
  # Pages at or past a row's length are never read: poisoning them changes nothing.
  poisoned = kp.copy()
  for row, n in enumerate(lengths):
    for blk in range(-(-int(n) // PS), M):
      poisoned[:, table[row, blk]] = np.nan
  used = {int(table[row, blk]) for row, n in enumerate(lengths) for blk in range(-(-int(n) // PS))}
  poisoned[:, sorted(used)] = kp[:, sorted(used)]  # a page shared with a live block stays
  cache = cache._replace(k_pages=jnp.asarray(poisoned))
  again = np.asarray(
    paged_attention(
      jnp.asarray(q), cache, jnp.asarray(q_pos), impl="pallas_tpu", interpret=True, **kw
    )
  )
  np.testing.assert_array_equal(again, got)


@pytest.mark.parametrize("soft_cap", [None, 2.5])
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_kernel_decodes_like_the_reference(soft_cap, fp8):
  # JAX's Triton paged-attention kernel (impl="pallas_gpu") through the Pallas interpreter, on
  # a decode step: GQA, ragged lengths (one row a single key, one all M pages), q pre-scaled.
  q, kp, vp, table, lengths, q_pos = _case(5, t=1)
  k_scale = v_scale = None
  if fp8:
    kp, k_scale = _fp8_pages(kp, 2.0)
    vp, v_scale = _fp8_pages(vp, 0.5)
    k_scale, v_scale = jnp.asarray(k_scale), jnp.asarray(v_scale)
  cache = PagedKV(*map(jnp.asarray, (kp, vp, table, lengths)), k_scale, v_scale)
  args = (jnp.asarray(q), cache, jnp.asarray(q_pos))
  want = np.asarray(paged_attention(*args, impl="reference", soft_cap=soft_cap, scale=0.3))
  got = np.asarray(
    paged_attention(*args, impl="pallas_gpu", interpret=True, soft_cap=soft_cap, scale=0.3)
  )
  assert np.all(np.isfinite(want))
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
  # An idle slot (length 0) gives zeros, not NaN.
  idle = cache._replace(lengths=jnp.asarray(np.array([0, 11, 20], np.int32)))
  out = np.asarray(paged_attention(args[0], idle, args[2], impl="pallas_gpu", interpret=True))
  assert np.all(np.isfinite(out)) and np.all(out[0] == 0)


@pytest.mark.parametrize("t, window", [(3, None), (1, 3)])
def test_triton_impl_runs_the_reference_where_the_kernel_does_not_apply(t, window):
  # The Triton kernel decodes one position per row over every key before it: a prefill chunk
  # (T > 1) or a sliding-window layer runs the reference.
  q, kp, vp, table, lengths, q_pos = _case(6, t=t)
  cache = PagedKV(*map(jnp.asarray, (kp, vp, table, lengths)))
  args = (jnp.asarray(q), cache, jnp.asarray(q_pos))
  want = np.asarray(paged_attention(*args, impl="reference", window=window))
  got = np.asarray(paged_attention(*args, impl="pallas_gpu", interpret=True, window=window))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", ["reference", "pallas_tpu"])
def test_fp8_pages_attend_as_their_dequantized_values(impl):
  # Pages of float8_e4m3fn with a scale per kv head: attention equals float attention over the
  # dequantized pages (scale * stored value); the scales fold into q and the output.
  q, kp, vp, table, lengths, q_pos = _case(4, t=2)
  kq, k_scale = _fp8_pages(kp, 2.0)
  vq, v_scale = _fp8_pages(vp, 0.5)
  deq = lambda x, s: x.astype(np.float32) * s[:, None, None, None]  # noqa: E731
  args = (jnp.asarray(table), jnp.asarray(lengths))
  fp8 = PagedKV(jnp.asarray(kq), jnp.asarray(vq), *args, jnp.asarray(k_scale), jnp.asarray(v_scale))
  flt = PagedKV(jnp.asarray(deq(kq, k_scale)), jnp.asarray(deq(vq, v_scale)), *args)
  kw = dict(impl=impl, interpret=impl == "pallas_tpu", soft_cap=2.5)
  got = paged_attention(jnp.asarray(q), fp8, jnp.asarray(q_pos), **kw)
  want = paged_attention(jnp.asarray(q), flt, jnp.asarray(q_pos), **kw)
  assert np.all(np.isfinite(np.asarray(want)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "pallas_tpu"])
def test_fp8_page_scales_fold_into_a_bfloat16_query_and_output_with_one_rounding(impl):
  # Every value page holds the same code c, so any softmax gives c and the output must be
  # c * v_scale rounded once to bfloat16. The scales (values / 448 of odd heads' ranges) are
  # not bfloat16 numbers: rounding the scale first, then the product, misses by up to 2**-8.
  q, kp, _, table, lengths, q_pos = _case(5)
  kq, k_scale = _fp8_pages(kp, 3.0)
  v_scale = np.array([0.7 / 448, 1.3 / 448], np.float32)
  vq = np.full(kq.shape, 3.0, ml_dtypes.float8_e4m3fn)
  cache = PagedKV(
    jnp.asarray(kq), jnp.asarray(vq), jnp.asarray(table), jnp.asarray(lengths),
    jnp.asarray(k_scale), jnp.asarray(v_scale),
  )  # fmt: skip
  got = paged_attention(
    jnp.asarray(q, jnp.bfloat16),
    cache,
    jnp.asarray(q_pos),
    impl=impl,
    interpret=impl != "reference",
  )
  assert got.dtype == jnp.bfloat16
  per_q_head = np.repeat(v_scale, N // K)  # q head n reads kv head n // (N / K)
  want = (np.float32(3.0) * per_q_head).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(want[:, None], got.shape))
  twice = (np.float32(3.0) * per_q_head.astype(ml_dtypes.bfloat16).astype(np.float32)).astype(
    ml_dtypes.bfloat16
  )
  assert np.any(twice != want)  # the double rounding this guards against differs here


def test_write_kv_quantizes_fp8_pages_by_their_scales_and_saturates():
  # e4m3 keeps 3 mantissa bits: x / scale rounds within 2**-4 relative (normal range); a value
  # past 448 * scale is stored as 448, never inf or NaN.
  kp = jnp.zeros((K, P, PS, H), jnp.float8_e4m3fn)
  table = jnp.asarray(np.arange(M, dtype=np.int32)[None])
  scale = jnp.asarray([0.5, 0.25], jnp.float32)
  cache = PagedKV(kp, kp, table, jnp.asarray([3], np.int32), scale, scale)
  rng = np.random.default_rng(5)
  k = rng.normal(size=(1, 3, K, H)).astype(np.float32) * 10
  k[0, 2, 1, 0] = 1e6
  out = write_kv(cache, jnp.asarray(k), jnp.asarray(k), jnp.asarray([[0, 1, 2]], np.int32))
  stored = np.asarray(out.k_pages[:, 0, :3].astype(jnp.float32))  # [K, 3, H]
  back = np.moveaxis(stored, 0, 1)[None] * np.asarray(scale)[None, None, :, None]
  assert np.all(np.isfinite(back)) and back[0, 2, 1, 0] == 448 * 0.25
  ok = np.abs(k) < 448 * np.asarray(scale)[None, None, :, None] * 0.99
  big = ok & (np.abs(k) > 2**-6 * np.asarray(scale)[None, None, :, None])  # e4m3 normals
  np.testing.assert_array_less(np.abs(back - k)[big], np.abs(k)[big] * 2**-4 + 1e-9)


@pytest.mark.parametrize(
  "pages, want", [(48, (6, 8)), (3, (3, 1)), (16, (2, 8)), (64, (8, 8)), (12, (3, 4)), (1, (1, 1))]
)
def test_triton_blocks_are_powers_of_two_and_tile_the_page_table(pages, want):
  splits, per_block = _gpu_blocks(pages)
  assert (splits, per_block) == want
  assert per_block & (per_block - 1) == 0 and splits * per_block <= pages
  assert (pages // per_block) % splits == 0 and splits <= 16
