"""Attention and matmul kernels, each beside its pure-jnp reference and a backend dispatch."""

from jaxrl.kernels.paged_attention import PagedKV, paged_attention, write_kv

__all__ = ["PagedKV", "paged_attention", "write_kv"]
