"""Device mesh, logical-axis rules tables, and helpers that shard params and activations."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import distributed

MESH_AXES = ("data", "fsdp", "tensor")
# A mesh built with expert > 1 has a fourth axis, "expert" (between fsdp and tensor): MoE expert
# weights split over it and tokens are exchanged over it (expert parallelism,
# jaxrl.models.moe.moe_dispatch_ep). Rules candidates naming an optional axis the mesh lacks
# are skipped, so one rules table serves meshes with and without it.
EXPERT_AXIS = "expert"
OPTIONAL_AXES = (EXPERT_AXIS,)

# A rules table maps logical axis names to mesh axes: None (replicated), one mesh axis, or a tuple
# of mesh axes. A name may appear more than once; the first entry that fits is used (see
# `logical_to_spec`).
MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

_BATCH = ("data", "fsdp")

RULES: dict[str, Rules] = {
  # FSDP over the model dim, Megatron-style tensor parallelism over heads / mlp / vocab. With
  # tensor=1 this is plain FSDP; with fsdp=1 plain tensor parallelism. MoE expert weights
  # [E, D, F] are stored split over experts on fsdp (so embed, listed later, stays whole there);
  # where E does not divide by fsdp they fall back to embed over fsdp like a dense MLP. On a mesh
  # with an expert axis the experts split over expert (x fsdp where that divides), and the batch
  # over expert too: expert-parallel devices are data-parallel for everything but the experts.
  "fsdp_tp": (
    ("batch", (*_BATCH, EXPERT_AXIS)),
    ("batch", _BATCH),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("experts", (EXPERT_AXIS, "fsdp")),
    ("experts", EXPERT_AXIS),
    ("experts", "fsdp"),
    ("lora", None),  # the LoRA rank: small, so every shard holds all of it
    ("layers", None),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
  ),
  # Every weight on every device; only the batch is split (pure data parallelism).
  "replicated": (
    ("batch", (*_BATCH, EXPERT_AXIS)),
    ("batch", _BATCH),
    ("vocab", None),
    ("embed", None),
    ("q_heads", None),
    ("kv_heads", None),
    ("mlp", None),
    ("head_dim", None),
    ("norm", None),
    ("experts", None),
    ("lora", None),
    ("layers", None),
    ("length", None),
    ("act_embed", None),
    ("act_heads", None),
    ("act_kv_heads", None),
    ("act_head_dim", None),
    ("act_mlp", None),
    ("act_vocab", None),
  ),
}


def get_rules(name: str) -> Rules:
  """Returns the rules table registered under `name`."""
  if name not in RULES:
    raise ValueError(f"unknown sharding rules {name!r}; valid names: {sorted(RULES)}")
  return RULES[name]


def _as_rules(rules: Rules | str) -> Rules:
  return get_rules(rules) if isinstance(rules, str) else rules


def make_mesh(
  data: int = 1,
  fsdp: int = -1,
  tensor: int = 1,
  *,
  expert: int = 1,
  devices: Sequence[Any] | None = None,
) -> Mesh:
  """Builds a ('data', 'fsdp', 'tensor') mesh, or ('data', 'fsdp', 'expert', 'tensor') with
  expert > 1; one size may be -1, meaning all remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if not isinstance(expert, int) or expert < 1:
    raise ValueError(f"mesh.expert={expert!r} must be a positive integer; there are {n} devices")
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
  if expert > 1:
    sizes = {"data": data, "fsdp": fsdp, EXPERT_AXIS: expert, "tensor": tensor}
  for name, size in sizes.items():
    if not isinstance(size, int) or (size < 1 and size != -1):
      raise ValueError(
        f"mesh.{name}={size!r} must be a positive integer or -1 (all remaining devices); "
        f"there are {n} devices"
      )
  inferred = [name for name, size in sizes.items() if size == -1]
  if len(inferred) > 1:
    fields = ", ".join(f"mesh.{name}" for name in inferred)
    raise ValueError(f"only one mesh size may be -1, got {fields}; there are {n} devices")
  if inferred:
    name = inferred[0]
    rest = math.prod(size for size in sizes.values() if size != -1)
    if n % rest:
      raise ValueError(
        f"mesh.{name}=-1 cannot be inferred: the other sizes multiply to {rest}, "
        f"which does not divide the {n} devices"
      )
    sizes[name] = n // rest
  if math.prod(sizes.values()) != n:
    shown = " * ".join(f"mesh.{name}={size}" for name, size in sizes.items())
    raise ValueError(f"{shown} = {math.prod(sizes.values())} must equal the {n} devices")
  # jax 0.10 defaults to Explicit axes, which would make every op sharding-typed; Auto lets GSPMD
  # propagate shardings from the few constraints we place.
  return jax.make_mesh(
    tuple(sizes.values()),
    tuple(sizes),
    axis_types=(AxisType.Auto,) * len(sizes),
    devices=devices,
  )


