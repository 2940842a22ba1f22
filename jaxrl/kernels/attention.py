"""Grouped-query dot attention: the one jnp implementation the dense and the paged paths call.

The dense forward (`jaxrl.models.layers.Attention`, keys [B, S, K, H] from the activations or a
contiguous cache) and the paged reference (`jaxrl.kernels.paged_attention`, keys gathered from a
kv-head-major page pool as [K, B, S, H]) differ only in where the kv-head axis sits. Each layout
contracts the keys in the order they are stored, so neither transposes its keys; the maths
(scale, soft-cap, mask, float32 softmax) is written once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = float(jnp.finfo(jnp.float32).min)
KV_LAYOUTS = ("BSKH", "KBSH")

# (scores einsum, output einsum) per key layout; the grouped queries are [B, T, K, G, H] for
# "BSKH" and [K, B, T, G, H] for "KBSH".
_EQS = {
  "BSKH": ("BTKGH,BSKH->BKGTS", "BKGTS,BSKH->BTKGH"),
  "KBSH": ("KBTGH,KBSH->KBTGS", "KBTGS,KBSH->KBTGH"),
}


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """cap * tanh(x / cap) (Gemma's logit soft-capping); x unchanged when cap is None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def dot_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  *,
  scale: float | None = None,
  logit_cap: float | None = None,
  kv_layout: str = "BSKH",
) -> jax.Array:
  """Grouped-query attention. q: [B, T, N, H]; mask: [B, T, S]; k, v: [B, S, K, H] (the default
  `kv_layout`) or [K, B, S, H] ("KBSH", head-major) -> [B, T, N, H].

  Query head n uses kv head n // (N / K), as in HF `repeat_kv`. Scores are scaled by `scale`
  (default H**-0.5), then soft-capped at `logit_cap` if given, then masked. Softmax in float32;
  only the (small) queries and outputs are reshaped or transposed, never the keys.
  """
  if kv_layout not in _EQS:
    raise ValueError(f"dot_attention kv_layout={kv_layout!r}; allowed: {KV_LAYOUTS}")
  scores_eq, out_eq = _EQS[kv_layout]
  b, t, n, h = q.shape
  kh = k.shape[kv_layout.index("K")]
  q = q.reshape(b, t, kh, n // kh, h)
  if kv_layout == "KBSH":
    q = jnp.moveaxis(q, 2, 0)  # [K, B, T, G, H]
    mask = mask[None, :, :, None]  # against scores [K, B, T, G, S]
  else:
    mask = mask[:, None, None]  # against scores [B, K, G, T, S]
  logits = jnp.einsum(scores_eq, q, k, preferred_element_type=jnp.float32)
  logits = logits * (h**-0.5 if scale is None else scale)
  logits = softcap(logits, logit_cap)
  logits = jnp.where(mask, logits, _NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum(out_eq, probs, v)
  if kv_layout == "KBSH":
    out = jnp.moveaxis(out, 0, 2)  # [B, T, K, G, H]
  return out.reshape(b, t, n, h)
