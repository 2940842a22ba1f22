"""Multi-process runs on JAX's multi-controller runtime: one Python process per host, every
process running the same program over one global mesh (the runtime Cloud TPU pods and multi-GPU
clusters use; no scheduler of our own).

  initialize(coordinator, num_processes, process_id)   jax.distributed, before any other jax
                                                       call; 'auto' lets JAX detect the cluster
  initialize_from_env()                                the same from JAXRL_COORDINATOR, ..._NUM_
                                                       PROCESSES, ..._PROCESS_ID (launch.train)
  process_rows(sharding, rows)                         the global rows this process supplies
  put_process_local(tree, sharding, rows)              one global array per leaf from each
                                                       process's own rows: no process holds, or
                                                       reads, another's share of a batch
  put(tree, shardings)                                 device_put with no cross-process check
                                                       program (each process fills its shards)
  to_host(tree)                                        numpy copies of global arrays, gathered
                                                       from every process where they are split
  share(n)                                             this process's contiguous part of n items
  allgather_objects(obj)                               every process's `obj`, in process order
  gather_shares(fn, n)                                 fn over this process's share of n items;
                                                       every share's result, in process order

Params built the same way on every process (same seed) go to the mesh with `put` onto their
global shardings (`jaxrl.mesh.shard_params`): each process fills its own devices' shards. An
HF checkpoint (`jaxrl.models.hf.load_hf_checkpoint` with a mesh) is read block by block: each
process reads only its devices' rows and columns of each tensor. The
learner's train step (`jaxrl.rl.train_step`) is one jitted program over the global mesh and
needs nothing else: `tests/multihost_test.py` runs both in two processes of two CPU devices
each and gets the params, losses and updates of one process with four.

The RL job runs the same way (`launch.train` joins from the environment): every process runs the
whole loop over one global mesh, the jitted steps split over all devices, and what comes back
to the host (completions, a batch's live rows) is gathered (`to_host`), so each process holds
the same rollouts. The host work is split: each process reads only its share of every prompt
batch (`jaxrl.data.stream`: its records' parsing or generation) and scores only its share of
every batch of completions (`jaxrl.rl.run.Run.score`); the records and the rewards are then
exchanged (`allgather_objects`, a few KiB per step), since every process drives the same
engine program over all the requests. A reward function that fails in one process fails the
step in all of them, with that process's message. orbax writes each array's shards from the
processes that hold them, and only process 0 writes metrics. The same test runs the default
job's smoke in two processes and logs what one process logs, each process having read and
scored half of the records; stopped after an RL step and resumed, it repeats the uninterrupted
run. A file-backed task reads only its share of each batch's lines or row groups
(`jaxrl.data.jsonl`). The split placement runs too: each process gives a share of its own
devices to each side, the learner's sub-mesh spans the processes and each process's sampler is
an engine over its own devices, sampling its share of the prompts (`jaxrl.rl.placement`); the
same test runs it in two processes and logs what one process logs.

Exchanges of host objects (`allgather_objects`) go through the coordinator's key-value store,
not through a program on the devices, and host arrays reach a sharding spanning processes with
`put`, not `jax.device_put` (which checks with a program over every device that the processes
agree): on CPU, a program over every device whose collectives overlap those of a sub-mesh's
program still running makes gloo abort, and the split placement leaves the learner's update
running while the host samples.

On CPU the processes exchange data through gloo (`jax_cpu_collectives_implementation`), which
`initialize` selects; GPUs and TPUs use their own collectives.
"""

from __future__ import annotations

import itertools
import os
import pickle
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

PROCESS_ID_ENV = "JAXRL_PROCESS_ID"
COORDINATOR_ENV = "JAXRL_COORDINATOR"
NUM_PROCESSES_ENV = "JAXRL_NUM_PROCESSES"