def split_devices(devices: Sequence[Any], sampler_fraction: float) -> tuple[list, list]:
  """(learner devices, sampler devices): the last round(sampler_fraction * n) devices (at least
  one, at most n - 1) go to the sampler, so each side's devices are contiguous. Devices of
  several processes (a multi-process run) are split process by process, each process giving
  the same share of its own devices to each side: the learner's devices span every process,
  and each process keeps sampler devices of its own (`jaxrl.rl.run.Run.build` puts each
  process's engine on them; `jaxrl.rl.placement.ProcessShare`)."""
  devices = list(devices)
  hosts: dict[int, list] = {}
  for d in devices:
    hosts.setdefault(getattr(d, "process_index", 0), []).append(d)
  if len(hosts) > 1:
    sizes = {len(h) for h in hosts.values()}
    if len(sizes) > 1 or min(sizes) < 2:
      shown = ", ".join(f"process {p}: {len(h)}" for p, h in sorted(hosts.items()))
      raise ValueError(
        "rl.placement.kind='split' with several processes needs the same number of devices, "
        f"at least 2, on every process (one per side on each); there are {shown}"
      )
    parts = [split_devices(hosts[p], sampler_fraction) for p in sorted(hosts)]
    return [d for lrn, _ in parts for d in lrn], [d for _, smp in parts for d in smp]
  n = len(devices)
  if n < 2:
    raise ValueError(
      f"rl.placement.kind='split' needs at least 2 devices (one per side); there are {n}"
    )
  k = min(n - 1, max(1, round(sampler_fraction * n)))
  return devices[: n - k], devices[n - k :]


def _axis_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
  if mesh_axes is None:
    return ()
  return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def logical_to_spec(
  axes: Sequence[str | None],
  rules: Rules | str,
  *,
  shape: Sequence[int] | None = None,
  mesh: Mesh | jax.sharding.AbstractMesh | None = None,
  fallbacks: list[str] | None = None,
) -> P:
  """Maps logical axis names to a PartitionSpec through `rules`.

  For each dim, the first rules entry for its name whose mesh axes are all unused by earlier dims
  (and, given `shape` and `mesh`, divide the dim) wins; if none fits the dim is replicated. Each dim
  that loses its first choice this way is described in `fallbacks`, when a list is passed.
  Candidates naming an optional axis (`OPTIONAL_AXES`) the mesh lacks (or any, without a mesh)
  are skipped silently: they are for meshes that have it.
  """
  rules = _as_rules(rules)
  if shape is not None and len(shape) != len(axes):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
  mesh_sizes = dict(mesh.shape) if mesh is not None else None
  used: set[str] = set()
  spec: list[MeshAxes] = []
  for dim, name in enumerate(axes):
    if name is None:
      spec.append(None)
      continue
    candidates = [_axis_tuple(mesh_axes) for logical, mesh_axes in rules if logical == name]
    if not candidates:
      known = sorted({logical for logical, _ in rules})
      raise ValueError(f"logical axis {name!r} has no sharding rule; known names: {known}")
    chosen: tuple[str, ...] = ()
    reasons = []
    for cand in candidates:
      if mesh_sizes is None and set(cand) & set(OPTIONAL_AXES):
        continue  # no mesh given: the layout of a mesh without the optional axes
      if mesh_sizes is not None:
        missing = [a for a in cand if a not in mesh_sizes]
        if missing and all(a in OPTIONAL_AXES for a in missing):
          continue  # e.g. "expert" on a mesh built without expert parallelism
        if missing:
          raise ValueError(
            f"logical axis {name!r} maps to mesh axes {missing} not in the mesh {tuple(mesh_sizes)}"
          )
      if used.intersection(cand):
        reasons.append(f"{'+'.join(cand)} already used by an earlier dim")
        continue
      if shape is not None and mesh_sizes is not None:
        ways = math.prod(mesh_sizes[a] for a in cand)
        if shape[dim] % ways:
          reasons.append(f"size {shape[dim]} not divisible by {'+'.join(cand)}={ways}")
          continue
      chosen = cand
      break
    if reasons and fallbacks is not None:
      got = "+".join(chosen) if chosen else "replicated"
      fallbacks.append(f"dim {dim} {name!r} -> {got}: {'; '.join(reasons)}")
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
  return P(*spec)


def named_sharding(
  mesh: Mesh, axes: Sequence[str | None], rules: Rules | str, *, shape: Sequence[int] | None = None
) -> NamedSharding:
  """The NamedSharding for an array with logical `axes` (e.g. a batch going into a jitted step)."""
  return NamedSharding(mesh, logical_to_spec(axes, rules, shape=shape, mesh=mesh))


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _leaf_value_and_axes(leaf: Any) -> tuple[Any, tuple[str | None, ...] | None]:
  if isinstance(leaf, nnx.Variable):
    return leaf.get_value(), leaf.get_metadata().get("axes")
  return leaf, None


