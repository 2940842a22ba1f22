"""Pallas kernels on a mesh of several devices: each call wrapped in `jax.shard_map`.

A Pallas kernel is a custom call that XLA's SPMD partitioner cannot split: JAX refuses to lower
a Mosaic TPU kernel inside a program partitioned over more than one device ("Mosaic kernels
cannot be automatically partitioned"), and a Triton call would at best be replicated. So on a
mesh each kernel call site runs its kernel inside a `shard_map` whose blocks follow the
arrays' layout under the active sharding rules: paged attention per kv-head shard, the quantized
matmul per column or row shard of its weight (a row split sums its partial products over the
axis), the grouped matmul on whole operands. Operands laid out otherwise are resharded by XLA on
the way in (an FSDP-sharded weight is all-gathered, as FSDP does for any matmul). Inside a
`shard_map` already (the expert-parallel MoE) or off a mesh the kernel is called as it is.

The mesh and rules are the context's (`jaxrl.mesh.use_mesh`, which the SFT and RL phases and
`launch.evaluate` enter); an `Engine` built on a mesh traces its programs under its own mesh and
rules when its caller entered none (`jaxrl.mesh.traced_on`).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxrl.mesh import active_rules, logical_to_spec


def kernel_mesh():
  """The context mesh when a kernel call must be wrapped (several devices, no axis manual yet),
  else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or mesh.manual_axes:
    return None
  return mesh


def mesh_axes_of(mesh, logical: str, size: int):
  """The mesh axes a dim of `size` with logical name `logical` is split over under the active
  rules (None: replicated, or no rules in context)."""
  rules = active_rules()
  if rules is None:
    return None
  return logical_to_spec((logical,), rules, shape=(size,), mesh=mesh)[0]


def shard_mapped(fn, mesh, in_specs, out_specs):
  """`fn` as a shard_map over every axis of `mesh` (a kernel's body needs no replication
  checks: what it returns per device is what out_specs say)."""
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


# Mesh axes that split weights for storage only (FSDP): gathered for a kernel, never a split of
# its computation.
STORAGE_AXES = ("data", "fsdp")


def matmul_split(mesh, w_axes, w_shape, n_in: int):
  """How x [M, K] @ w [K, N] runs per device on `mesh` when w is a weight of logical axes
  `w_axes` and shape `w_shape` whose first `n_in` dims are contracted (K their product, N the
  rest's): ("n", axes) per column shard of w, ("k", axes) per row shard with the partial
  products summed over axes, or (None, None) whole. The leading dim of N, else of K, decides:
  its split, unless a storage split, survives the reshape to 2-D."""
  rules = active_rules()
  if rules is None or w_axes is None:
    return None, None
  spec = logical_to_spec(tuple(w_axes), rules, shape=tuple(w_shape), mesh=mesh)

  def compute(dim):
    ax = spec[dim]
    names = () if ax is None else (ax,) if isinstance(ax, str) else tuple(ax)
    return ax if names and not set(names) & set(STORAGE_AXES) else None

  if compute(n_in) is not None:
    return "n", compute(n_in)
  if compute(0) is not None:
    return "k", compute(0)
  return None, None


def sharded_matmul(matmul, mesh, how, ax, x, w, w_scale, x_scale):
  """matmul(x [M, K], w [K, N], w_scale [N], x_scale [M]) -> [M, N] as `matmul_split` says,
  inside a shard_map over `mesh` (x's rows on every device: the sampler's slots are)."""
  if how == "n":
    specs = (P(), P(None, ax), P(ax), P())
    return shard_mapped(matmul, mesh, specs, P(None, ax))(x, w, w_scale, x_scale)
  if how == "k":

    def partial_sum(x, w, w_scale, x_scale):
      return jax.lax.psum(matmul(x, w, w_scale, x_scale), ax)

    specs = (P(None, ax), P(ax, None), P(), P())
    return shard_mapped(partial_sum, mesh, specs, P())(x, w, w_scale, x_scale)
  return shard_mapped(matmul, mesh, (P(),) * 4, P())(x, w, w_scale, x_scale)
