"""The per-device memory estimate: its parts counted by hand, the budget, the refusal of a config
that cannot fit (before any weight exists), and KV pages sized from what is left."""

import math

import jax
import pytest
from fixtures import smoke_config
from flax import nnx

from jaxrl import memory
from jaxrl.config import ConfigError
from jaxrl.mesh import get_rules, make_mesh
from jaxrl.models import Transformer
from jaxrl.rl import components
from jaxrl.rl.run import Run
from jaxrl.rollout.kv_cache import pages_for
from jaxrl.tokenizer import ByteTokenizer


def _estimate(cfg, devices: int = 1, **kw):
  model_cfg = components.model_config(cfg.model, ByteTokenizer())
  mesh = make_mesh(1, -1, 1, devices=jax.devices()[:devices])
  return model_cfg, memory.estimate(cfg, model_cfg, mesh, get_rules("fsdp_tp"), **kw)


def _param_elements(model_cfg, lora: bool = False) -> tuple[int, int]:
  """(all elements, elements of the matrices) of the model's params, or of its adapters."""
  state = nnx.state(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
  leaves = [
    v.get_value() for _, v in nnx.to_flat_state(state) if isinstance(v, nnx.LoRAParam) == lora
  ]
  return sum(x.size for x in leaves), sum(x.size for x in leaves if x.ndim >= 2)


def test_parts_by_hand_on_one_device(tmp_path):
  cfg = smoke_config(tmp_path, rl={"kl": {"beta": 0.05}})
  model_cfg, est = _estimate(cfg)
  n, _ = _param_elements(model_cfg)
  assert est.parts["params"] == 4 * n
  assert est.parts["gradients"] == 4 * n  # float32 accumulators, one micro-batch
  assert est.parts["optimizer"] == 2 * 4 * n  # AdamW's two float32 moments
  assert est.parts["reference"] == 4 * n  # float32 compute: the copy keeps float32
  assert est.parts["update"] == 2 * 4 * n  # the update and one new tree beside the old
  assert est.parts["checkpoint copy"] == 3 * 4 * n  # params and moments, written in the background
  sync = smoke_config(tmp_path, rl={"kl": {"beta": 0.05}}, checkpoint={"async_save": False})
  assert "checkpoint copy" not in _estimate(sync)[1].parts
  assert "sampler copy" not in est.parts  # the sampler reads the learner's own arrays
  rl = cfg.rl
  length = rl.max_prompt_len + rl.max_new_tokens
  tokens = rl.prompts_per_step * rl.group_size * length
  assert est.parts["logits"] == 3 * tokens * model_cfg.vocab_size * 4
  slots = max(rl.prompts_per_step * rl.group_size, cfg.eval.num_examples)
  pages = slots * pages_for(length, rl.rollout.page_size)
  k, h, layers = model_cfg.num_kv_heads, model_cfg.head_dim, model_cfg.num_layers
  assert est.kv_pages == pages
  assert est.parts["kv pages"] == pages * rl.rollout.page_size * layers * 2 * k * h * 4
  assert est.total == sum(est.parts.values())
  assert "kv pages" in est.table() and "per device" in est.table()


def test_mixed_precision_lora_chunked_logits_and_remat(tmp_path):
  base = dict(rl={"kl": {"beta": 0.05}})
  cfg = smoke_config(tmp_path, model={"dtype": "bfloat16", "param_dtype": "float32"}, **base)
  model_cfg, est = _estimate(cfg)
  n, matrices = _param_elements(model_cfg)
  # The frozen reference and the sampler's copy hold the matrices in bfloat16.
  assert est.parts["reference"] == 2 * matrices + 4 * (n - matrices)
  assert est.parts["sampler copy"] == 2 * matrices
  lora = smoke_config(tmp_path, model={"lora_rank": 4}, **base)
  lora_cfg, est_lora = _estimate(lora)
  adapters, _ = _param_elements(lora_cfg, lora=True)
  assert est_lora.parts["optimizer"] == 2 * 4 * adapters  # moments of the adapters only
  assert est_lora.parts["gradients"] == 4 * adapters
  chunked = smoke_config(tmp_path, model={"logits_chunk": 64, "remat": "full"})
  chunked_cfg, est_chunked = _estimate(chunked)
  assert est_chunked.parts["logits"] == 3 * 64 * chunked_cfg.vocab_size * 4
  _, est_plain = _estimate(smoke_config(tmp_path))
  # Full remat keeps each block's input and remakes one block's working set at a time.
  rl, layers = chunked.rl, chunked_cfg.num_layers
  tokens = rl.prompts_per_step * rl.group_size * (rl.max_prompt_len + rl.max_new_tokens)
  block = est_plain.parts["activations"] // layers
  assert est_chunked.parts["activations"] == layers * tokens * chunked_cfg.embed_dim * 4 + block


def test_fsdp_over_eight_devices_divides_the_sharded_params(tmp_path):
  cfg = smoke_config(tmp_path)
  _, one = _estimate(cfg, devices=1)
  _, eight = _estimate(cfg, devices=8)
  # Most of the tiny model's bytes are matrices split 8 ways; norms are replicated.
  assert one.parts["params"] / 8 <= eight.parts["params"] < one.parts["params"] / 4
  # A step's rows are split over the 8 devices too: 32 rows, 4 per device.
  assert "32 x 14 tokens" in one.notes["activations"]
  assert "4 x 14 tokens" in eight.notes["activations"]


def test_budget_is_memory_device_gb_or_the_hosts_share(tmp_path):
  cfg = smoke_config(tmp_path, memory={"device_gb": 1.5})
  assert memory.device_budget(cfg) == int(1.5 * 2**30)
  host = memory.device_budget(smoke_config(tmp_path), jax.devices()[:2])
  avail = memory._meminfo("MemAvailable")
  assert host is not None and abs(host - avail // 2) < 0.2 * avail  # two devices share it


def test_a_config_that_cannot_fit_stops_before_any_weight(tmp_path, monkeypatch):
  def no_weights(*a, **k):
    raise AssertionError("weights built for a config that cannot fit")

  monkeypatch.setattr(components, "build_model", no_weights)
  cfg = smoke_config(tmp_path, memory={"device_gb": 0.001})  # 1 MiB per device
  with pytest.raises(ConfigError) as e:
    Run.build(cfg)
  msg = str(e.value)
  assert "more than the 1.02 MiB it has" in msg
  for part in ("params", "gradients", "optimizer", "activations", "logits", "kv pages", "total"):
    assert part in msg
  assert "model.remat='full'" in msg and "model.logits_chunk" in msg
  # memory.check=False runs it anyway (the build goes on to the weights), and so does a run
  # that only reads its weights (export, evaluation: no optimizer, no step).
  with pytest.raises(AssertionError, match="weights built"):
    Run.build(cfg, writes=False)
  cfg = smoke_config(tmp_path, memory={"device_gb": 0.001, "check": False})
  with pytest.raises(AssertionError, match="weights built"):
    Run.build(cfg)


def test_kv_pages_from_a_fraction_of_what_is_left(tmp_path):
  cfg = smoke_config(tmp_path, memory={"device_gb": 0.0075}, rl={"rollout": {"kv_fraction": 0.5}})
  model_cfg, est = _estimate(cfg)
  rest = sum(b for name, b in est.parts.items() if name != "kv pages")
  rl = cfg.rl
  page_bytes = rl.rollout.page_size * model_cfg.num_layers * 2 * model_cfg.num_kv_heads
  page_bytes *= model_cfg.head_dim * 4
  want = math.floor(0.5 * (int(0.0075 * 2**30) - rest)) // page_bytes
  all_slots = 64 * pages_for(rl.max_prompt_len + rl.max_new_tokens, rl.rollout.page_size)
  assert est.kv_pages == min(want, all_slots) and 0 < est.kv_pages < all_slots
  # Too little left for one sequence: a clear error.
  tight = smoke_config(
    tmp_path, memory={"device_gb": 0.0072}, rl={"rollout": {"kv_fraction": 0.01}}
  )
  with pytest.raises(ConfigError, match="fewer than one sequence"):
    _estimate(tight)


@pytest.mark.integration
def test_the_engine_gets_the_pages_the_budget_sized(tmp_path):
  from jaxrl.rl.experience import build_sampler

  cfg = smoke_config(tmp_path, memory={"device_gb": 0.0075}, rl={"rollout": {"kv_fraction": 0.5}})
  run = Run.build(cfg)
  sampler = build_sampler(run)
  assert sampler.engine.num_pages == run.memory.kv_pages < 64 * 2  # fewer than every slot's
