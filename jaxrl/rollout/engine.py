"""The rollout engine: the JetStream Engine API over a paged KV cache, in continuous batching.

Prefill runs the model's own forward over a contiguous per-prompt cache (bucketed, chunked past
`prefill_chunk_size`); `insert` / `bulk_insert` copy the prompt's keys into pages of the shared
pool; `generate` is one jitted decode step over all `max_concurrent_decodes` slots through the
same forward with a `PagedKV` cache, on a donated `DecodeState`. Host bookkeeping (which pages a
slot holds) lives in the engine; everything on the device is in the explicit state pytree.

On a mesh the decode state and the prefill caches are made on it with fixed shardings (KV split
over kv heads by the rules, the per-slot vectors replicated), every jitted call returns them so
(each program compiles once however many runs reuse the engine), and its programs trace under the
engine's mesh and rules when the caller entered no `use_mesh` (activations, Pallas kernels).

Sampling keys are fold_in(fold_in(key(seed), request_id), token_index), so a request draws the
same tokens whatever slot it lands in and whatever else is in the batch.

The API's data (ResultTokens, SlotData, Prefix, PrefillBatch, DecodeState, request keys) lives
in `jaxrl.rollout.engine_types`; the prefill methods in `jaxrl.rollout.engine_prefill`; this
module is the engine: its configuration, decode state, insert, free and generate.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.kernels.paged_attention import FP8_KV_MAX, PagedKV, write_kv
from jaxrl.mesh import Rules, named_sharding, traced_on
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import init_cache, make_model
from jaxrl.rollout.engine_prefill import MIN_PREFILL_BUCKET, PrefillMixin
from jaxrl.rollout.engine_types import (  # noqa: F401  (request_key(s): the API's keys)
  MAX_STOP_TOKENS,
  DecodeState,
  PrefillBatch,
  Prefix,
  ResultTokens,
  SlotData,
  first_index_array,
  next_pow2,
  pack_result,
  per_sample,
  request_key,
  request_keys,
  step_keys,
  stop_array,
)
from jaxrl.rollout.kv_cache import OutOfPages, PageAllocator, init_pages, pages_for, table_row
from jaxrl.rollout.sampling import RowSampling, sample_rows

KV_DTYPES = ("auto", "fp8")


class Engine(PrefillMixin):
  """JetStream-style engine. Build once per (model, slot count, page budget); reuse across runs.

  Args:
    cfg, graphdef: the model (params are passed to every call: the learner's own arrays).
    max_concurrent_decodes: B, the decode batch (slots).
    num_pages, page_size: the KV budget, num_pages * page_size positions shared by all slots.
    max_prefill_length: the longest prompt accepted.
    prefill_chunk_size: longer prompts are prefilled in chunks of this many tokens (a power of
      two); default min(max_prefill_length rounded up to a power of two, 512).
    max_target_length: the longest prompt + completion of one slot (page-table width);
      default the model's max_seq_len.
    tokenizer: returned by `get_tokenizer` (the driver detokenises with it for stop strings).
    seed: default seed of request keys when `prefill` is called without `rng`.
    mesh, rules: where the params live (the learner's mesh) and its logical-axis rules, which
      place the KV pages and caches; None: the default device, as plain jnp arrays.
    capture_routes: (MoE models) return the top-k experts every layer chose for every prompt
      position (prefill) and every fed token (decode), for routing replay in the learner.
    kv_dtype: "auto" keeps the pages in the compute dtype; "fp8" stores them as float8_e4m3fn
      with a scale per layer and kv head, recalibrated at the first insert after
      `recalibrate_kv()` (the driver calls it at the start of every run, so each RL step's
      scales fit its weights) from that prefill's keys and values: amax * kv_margin / 448, so
      decode-time values up to kv_margin times the prompts' largest are kept, larger ones
      saturate (never inf or NaN). The prefill itself attends in full precision.
    prefill_batch_prompts: each `prefill_batch` padded to exactly this many prompts (the driver
      splits larger ones): one program per length bucket, not per count; None: powers of two.
  """

  def __init__(
    self,
    cfg: ModelConfig,
    graphdef: nnx.GraphDef,
    *,
    max_concurrent_decodes: int,
    num_pages: int,
    page_size: int = 16,
    max_prefill_length: int,
    prefill_chunk_size: int | None = None,
    max_target_length: int | None = None,
    tokenizer=None,
    seed: int = 0,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules | str = "fsdp_tp",
    capture_routes: bool = False,
    kv_dtype: str = "auto",
    kv_margin: float = 2.0,
    prefill_batch_prompts: int | None = None,
  ):
    if kv_dtype not in KV_DTYPES:
      raise ValueError(f"engine kv_dtype={kv_dtype!r}; allowed: {KV_DTYPES}")
    if not kv_margin >= 1.0:
      raise ValueError(f"engine kv_margin={kv_margin!r} must be >= 1")
    if capture_routes and not cfg.num_experts:
      raise ValueError("engine capture_routes=True needs an MoE model (model.num_experts > 0)")
    pbp = prefill_batch_prompts
    if pbp is not None and not (isinstance(pbp, int) and pbp > 0):
      msg = f"positive int or None, got {pbp!r}"
      raise ValueError(f"engine prefill_batch_prompts must be a {msg}")
    for name, value in (
      ("max_concurrent_decodes", max_concurrent_decodes),
      ("num_pages", num_pages),
      ("page_size", page_size),
      ("max_prefill_length", max_prefill_length),
    ):
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"engine {name} must be a positive int, got {value!r}")
    max_target_length = max_target_length or cfg.max_seq_len
    if max_target_length > cfg.max_seq_len:
      raise ValueError(
        f"engine max_target_length={max_target_length} exceeds the model's "
        f"max_seq_len={cfg.max_seq_len}"
      )
    if max_prefill_length >= max_target_length:
      raise ValueError(
        f"engine max_prefill_length={max_prefill_length} must be < "
        f"max_target_length={max_target_length} (room for at least one new token)"
      )
    if prefill_chunk_size is None:
      prefill_chunk_size = min(next_pow2(max_prefill_length), 512)
    if prefill_chunk_size < MIN_PREFILL_BUCKET or prefill_chunk_size & (prefill_chunk_size - 1):
      raise ValueError(
        f"engine prefill_chunk_size={prefill_chunk_size} must be a power of two >= "
        f"{MIN_PREFILL_BUCKET}"
      )
    self.cfg, self.graphdef = cfg, graphdef
    self.kv_dtype, self.kv_margin = kv_dtype, float(kv_margin)
    self._calibrate = kv_dtype == "fp8"  # the next insert sets the fp8 scales
    self.routes_shape = (cfg.num_layers, cfg.experts_per_token) if capture_routes else None
    self._slots = max_concurrent_decodes
    self.num_pages, self.page_size = num_pages, page_size
    self._max_prefill = max_prefill_length
    self._chunk = prefill_chunk_size
    self.prefill_batch_prompts = prefill_batch_prompts
    self.max_target_length = max_target_length
    self.max_pages_per_seq = pages_for(max_target_length, page_size)
    self._tokenizer = tokenizer
    self.seed = seed
    self._mesh = mesh
    self.allocator = PageAllocator(num_pages)
    self.slot_pages: dict[int, list[int]] = {}
    self._released: set[int] = set()  # freed slots still active on the device
    self.stats = collections.Counter()
    self.kv_sharding, self.state_shardings = self._shardings(rules)
    # Every output pinned to the sharding its input has (the prefill's cache to the one the
    # insert reads): left to GSPMD, a state made elsewhere comes back differently sharded and the
    # next call recompiles. Off the mesh nothing is pinned, as before.
    kv, st = self.kv_sharding, self.state_shardings
    rep = None if mesh is None else NamedSharding(mesh, P())

    def pin(out):
      return {} if mesh is None else {"out_shardings": out}

    on = functools.partial(traced_on, mesh=mesh, rules=rules)
    self._prefill_jit = jax.jit(
      on(self._prefill_fn),
      donate_argnums=1,
      static_argnames="capacity",
      **pin((kv, rep, rep, rep, rep)),
    )
    self._insert_jit = jax.jit(on(self._insert_fn), donate_argnums=0, **pin(st))
    self._generate_jit = jax.jit(on(self._generate_fn), donate_argnums=1, **pin((st, rep)))
    self._generate_steps_jit = jax.jit(
      on(self._generate_fn), static_argnums=2, donate_argnums=1, **pin((st, rep))
    )
    self._deactivate_jit = jax.jit(
      lambda st, mask: st._replace(active=st.active & ~mask), donate_argnums=0, **pin(st)
    )
    # The zeros by one jitted call: one compile for the whole state (eager `jnp.zeros` compiled a
    # program per shape in a run's first step), and on a mesh already split across its devices.
    self._zero_state = jax.jit(self._zero_state_fn, out_shardings=st)
    self._zero_cache = functools.partial(init_cache, cfg, 1)
    if mesh is not None:
      self._zero_cache = jax.jit(self._zero_cache, static_argnums=0, out_shardings=kv)

  def _shardings(self, rules: Rules | str):
    """(kv_sharding, state_shardings): the prefill caches [1, S, K, H] split over kv heads as
    the rules place them (replicated where K does not divide), the KV pages [K, P, page_size, H]
    split the same way, and a DecodeState prefix tree with the per-slot vectors replicated: they
    are tiny, and slots index a pool every device holds. (None, None) off a mesh."""
    if self._mesh is None:
      return None, None
    c = self.cfg
    cache_shape = (1, self.page_size, c.num_kv_heads, c.head_dim)
    kv = named_sharding(
      self._mesh, (None, None, "act_kv_heads", "act_head_dim"), rules, shape=cache_shape
    )
    pool_shape = (c.num_kv_heads, self.num_pages, self.page_size, c.head_dim)
    pool = named_sharding(
      self._mesh, ("act_kv_heads", None, None, "act_head_dim"), rules, shape=pool_shape
    )
    rep = DecodeState(*[NamedSharding(self._mesh, P())] * len(DecodeState._fields))
    return kv, rep._replace(k_pages=pool, v_pages=pool)

  # --- properties of the JetStream contract -------------------------------------------------
  @property
  def max_concurrent_decodes(self) -> int:
    return self._slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill

  @property
  def mesh(self):
    return self._mesh

  @property
  def colocated_cpus(self):
    return None

  @property
  def use_chunked_prefill(self) -> bool:
    return self._chunk < self._max_prefill

  @property
  def prefill_chunk_size(self) -> int:
    return self._chunk

  @property
  def generate_compiles(self) -> int:
    """Compiled variants of the decode step (single- and multi-step): 1 after a steady run."""
    return self._generate_jit._cache_size() + self._generate_steps_jit._cache_size()

  @property
  def program_count(self) -> int:
    """Programs compiled so far by the engine's jitted calls (a run of known shapes adds none)."""
    jits = (self._prefill_jit, self._insert_jit, self._generate_jit, self._generate_steps_jit)
    return sum(j._cache_size() for j in jits + (self._deactivate_jit, self._zero_state))

  def get_tokenizer(self):
    return self._tokenizer

  def load_params(self, params=None, *, seed: int = 0):
    """The params to pass to every call: `params` as given (no copy), or a fresh init."""
    return params if params is not None else make_model(self.cfg, seed)[1]

  def get_prefix_destination_sharding(self):
    """Where a prefix's KV cache lives: the engine's kv sharding on its mesh (prefill and insert
    share one mesh, so nothing moves); None off a mesh."""
    return self.kv_sharding

  # --- prefill ------------------------------------------------------------------------------
  # --- decode state, insert, free -----------------------------------------------------------
  def init_decode_state(self) -> DecodeState:
    """A fresh pool and empty slots; the host page bookkeeping is reset with it."""
    self.allocator = PageAllocator(self.num_pages)
    self.slot_pages.clear()
    self._released.clear()
    self.recalibrate_kv()
    return self._zero_state()

  def _zero_state_fn(self) -> DecodeState:
    b, m = self._slots, self.max_pages_per_seq
    dtype = jnp.float8_e4m3fn if self.kv_dtype == "fp8" else None
    k_pages, v_pages = init_pages(self.cfg, self.num_pages, self.page_size, dtype)
    scales = jnp.ones((self.cfg.num_layers, self.cfg.num_kv_heads), jnp.float32)
    return DecodeState(
      k_scale=scales,
      v_scale=scales,
      k_pages=k_pages,
      v_pages=v_pages,
      page_table=jnp.zeros((b, m), jnp.int32),
      lengths=jnp.zeros(b, jnp.int32),
      tokens=jnp.zeros(b, jnp.int32),
      steps=jnp.zeros(b, jnp.int32),
      active=jnp.zeros(b, bool),
      max_new=jnp.zeros(b, jnp.int32),
      stop_ids=jnp.full((b, MAX_STOP_TOKENS), -1, jnp.int32),
      keys=jnp.zeros((b, 2), jnp.uint32),
      sampling=RowSampling(
        jnp.ones(b, jnp.float32),
        jnp.zeros(b, jnp.int32),
        jnp.ones(b, jnp.float32),
        jnp.zeros(b, jnp.float32),
      ),
    )

  def recalibrate_kv(self) -> None:
    """With fp8 pages: the next insert (the first prefill placed) sets new page scales from its
    keys and values. Call it only with no sequence in the pages (the driver does, at the start
    of each run); a no-op for a float cache."""
    self._calibrate = self.kv_dtype == "fp8"

  def _take_calibration(self) -> np.bool_:
    calibrate, self._calibrate = self._calibrate, False
    return np.bool_(calibrate)

  def pages_needed(self, prompt_len: int, max_new_tokens: int, num_samples: int = 1) -> int:
    """Pages `bulk_insert` takes for a group: shared full prompt pages once, the rest per sample.

    A slot stores its prompt and every generated token but the last (never fed back).
    """
    total = pages_for(prompt_len + max_new_tokens - 1, self.page_size)
    shared = prompt_len // self.page_size
    return shared + num_samples * (total - shared)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, request_id=None):
    """Place a (single-sample) prefix in a free slot."""
    del request_id  # the request key travels in the prefix
    return self.bulk_insert(prefix, decode_state, [slot])

  def bulk_insert(
    self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int], sample_ids=None
  ) -> DecodeState:
    """Place sample sample_ids[j] (default j) of a prefix in slots[j], sharing prompt pages.

    The prompt's full pages are allocated once and held by every slot (one reference each);
    each slot gets its own pages for the partly filled last prompt page and its completion.
    Raises OutOfPages (allocating nothing) when the pool is short.
    """
    slots = [int(s) for s in slots]
    sample_ids = list(range(len(slots))) if sample_ids is None else [int(j) for j in sample_ids]
    if len(sample_ids) != len(slots) or not slots:
      raise ValueError(f"bulk_insert needs one sample id per slot, got {sample_ids} for {slots}")
    self._check_slots(slots)
    n, g = prefix.length, len(slots)
    need = self.pages_needed(n, prefix.max_new_tokens, g)
    if need > self.allocator.num_free:
      raise OutOfPages(f"need {need} KV pages, {self.allocator.num_free} are free")
    decode_state = self._apply_releases(decode_state)
    rows, write_from = self._alloc_group(slots, n, prefix.max_new_tokens)
    self.stats["insert_calls"] += 1
    return self._insert_jit(
      decode_state,
      prefix.cache,
      np.asarray(slots, np.int32),
      np.zeros(g, np.int32),
      np.full(g, n, np.int32),
      np.stack(rows),
      np.asarray(write_from, np.int32),
      np.asarray(sample_ids, np.int32),
      prefix.tokens,
      prefix.keys,
      prefix.sampling,
      np.full(g, prefix.max_new_tokens, np.int32),
      np.broadcast_to(prefix.stop_ids, (g, MAX_STOP_TOKENS)),
      np.asarray(prefix.first_index)[sample_ids],
      self._take_calibration(),
    )

  def insert_batch(
    self, batch: PrefillBatch, decode_state: DecodeState, slots: Sequence[int], sample_ids
  ) -> DecodeState:
    """Place sample sample_ids[j] of a PrefillBatch (an index into its N samples) in slots[j],
    in ONE jitted call. Samples of one prompt share its full prompt pages, as in `bulk_insert`;
    the call is padded to the batch's (padded) sample count: one program per prefill program. Raises
    OutOfPages (allocating nothing) when the pool is short."""
    slots, sample_ids = [int(s) for s in slots], [int(j) for j in sample_ids]
    if len(sample_ids) != len(slots) or not slots:
      raise ValueError(f"insert_batch needs one sample id per slot, got {sample_ids} for {slots}")
    self._check_slots(slots)
    n_samples = len(batch.group)
    if any(not 0 <= j < n_samples for j in sample_ids) or len(set(sample_ids)) != len(slots):
      raise ValueError(f"insert_batch sample ids must be distinct in [0, {n_samples})")
    by_prompt: dict[int, list[int]] = {}
    for j, sid in enumerate(sample_ids):
      by_prompt.setdefault(int(batch.group[sid]), []).append(j)
    need = sum(
      self.pages_needed(int(batch.lengths[k]), int(batch.max_new[k]), len(js))
      for k, js in by_prompt.items()
    )
    if need > self.allocator.num_free:
      raise OutOfPages(f"need {need} KV pages, {self.allocator.num_free} are free")
    decode_state = self._apply_releases(decode_state)
    gb = len(batch.keys)  # the batch's sample rows: one insert program per prefill program
    width = batch.cache[0][0].shape[1]
    slot_arr = np.full(gb, self._slots, np.int32)  # padding: an out-of-range slot, dropped
    row_of = np.zeros(gb, np.int32)
    lengths = np.zeros(gb, np.int32)  # padding writes nothing (positions >= length are dropped)
    table = np.zeros((gb, self.max_pages_per_seq), np.int32)
    write_from = np.full(gb, width, np.int32)
    samples = np.zeros(gb, np.int32)
    max_new = np.ones(gb, np.int32)
    stop = np.full((gb, MAX_STOP_TOKENS), -1, np.int32)
    index = np.zeros(gb, np.int32)
    for k, js in by_prompt.items():
      rows, starts = self._alloc_group(
        [slots[j] for j in js], int(batch.lengths[k]), int(batch.max_new[k])
      )
      for j, row, w in zip(js, rows, starts, strict=True):
        slot_arr[j], row_of[j], lengths[j] = slots[j], k, batch.lengths[k]
        table[j], write_from[j], samples[j] = row, w, sample_ids[j]
        max_new[j], stop[j] = batch.max_new[k], batch.stop_ids[k]
        index[j] = batch.first_index[sample_ids[j]]
    self.stats["insert_calls"] += 1
    return self._insert_jit(
      decode_state,
      batch.cache,
      slot_arr,
      row_of,
      lengths,
      table,
      write_from,
      samples,
      batch.tokens,
      batch.keys,
      batch.sampling,
      max_new,
      stop,
      index,
      self._take_calibration(),
    )

  def _check_slots(self, slots: list[int]) -> None:
    for s in slots:
      if not 0 <= s < self._slots or s in self.slot_pages:
        raise ValueError(f"slot {s} is not a free slot of [0, {self._slots})")
    if len(set(slots)) != len(slots):
      raise ValueError(f"insert slots must differ, got {slots}")

  def _alloc_group(self, slots: list[int], n: int, max_new: int):
    """Pages of one prompt's samples placed in `slots` (the caller checked they fit): the full
    prompt pages once, shared, and per slot its own. Returns (page-table rows, the first
    position each slot writes: the shared pages are written by the first slot only)."""
    n_shared = n // self.page_size
    own = pages_for(n + max_new - 1, self.page_size) - n_shared
    shared = self.allocator.alloc(n_shared)
    self.allocator.share(shared, len(slots) - 1)
    rows, write_from = [], []
    for j, s in enumerate(slots):
      pages = shared + self.allocator.alloc(own)
      self.slot_pages[s] = pages
      rows.append(table_row(pages, self.max_pages_per_seq))
      write_from.append(0 if j == 0 else n_shared * self.page_size)
    return rows, write_from

  def _insert_fn(
    self, st, cache, slots, row_of, lengths, rows, write_from, samples, first, keys, sampling,
    max_new, stop, index, calibrate,
  ):  # fmt: skip
    """Slot j <- sample samples[j] of prompt row_of[j] of `cache` (one row per prompt). Slots
    past the engine's count are padding: every per-slot write drops them. The slot's sequence
    has drawn index[j] + 1 tokens of its key stream (the first index[j] end its prompt, for a
    resumed sequence) and may draw max_new[j] - 1 more. With fp8 pages and `calibrate`, the
    page scales are first set from these prompts' keys and values."""
    s = cache[0][0].shape[1]
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    if self.kv_dtype == "fp8":
      real = (pos < lengths[:, None])[:, :, None, None]  # [G, S, 1, 1]: the prompts' positions

      def fit(x):  # [L, K]: each layer's, each kv head's largest |value|, with the margin
        amax = jnp.stack([jnp.max(jnp.where(real, jnp.abs(c[row_of]), 0.0), (0, 1, 3)) for c in x])
        return jnp.maximum(amax.astype(jnp.float32), 1e-6) * (self.kv_margin / FP8_KV_MAX)

      st = st._replace(
        k_scale=jnp.where(calibrate, fit([ck for ck, _ in cache]), st.k_scale),
        v_scale=jnp.where(calibrate, fit([cv for _, cv in cache]), st.v_scale),
      )
    pos = jnp.where(pos >= write_from[:, None], pos, -1)  # [G, S], -1: skipped
    k_pages, v_pages = [], []
    for i, ((pk, pv), (ck, cv)) in enumerate(
      zip(zip(st.k_pages, st.v_pages, strict=True), cache, strict=True)
    ):
      paged = write_kv(
        PagedKV(pk, pv, rows, lengths, *self._scales(st, i)), ck[row_of], cv[row_of], pos
      )
      k_pages.append(paged.k_pages)
      v_pages.append(paged.v_pages)
    tok = first[samples]
    done = jnp.any(tok[:, None] == stop, -1) | (max_new <= 1)
    steps, max_new = index + 1, index + max_new  # counted in the request's key stream
    put = lambda a, x: a.at[slots].set(x, mode="drop")
    return st._replace(
      k_pages=tuple(k_pages),
      v_pages=tuple(v_pages),
      page_table=put(st.page_table, rows),
      lengths=put(st.lengths, lengths),
      tokens=put(st.tokens, tok),
      steps=put(st.steps, steps),
      active=put(st.active, ~done),
      max_new=put(st.max_new, max_new),
      stop_ids=put(st.stop_ids, stop),
      keys=put(st.keys, keys[samples]),
      sampling=jax.tree.map(lambda a, x: put(a, x[samples]), st.sampling, sampling),
    )

  def _scales(self, st: DecodeState, layer: int) -> tuple:
    """(k_scale, v_scale) [K] of a layer's fp8 pages, or (None, None) for float pages."""
    if self.kv_dtype != "fp8":
      return None, None
    return st.k_scale[layer], st.v_scale[layer]

  def free_resource(self, slot: int) -> None:
    """Release a slot's pages (shared prompt pages lose one reference). The slot stops on the
    device at the next `generate`/`insert`, before any freed page can be handed out again."""
    pages = self.slot_pages.pop(int(slot), None)
    if pages is None:
      raise ValueError(f"slot {slot} holds no pages")
    self.allocator.release(pages)
    self._released.add(int(slot))

  def _apply_releases(self, st: DecodeState) -> DecodeState:
    if not self._released:
      return st
    mask = np.zeros(self._slots, bool)
    mask[list(self._released)] = True
    self._released.clear()
    return self._deactivate_jit(st, mask)

  # --- generate -----------------------------------------------------------------------------
  def generate(self, params, decode_state: DecodeState, sampler=None):
    """One decode step for every slot: (new DecodeState, ResultTokens [B, 5]). Jitted once."""
    del sampler  # per-slot sampling parameters live in the decode state
    decode_state = self._apply_releases(decode_state)
    self.stats["generate_calls"] += 1
    self.stats["decode_steps"] += 1
    st, data = self._generate_jit(params, decode_state)
    return st, ResultTokens(data, routes_shape=self.routes_shape)

  def generate_steps(self, params, decode_state: DecodeState, num_steps: int):
    """Up to `num_steps` decode steps in one jitted call: ResultTokens [num_steps, B, 5].

    Slots that finish stop on the device (their `valid` turns False), so a slot never writes
    past its pages, however many steps run; once none is active the call ends and the rows left
    are all invalid. `stats["decode_steps"]` counts the steps dispatched, an upper bound.
    """
    decode_state = self._apply_releases(decode_state)
    self.stats["generate_calls"] += 1
    self.stats["decode_steps"] += num_steps
    st, data = self._generate_steps_jit(params, decode_state, num_steps)
    return st, ResultTokens(data, routes_shape=self.routes_shape)

  def _generate_fn(self, params, st: DecodeState, num_steps: int | None = None):
    if num_steps is None:
      return self._decode_step(params, st)
    # Once no slot is active the call stops: the steps left are invalid rows, not forwards. The
    # driver dispatches a call before it has read the previous one's results, so without this its
    # last call of a run would be num_steps full forwards over finished slots.
    b = st.tokens.shape[0]

    def body(carry):
      i, st, out = carry
      st, data = self._decode_step(params, st)
      return i + 1, st, jax.lax.dynamic_update_index_in_dim(out, data, i, 0)

    width = 5 if self.routes_shape is None else 5 + self.routes_shape[0] * self.routes_shape[1]
    out = jnp.zeros((num_steps, b, width), jnp.int32)  # valid = 0 in every row not written
    carry = (jnp.int32(0), st, out)
    _, st, out = jax.lax.while_loop(
      lambda c: (c[0] < num_steps) & jnp.any(c[1].active), body, carry
    )
    return st, out

  def _decode_step(self, params, st: DecodeState):
    b = st.tokens.shape[0]
    write_len = jnp.where(st.active, st.lengths + 1, 0)  # idle slots write nothing
    cache = tuple(
      PagedKV(k, v, st.page_table, write_len, *self._scales(st, i))
      for i, (k, v) in enumerate(zip(st.k_pages, st.v_pages, strict=True))
    )
    logits, cache, routes = self._forward(
      params,
      st.tokens[:, None],
      st.lengths[:, None],
      st.active[:, None],
      cache=cache,
      logits_at=jnp.zeros(b, jnp.int32),
    )
    tok, logp = sample_rows(logits, step_keys(st.keys, st.steps), st.sampling)
    produced = st.active
    steps = st.steps + produced
    stop = jnp.any(tok[:, None] == st.stop_ids, -1)
    done = produced & (stop | (steps >= st.max_new))
    new = st._replace(
      k_pages=tuple(c.k_pages for c in cache),
      v_pages=tuple(c.v_pages for c in cache),
      lengths=st.lengths + produced,
      tokens=jnp.where(produced, tok, st.tokens),
      steps=steps,
      active=produced & ~done,
    )
    data = pack_result(tok, produced, steps, done, logp)
    if routes is not None:  # [L, B, 1, k] -> [B, L * k]: the fed token's experts
      data = jnp.concatenate([data, jnp.moveaxis(routes[:, :, 0], 0, 1).reshape(b, -1)], axis=1)
    return new, data