def initialize(
  coordinator: str = "", num_processes: int = 1, process_id: int | None = None
) -> bool:
  """Join a multi-process run; returns whether one was joined (False: one process, nothing to
  do). `coordinator` is process 0's "host:port" (every process passes the same), or "auto" for
  JAX's own detection of the cluster (Cloud TPU VMs, SLURM, ...; the other two arguments are
  then left to it). `process_id` None reads `JAXRL_PROCESS_ID` from the environment, so every
  worker can run the same command. Call it before anything else touches jax's devices."""
  if coordinator == "auto":
    _cpu_collectives()
    jax.distributed.initialize()
    return True
  if not coordinator:
    if num_processes != 1:
      raise ValueError(
        f"num_processes={num_processes} needs a coordinator ('host:port' of process 0, or 'auto')"
      )
    return False
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"coordinator={coordinator!r} must be 'host:port' (or 'auto')")
  if not (isinstance(num_processes, int) and num_processes >= 2):
    raise ValueError(f"num_processes={num_processes!r} must be an integer >= 2 with a coordinator")
  if process_id is None:
    raw = os.environ.get(PROCESS_ID_ENV, "")
    if not raw.isdigit():
      raise ValueError(
        f"no process_id given and {PROCESS_ID_ENV}={raw!r} is not a process index "
        f"(0..{num_processes - 1})"
      )
    process_id = int(raw)
  if not (isinstance(process_id, int) and 0 <= process_id < num_processes):
    raise ValueError(f"process_id={process_id!r} must be in 0..{num_processes - 1}")
  _cpu_collectives()
  jax.distributed.initialize(
    coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
  )
  return True


def initialize_from_env() -> bool:
  """`initialize` from JAXRL_COORDINATOR ('host:port' or 'auto'; unset: one process),
  JAXRL_NUM_PROCESSES and JAXRL_PROCESS_ID: what `python -m launch.train` does first, so the
  same command runs on every worker with only the environment differing."""
  coordinator = os.environ.get(COORDINATOR_ENV, "")
  raw = os.environ.get(NUM_PROCESSES_ENV, "1" if coordinator in ("", "auto") else "")
  if not raw.isdigit():
    raise ValueError(f"{NUM_PROCESSES_ENV}={raw!r} must be the number of processes")
  return initialize(coordinator, int(raw))


def _cpu_collectives() -> None:
  """gloo for cross-process collectives on CPU (jax's default CPU client has none); the option
  only concerns the CPU client, so it is harmless where the devices are GPUs or TPUs."""
  if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def process_rows(sharding: Sharding, rows: int) -> np.ndarray:
  """The indices of the rows (axis 0) of a [rows, ...] global array with `sharding` that live on
  this process's devices, ascending. They are one contiguous range whenever the mesh lays the
  processes out along the batch axis in order (as `jax.make_mesh` and `jaxrl.mesh.make_mesh` do);
  anything else is refused, since the rows could not be supplied as one local block."""
  index = sharding.addressable_devices_indices_map((rows,))
  mine = sorted({i for (s,) in index.values() for i in range(*s.indices(rows))})
  if mine != list(range(mine[0], mine[0] + len(mine))):
    raise ValueError(
      f"this process's rows {mine} are not one contiguous range under {sharding}: lay the "
      "mesh's batch axes out process by process"
    )
  return np.asarray(mine, np.int64)


def put_process_local(tree: Any, sharding: Sharding, rows: int) -> Any:
  """Global [rows, ...] arrays sharded by `sharding` (rows along axis 0) from each process's
  own rows (`process_rows(sharding, rows)`, in order): every leaf of `tree` holds only those.
  In a single process it is `jax.device_put(tree, sharding)`."""
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)
  want = len(process_rows(sharding, rows))

  def put(x):
    x = np.asarray(x)
    if x.shape[0] != want:
      raise ValueError(
        f"this process supplies {want} of the {rows} rows, but a leaf has {x.shape[0]}"
      )
    return jax.make_array_from_process_local_data(sharding, x, (rows, *x.shape[1:]))

  return jax.tree.map(put, tree)


