"""The model's activation sharding constraints, on 8 simulated devices: in a compiled train step
every constrained activation carries exactly the sharding the rules table gives its logical
axes; outside `jaxrl.mesh.use_mesh` the same step holds no constraint at all."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import graphdef_of, numpy_model

from jaxrl import mesh as meshlib
from jaxrl.models import ModelConfig, layers, transformer
from jaxrl.models.transformer import token_logprobs

pytestmark = pytest.mark.integration

RULES = meshlib.get_rules("fsdp_tp")
B, T = 8, 12
# Every size splits over its mesh axes (V = 258 over tensor=2), so no dim falls back silently.
ACT = ("batch", "length", "act_embed")  # the residual stream: embedding output, block outputs
CFG = ModelConfig.tiny(vocab_size=258).replace(num_layers=3)


def _step(graphdef):
  """An SGD step on the masked mean token log-prob loss, as a learner's step runs the model."""

  def step(params, tokens, valid):
    def loss(p):
      logp = token_logprobs(graphdef, p, tokens, valid)
      return -jnp.sum(jnp.where(valid, logp, 0.0)) / jnp.sum(valid)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

  return jax.jit(step, donate_argnums=0)


def _inputs(mesh):
  graphdef, params = numpy_model(CFG, seed=0)
  params = meshlib.shard_params(params, mesh, RULES)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, CFG.vocab_size, size=(B, T)), jnp.int32)
  valid = jnp.ones((B, T), bool).at[::3, :2].set(False)
  batch = meshlib.named_sharding(mesh, ("batch", "length"), RULES)
  return graphdef, params, jax.device_put(tokens, batch), jax.device_put(valid, batch)


def _expected_sites(cfg):
  """(logical axes, shape) of every constraint one forward places, in order."""
  n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.embed_dim
  q, kv = (
    ("batch", "length", "act_heads", "act_head_dim"),
    ("batch", "length", "act_kv_heads", "act_head_dim"),
  )
  block = [(q, (B, T, n, h)), (kv, (B, T, k, h)), (kv, (B, T, k, h)), (q, (B, T, n, h))]
  block += [(("batch", "length", "act_mlp"), (B, T, cfg.mlp_dim))]
  block += [(ACT, (B, T, d))]
  logits = (("batch", "length", "act_vocab"), (B, T, cfg.vocab_size))
  return [(ACT, (B, T, d))] + block * cfg.num_layers + [logits]


@pytest.mark.parametrize("scan", [False, True])
def test_compiled_step_activations_carry_the_rules_shardings(scan, monkeypatch):
  mesh = meshlib.make_mesh(data=2, fsdp=2, tensor=2)
  graphdef, params, tokens, valid = _inputs(mesh)
  cfg = CFG.replace(scan_layers=scan, remat="full" if scan else "none")
  graphdef = graphdef_of(cfg)
  seen = []
  real = meshlib.logical_constraint

  def recorded(x, axes, rules=None):
    y = real(x, axes, rules)
    # The sharding the compiler gave this value in the compiled (partitioned) step.
    site = (tuple(axes), tuple(y.shape))
    jax.debug.inspect_array_sharding(y, callback=lambda s, site=site: seen.append((*site, s)))
    return y

  monkeypatch.setattr(layers, "logical_constraint", recorded)
  monkeypatch.setattr(transformer, "logical_constraint", recorded)
  with meshlib.use_mesh(mesh, RULES):
    _step(graphdef).lower(params, tokens, valid).compile()

  # One report per traced site: the scanned stack traces its block once (remat traces it again
  # for the backward pass, which reports the same sharding).
  want = _expected_sites(CFG if not scan else CFG.replace(num_layers=1))
  got_sites = [(axes, shape) for axes, shape, _ in seen]
  assert set(got_sites) == set(want)
  for axes, shape, sharding in seen:
    spec = meshlib.logical_to_spec(axes, RULES, shape=shape, mesh=mesh)
    assert sharding.is_equivalent_to(jax.NamedSharding(mesh, spec), len(shape)), (axes, sharding)
  # The rules really split these activations (batch over data x fsdp, heads/mlp/vocab over tensor).
  specs = {axes: meshlib.logical_to_spec(axes, RULES, shape=s, mesh=mesh) for axes, s in want}
  assert specs[ACT] == jax.P(("data", "fsdp"), None, None)
  assert specs[("batch", "length", "act_mlp")] == jax.P(("data", "fsdp"), None, "tensor")


def _sdy(spec, shape) -> str:
  """A PartitionSpec and shape as the lowered module writes a constraint's operand."""
  dims = [() if d is None else (d,) if isinstance(d, str) else d for d in spec]
  dims += [()] * (len(shape) - len(dims))
  text = ", ".join("{" + ", ".join(f'"{a}"' for a in d) + "}" for d in dims)
  return f"[{text}]> : tensor<{'x'.join(map(str, shape))}xf32>"


def test_the_model_places_its_constraints_only_under_use_mesh():
  mesh = meshlib.make_mesh(data=2, fsdp=2, tensor=2)
  graphdef, params, tokens, valid = _inputs(mesh)
  step = _step(graphdef)
  pattern = re.compile(r"sdy\.sharding_constraint %\S+ <@mesh, (\[.*?\]> : tensor<[^>]*>)")
  assert pattern.findall(step.lower(params, tokens, valid).as_text()) == []  # no mesh: no-ops
  with meshlib.use_mesh(mesh, RULES):
    got = pattern.findall(step.lower(params, tokens, valid).as_text())
  # The unpatched model, lowered: each site's constraint on the forward value and (its transpose)
  # on the gradient flowing back through it, with the rules table's sharding.
  want = [
    _sdy(meshlib.logical_to_spec(a, RULES, shape=s, mesh=mesh), s) for a, s in _expected_sites(CFG)
  ]
  assert sorted(got) == sorted(want * 2)
