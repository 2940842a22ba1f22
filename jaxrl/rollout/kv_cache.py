"""Paged KV cache: the device page pool and the host-side page allocator with reference counts.

Memory is a token budget: `num_pages * page_size` key/value rows per layer shared by all slots,
not `slots * max_len`. A sequence holds a list of pages (its page-table row); a GRPO group's full
prompt pages are held by every sample of the group at once, counted by reference, and go back on
the free list when the last holder releases them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxrl.models.config import ModelConfig


class OutOfPages(RuntimeError):
  """The pool has fewer free pages than a request needs (callers queue the request instead)."""


def pages_for(num_tokens: int, page_size: int) -> int:
  """Pages that hold `num_tokens` positions."""
  return -(-num_tokens // page_size)


def init_pages(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None):
  """The device pool: (k_pages, v_pages), each a tuple of L arrays [K, P, page_size, H] of zeros
  (kv-head-major: jaxrl.kernels.paged_attention says why).

  Zeros, not garbage: masked keys still enter the score matmul, and must stay finite.
  """
  dtype = dtype or cfg.compute_dtype
  shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
  k = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
  v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
  return k, v


class PageAllocator:
  """Host-side free list of page ids with a reference count per page."""

  def __init__(self, num_pages: int):
    if not isinstance(num_pages, int) or num_pages <= 0:
      raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    self.num_pages = num_pages
    # Lowest ids first: runs are reproducible and tests can predict page ids.
    self._free = list(range(num_pages - 1, -1, -1))
    self._refs = np.zeros(num_pages, np.int32)

  @property
  def num_free(self) -> int:
    return len(self._free)

  def refcount(self, page: int) -> int:
    return int(self._refs[page])

  def alloc(self, n: int) -> list[int]:
    """Take `n` pages off the free list, each with one reference; all or nothing."""
    if n < 0:
      raise ValueError(f"cannot allocate {n} pages")
    if n > len(self._free):
      raise OutOfPages(f"need {n} KV pages, {len(self._free)} of {self.num_pages} are free")
    pages = [self._free.pop() for _ in range(n)]
    self._refs[pages] = 1
    return pages

  def share(self, pages, times: int = 1) -> None:
    """Add `times` references to live pages (more sequences now read them)."""
    for p in pages:
      if self._refs[p] <= 0:
        raise ValueError(f"page {p} is free; only live pages can be shared")
    np.add.at(self._refs, np.asarray(pages, np.int64), times)

  def release(self, pages) -> None:
    """Drop one reference per page; a page with none left goes back on the free list."""
    for p in pages:
      if self._refs[p] <= 0:
        raise ValueError(f"page {p} released more often than it was allocated or shared")
      self._refs[p] -= 1
      if self._refs[p] == 0:
        self._free.append(p)


def table_row(pages, max_pages: int) -> np.ndarray:
  """A page-table row [M] int32; unused entries point at page 0 (masked out by the lengths)."""
  if len(pages) > max_pages:
    raise ValueError(f"{len(pages)} pages exceed the page-table width of {max_pages}")
  row = np.zeros(max_pages, np.int32)
  row[: len(pages)] = pages
  return row
