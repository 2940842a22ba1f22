"""Attention and matmul kernels, each beside its pure-jnp reference and a backend dispatch."""

from jaxrl.kernels.attention import dot_attention
from jaxrl.kernels.paged_attention import PagedKV, paged_attention, write_kv

__all__ = ["PagedKV", "dot_attention", "paged_attention", "write_kv"]
