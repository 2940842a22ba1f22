"""Attention and matmul kernels, each beside its pure-jnp reference and a backend dispatch."""

from jaxrl.kernels.attention import dot_attention
from jaxrl.kernels.grouped_matmul import grouped_matmul
from jaxrl.kernels.paged_attention import PagedKV, paged_attention, write_kv
from jaxrl.kernels.quant_matmul import quant_matmul

__all__ = [
  "PagedKV",
  "dot_attention",
  "grouped_matmul",
  "paged_attention",
  "quant_matmul",
  "write_kv",
]
