"""The mesh, memory and model sections of the run config (re-exported by `jaxrl.config`)."""

from __future__ import annotations

import dataclasses

from jaxrl.config_fields import option as _field
from jaxrl.kernels import KERNELS
from jaxrl.models.config import REMAT_POLICIES


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = _field(1, help="-1 = all remaining devices")
  fsdp: int = _field(-1, help="devices the params are sharded over (-1 = all remaining)")
  tensor: int = _field(1, help="devices each matmul is split over (heads, MLP columns)")
  expert: int = _field(
    1,
    help="MoE expert parallelism: > 1 adds an 'expert' mesh axis that splits the experts (and "
    "the batch); tokens go to their experts' devices by all-to-all (jaxrl.models.moe)",
  )
  devices: int = _field(
    0,
    lo=0,
    help="how many of the devices the run takes, the first ones (0 = all; one process only): "
    "the mesh's sizes multiply to it",
  )
  rules: str = _field(
    "fsdp_tp",
    choices=("fsdp_tp", "replicated"),
    help="the logical-axis rules table (jaxrl.mesh): FSDP + tensor parallel, or all replicated",
  )


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
  """What a device may hold (jaxrl.memory): before any weight is read the run prints its
  estimate of each part per device, refuses a config that cannot fit, and can size the
  engine's KV pages from what is left (rl.rollout.kv_fraction)."""

  device_gb: float = _field(
    0.0,
    lo=0.0,
    help="memory per device the run may use, in GiB; 0 = the device's own (an accelerator's "
    "memory_stats bytes_limit; on a CPU the host's available memory over its devices)",
  )
  check: bool = _field(
    True,
    help="stop before the first step when the estimate exceeds device_gb, naming the parts "
    "and what to change",
  )


@dataclasses.dataclass(frozen=True)
class ModelSection:
  preset: str = _field("arith_small", help="a jaxrl.models.config preset; ignored with path")
  path: str = _field("", help="an HF checkpoint directory (config.json + safetensors)")
  tokenizer: str = _field("", help="'byte', an HF tokenizer directory, or '' = path or byte")
  dtype: str = _field(
    "float32",
    choices=("float32", "bfloat16"),
    help="the compute: activations and the operands of every matmul (the learner's, the "
    "reference's and the sampler's); bfloat16 on accelerators",
  )
  param_dtype: str = _field(
    "float32",
    choices=("float32", "bfloat16"),
    help="the stored weights, which the optimizer updates and which every forward casts to "
    "dtype: float32 master weights train at RL learning rates; in bfloat16 an AdamW update "
    "under ~1/256 of a weight rounds away (at 1e-6 almost no weight moves). With a lower "
    "dtype the sampler reads a copy cast once per step",
  )
  max_seq_len: int = _field(0, lo=0, help="override the preset's context length; 0 = keep")
  lora_rank: int = _field(0, lo=0, help="LoRA adapters of this rank (0 = full fine-tuning)")
  lora_alpha: float = _field(16.0, lo=0.0, lo_open=True, help="LoRA scale alpha / rank")
  lora_targets: str = _field("q,k,v,o,gate,up,down", help="comma-separated projections")
  scan_layers: bool = _field(
    False,
    help="run the blocks of a full forward (learner, reference, critic) as one jax.lax.scan: "
    "the forward's compile time stays flat in depth (params keep their per-layer layout)",
  )
  remat: str = _field(
    "none",
    choices=REMAT_POLICIES,
    help="recompute each block's activations on the backward pass (jax.checkpoint policy)",
  )
  logits_chunk: int = _field(
    0,
    lo=0,
    help="tokens per chunk of the learner's log-prob head (loss, reference and old log-probs, "
    "entropy): each chunk's [tokens, vocab] float32 logits are made, used and remade on the "
    "backward pass on their own, so the whole batch's never exist at once (same values and "
    "gradients); 0 = all at once. Worth it where batch tokens x vocab x 4 bytes is a large "
    "share of the device's memory",
  )
  attention_kernel: str = _field(
    "reference",
    choices=KERNELS["attention_kernel"],
    help="the rollout engine's paged attention: 'reference' (jnp, gathers each sequence's "
    "pages) or a Pallas kernel that reads pages in place: 'pallas_tpu' (Mosaic TPU) or "
    "'pallas_gpu' (JAX's Triton decode kernel; decode steps of full-attention layers; needs a "
    "power-of-two head_dim)",
  )
  moe_kernel: str = _field(
    "reference",
    choices=KERNELS["moe_kernel"],
    help="MoE experts' grouped matmul: 'reference' (jax.lax.ragged_dot), 'tiled' (the same in "
    "row tiles as one batched jnp matmul: several times faster on a CPU), the megablox-style "
    "Pallas kernel ('pallas_tpu') or its Triton counterpart ('pallas_gpu'); 'auto' picks the "
    "backend's kernel, or 'tiled' on a CPU",
  )
  matmul_kernel: str = _field(
    "reference",
    choices=KERNELS["matmul_kernel"],
    help="a quantized sampler's W8A8 projections (rl.rollout.quantize int8/fp8/fp8_e5m2): "
    "'reference' (XLA dot) or a Pallas kernel ('pallas_tpu', 'pallas_gpu')",
  )
  kernel_interpret: bool = _field(
    False,
    help="run the Pallas kernels chosen above through the Pallas interpreter (any backend; "
    "slow: for tests and debugging)",
  )
