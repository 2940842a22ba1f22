"""KV page allocator tests: free list, reference counts, all-or-nothing allocation."""

import numpy as np
import pytest

from jaxrl.models import ModelConfig
from jaxrl.rollout.kv_cache import OutOfPages, PageAllocator, init_pages, pages_for, table_row


def test_alloc_release_round_trip():
  a = PageAllocator(7)
  x = a.alloc(3)
  y = a.alloc(4)
  assert sorted(x + y) == list(range(7)) and a.num_free == 0
  assert all(a.refcount(p) == 1 for p in x + y)
  a.release(x)
  assert a.num_free == 3 and all(a.refcount(p) == 0 for p in x)
  assert sorted(a.alloc(3)) == sorted(x)  # freed pages are handed out again


def test_shared_pages_free_on_last_release():
  a = PageAllocator(5)
  shared = a.alloc(2)
  a.share(shared, 3)  # a group of 4 samples holds the prompt pages
  assert [a.refcount(p) for p in shared] == [4, 4]
  for _ in range(3):
    a.release(shared)
    assert a.num_free == 3  # still held by someone
  a.release(shared)
  assert a.num_free == 5


def test_out_of_pages_allocates_nothing():
  a = PageAllocator(4)
  a.alloc(3)
  with pytest.raises(OutOfPages, match="need 2 KV pages, 1 of 4"):
    a.alloc(2)
  assert a.num_free == 1


def test_misuse_is_caught():
  a = PageAllocator(3)
  p = a.alloc(1)
  a.release(p)
  with pytest.raises(ValueError, match="released more often"):
    a.release(p)
  with pytest.raises(ValueError, match="only live pages"):
    a.share(p)
  with pytest.raises(ValueError, match="num_pages"):
    PageAllocator(0)


def test_pages_for_and_table_row():
  assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
  np.testing.assert_array_equal(table_row([5, 2], 4), [5, 2, 0, 0])
  with pytest.raises(ValueError, match="page-table width"):
    table_row([1, 2, 3], 2)


def test_pool_is_sized_by_token_budget():
  cfg = ModelConfig.tiny()
  k, v = init_pages(cfg, num_pages=11, page_size=4)
  assert len(k) == len(v) == cfg.num_layers
  assert k[0].shape == (cfg.num_kv_heads, 11, 4, cfg.head_dim)  # kv-head-major
  assert not np.any(np.asarray(k[0]))