def _leaf_spec(leaf: Any, mesh: Mesh, rules: Rules, path: str, fallbacks: list[str] | None) -> P:
  value, axes = _leaf_value_and_axes(leaf)
  if axes is None:
    return P()
  shape = tuple(value.shape)
  if len(axes) != len(shape):
    raise ValueError(f"param {path}: logical axes {tuple(axes)} do not match shape {shape}")
  return logical_to_spec(axes, rules, shape=shape, mesh=mesh, fallbacks=fallbacks)


def path_str(path) -> str:
  """A pytree key path as "layers/0/attn/q" (the form the rules table and checkpoints use)."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def param_shardings(params: Any, mesh: Mesh, rules: Rules | str) -> Any:
  """NamedShardings for a param tree (nnx.State or arrays); params without `axes` are replicated.

  Variables come back holding their NamedSharding (flax's `get_partition_spec` convention), so the
  result's plain-pytree leaves line up with the params' arrays and it can be passed straight to
  `jax.device_put` or `jax.jit(out_shardings=...)`. Abstract params (`nnx.eval_shape`) work too.
  """
  rules = _as_rules(rules)

  def one(path, leaf):
    sharding = NamedSharding(mesh, _leaf_spec(leaf, mesh, rules, path_str(path), None))
    return leaf.replace(sharding) if isinstance(leaf, nnx.Variable) else sharding

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_variable)


def shard_params(params: Any, mesh: Mesh, rules: Rules | str) -> Any:
  """Places params on the mesh by their logical axes; returns the same pytree type."""
  return distributed.put(params, param_shardings(params, mesh, rules))


def describe_shardings(params: Any, mesh: Mesh, rules: Rules | str) -> list[str]:
  """One readable line per param: path, shape, logical axes, spec, and any fallback taken."""
  rules = _as_rules(rules)
  lines = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]:
    value, axes = _leaf_value_and_axes(leaf)
    fallbacks: list[str] = []
    name = path_str(path)
    spec = _leaf_spec(leaf, mesh, rules, name, fallbacks)
    line = f"{name} {tuple(getattr(value, 'shape', ()))} axes={axes} spec={spec}"
    if fallbacks:
      line += " fallback: " + " | ".join(fallbacks)
    lines.append(line)
  return lines


_ACTIVE_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar(
  "jaxrl_mesh_rules", default=None
)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules | str) -> Iterator[Mesh]:
  """Makes `mesh` the JAX context mesh and `rules` the rules `logical_constraint` uses.

  Enter it outside `jax.jit`: the rules are read at trace time. jit's cache is keyed on the context
  mesh, so switching meshes retraces, but switching rules under the same mesh does not.
  """
  token = _ACTIVE_RULES.set(_as_rules(rules))
  try:
    with jax.set_mesh(mesh):
      yield mesh
  finally:
    _ACTIVE_RULES.reset(token)


def active_rules() -> Rules | None:
  """The rules set by the innermost `use_mesh`, or None outside one."""
  return _ACTIVE_RULES.get()


def traced_on(fn, mesh: Mesh | None, rules: Rules | str):
  """`fn` (to be jitted) traced with `mesh` and `rules` as its context when its caller set none.

  A program built for a mesh (the engine's) then places its activations and partitions its
  Pallas kernels as it does inside `use_mesh`, whether or not its caller entered one; a caller's
  own context is left as it is. The mesh is entered as an abstract mesh, which a trace allows.
  """
  if mesh is None:
    return fn
  rules = _as_rules(rules)

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    if not jax.sharding.get_abstract_mesh().empty:
      return fn(*args, **kwargs)
    token = _ACTIVE_RULES.set(rules)
    try:
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return fn(*args, **kwargs)
    finally:
      _ACTIVE_RULES.reset(token)

  return traced


def logical_constraint(
  x: jax.Array, axes: Sequence[str | None], rules: Rules | str | None = None
) -> jax.Array:
  """Constrains `x`'s sharding by logical axis names; a no-op when no mesh is in context.

  Model code calls this unconditionally, so the same forward runs single-device and sharded.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  rules = active_rules() if rules is None else _as_rules(rules)
  if rules is None:
    raise ValueError(
      "logical_constraint found a mesh in context but no rules; enter jaxrl.mesh.use_mesh(mesh, "
      "rules) instead of jax.set_mesh, or pass rules="
    )
  spec = logical_to_spec(axes, rules, shape=x.shape, mesh=mesh)
  return jax.lax.with_sharding_constraint(x, spec)