def put(tree: Any, shardings: Any) -> Any:
  """`jax.device_put(tree, shardings)`, except that a host value (or an uncommitted array)
  going to a sharding that spans several processes is placed shard by shard
  (`jax.make_array_from_callback`): each process fills its own devices from its own copy, which
  must be the same in every process, and no program runs. device_put would first check that
  every process passed the same value, with a program over every device of the run; beside a
  program of a sub-mesh that is still running (the split placement's learner, while the host
  samples), the two programs' collectives collide on CPU (gloo aborts)."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def one(x, s):
    if (
      isinstance(s, Sharding)
      and not s.is_fully_addressable
      and not (isinstance(x, jax.Array) and x.committed)
    ):
      host = x if isinstance(x, jax.Array) else np.asarray(x)
      return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])
    return jax.device_put(x, s)

  if isinstance(shardings, Sharding):
    return jax.tree.map(lambda x: one(x, shardings), tree)
  return jax.tree.map(one, tree, shardings)


def to_host(tree: Any) -> Any:
  """numpy copies of the leaves: an array whose shards all live in this process is read
  directly; one split across processes is gathered from all of them (every process must call
  this together)."""
  from jax.experimental import multihost_utils

  def get(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x if not isinstance(x, jax.Array) else jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(get, tree)


def share(n: int, process: int | None = None, count: int | None = None) -> range:
  """The contiguous part of `n` items (rows, records, completions) that `process` (default:
  this one) handles out of `count` processes (default: all): as `np.array_split`, the first
  n % count processes take one more. One process: all of them."""
  process = jax.process_index() if process is None else process
  count = jax.process_count() if count is None else count
  size, extra = divmod(n, count)
  start = process * size + min(process, extra)
  return range(start, start + size + (process < extra))


EXCHANGE_TIMEOUT_S = 3600  # how long a process waits for another's part of an exchange
_CHUNK = 1 << 20  # bytes per key-value entry (well under gRPC's message limits)
_exchanges = itertools.count()  # every process makes the same exchanges in the same order


def allgather_objects(obj: Any) -> list:
  """Every process's `obj` (anything picklable), in process order; every process must call
  this together. One process: [obj]. The bytes go through the coordination service's
  key-value store (jax.distributed's coordinator), not through a program on the devices: an
  exchange then never runs a collective beside one the devices are running (on CPU, gloo
  fails when two programs' collectives between the same processes overlap, which a split
  placement's learner and sampler would otherwise do), and it needs no compile. Each part is
  stored in chunks of at most 1 MiB; a process deletes its part of an exchange at its next one,
  when every process has read it."""
  if jax.process_count() == 1:
    return [obj]
  from jax._src import distributed as jax_distributed

  client = jax_distributed.global_state.client
  n, me = next(_exchanges), jax.process_index()
  data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  chunks = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
  for k, chunk in enumerate(chunks):
    client.key_value_set_bytes(f"jaxrl/exchange/{n}/{me}/{k}", chunk)
  client.key_value_set(f"jaxrl/exchange/{n}/{me}/chunks", str(len(chunks)))
  every = []
  for i in range(jax.process_count()):
    try:
      count = int(client.blocking_key_value_get(f"jaxrl/exchange/{n}/{i}/chunks", _ms()))
      part = b"".join(
        client.blocking_key_value_get_bytes(f"jaxrl/exchange/{n}/{i}/{k}", _ms())
        for k in range(count)
      )
    except Exception as e:
      raise RuntimeError(
        f"process {me}: process {i} sent nothing to exchange {n} for {EXCHANGE_TIMEOUT_S} s "
        f"(it failed, or it is not making the same exchanges): {e}"
      ) from e
    every.append(pickle.loads(part))
  if n > 0:  # every process has finished exchange n - 1: it posted to this one
    client.key_value_delete(f"jaxrl/exchange/{n - 1}/{me}")
  return every


def _ms() -> int:
  return EXCHANGE_TIMEOUT_S * 1000


def gather_shares(fn: Callable[[range], Any], n: int) -> list:
  """`fn(share(n))` here; every process's result, in process order (so in item order): each
  process does its part of the work on `n` items and all get the whole. If `fn` raises in any
  process, every process raises: the failing one its own exception, the others a RuntimeError
  naming it and its message (no process is left waiting for the exchange). One process:
  [fn(range(n))]."""
  if jax.process_count() == 1:
    return [fn(range(n))]
  try:
    mine: tuple = ("ok", fn(share(n)))
  except Exception as e:  # re-raised below, once the others have heard of it
    mine, error = ("error", f"{type(e).__name__}: {e}"), e
  every = allgather_objects(mine)
  failed = [(i, msg) for i, (kind, msg) in enumerate(every) if kind == "error"]
  if failed:
    if mine[0] == "error":
      raise error
    i, msg = failed[0]
    raise RuntimeError(f"process {i} failed on its share of {n} items: {msg}")
  return [result for _, result in every]
