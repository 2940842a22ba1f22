"""Attention and matmul kernels, each beside its pure-jnp reference and a backend dispatch.

The model chooses one per call site through its config (`ModelConfig.attention_kernel`,
`moe_kernel`, `matmul_kernel`, `kernel_interpret`; `config.model.*` in a run): `KERNELS` lists
each site's choices and `backend_problem` says why a choice cannot run on this backend.
"""

import jax

from jaxrl.kernels import grouped_matmul as _gmm
from jaxrl.kernels import paged_attention as _paged
from jaxrl.kernels import quant_matmul as _qmm
from jaxrl.kernels.attention import dot_attention
from jaxrl.kernels.grouped_matmul import grouped_matmul
from jaxrl.kernels.paged_attention import PagedKV, paged_attention, write_kv
from jaxrl.kernels.quant_matmul import quant_matmul

# Call site -> the implementations it can run ("reference": pure jnp / XLA; "auto": the
# kernel module's own pick for the backend; "pallas_*": that Pallas kernel).
KERNELS = {
  "attention_kernel": _paged.IMPLS,  # paged decode/prefill attention of the rollout engine
  "moe_kernel": _gmm.IMPLS,  # MoE experts' grouped matmul (reference: jax.lax.ragged_dot)
  "matmul_kernel": _qmm.IMPLS,  # W8A8 projections of a quantized sampler (rl.rollout.quantize)
}

_BACKENDS = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}


def backend_problem(impl: str, interpret: bool, backend: str | None = None) -> str | None:
  """None if kernel `impl` can run on `backend` (default: JAX's), else what can: a Pallas
  kernel compiles only for its own accelerator unless it runs through the Pallas interpreter."""
  want = _BACKENDS.get(impl)
  have = backend or jax.default_backend()
  if want is None or interpret or have == want:
    return None
  return (
    f"'reference' or 'auto' on this {have!r} backend ({impl!r} compiles for a {want.upper()} "
    "only), or any kernel with kernel_interpret=True (the Pallas interpreter: slow, for tests)"
  )


__all__ = [
  "KERNELS",
  "PagedKV",
  "backend_problem",
  "dot_attention",
  "grouped_matmul",
  "paged_attention",
  "quant_matmul",
  "write_kv",
]
