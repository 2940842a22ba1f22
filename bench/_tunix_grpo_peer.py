"""Tunix GRPO step timing; runs in bench/.venv-tunix, driven by grpo_step.py.

Usage: bench/.venv-tunix/bin/python bench/_tunix_grpo_peer.py REQUEST.json
The request names an HF-format Qwen3 checkpoint, the prompts [P, L] (each repeated G times), the
fixed completions [P * G, N] and advantages [P * G] of the train-step measurement, and the GRPO
settings. The child builds an `RLCluster` (actor, frozen reference, vanilla rollout) and a
`GRPOLearner`, then answers one JSON line per command read from stdin:

  ready  versions and notes
  train  one train step on the fixed completions, as the learner runs it after a rollout:
         `rl_cluster.get_ref_per_token_logps` (reference forward), then `rl_cluster.update_actor`
         on the `TrainExample` (its PeftTrainer's jitted loss + grad + optax update, once)
  full   one whole step: `GRPOLearner._generate_and_compute_advantage` (rollout with the vanilla
         sampler, reward, advantages, reference log-probs), then `update_actor`
  quit

Each answer holds the call's own seconds (the pipe is not timed), the number of optimizer steps
taken so far, and for `full` the completion lengths. The first call of each kind includes its
compilation; the parent reports it as the first step. Standalone: this venv has Tunix, not jaxrl.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _compile_log import CompileLog
from _tunix_peer import IdTokenizer, tunix_config
from tunix.models.qwen3 import params as qwen3_params
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

TAG = "@@tunix-grpo "  # grpo_step.TUNIX_TAG


def parity_reward(prompts, completions, **_):
  """The benchmark's reward (grpo_step.parity_reward): the share of even token ids."""
  out = []
  for text in completions:
    ids = [int(t) for t in text.split()]
    out.append(sum(t % 2 == 0 for t in ids) / max(len(ids), 1))
  return out


def main(request_path: str) -> None:
  req = json.loads(Path(request_path).read_text())
  ckpt = req["checkpoint"]
  hf = json.loads((Path(ckpt) / "config.json").read_text())
  cfg = tunix_config(hf)
  actor = qwen3_params.create_model_from_safe_tensors(ckpt, cfg, dtype=jnp.float32)
  reference = qwen3_params.create_model_from_safe_tensors(ckpt, cfg, dtype=jnp.float32)
  prompts = np.asarray(req["prompts"], np.int32)  # [P, L]
  g, n = req["group_size"], req["new_tokens"]
  completions = np.asarray(req["completions"], np.int32)  # [P * G, N]
  advantages = np.asarray(req["advantages"], np.float32)  # [P * G]
  rows = np.repeat(prompts, g, axis=0)  # prompt-major, as Tunix repeats a batch's prompts
  # A pad id outside the vocabulary (see _tunix_peer.py); EOS likewise, so every completion
  # has exactly N tokens (Tunix's completion mask is `token != pad`).
  pad_id = -1
  tokenizer = IdTokenizer(pad_id=pad_id, eos_id=req["eos_id"])
  # One CPU device. Auto axes (jax.make_mesh defaults to Explicit ones, under which Tunix's
  # embedding lookup cannot resolve its output sharding).
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  optimizer = optax.chain(
    optax.clip_by_global_norm(req["grad_clip"]),
    optax.adamw(req["learning_rate"], b1=0.9, b2=0.999, weight_decay=req["weight_decay"]),
  )
  cluster_config = rl_cluster_lib.ClusterConfig(
    role_to_mesh={
      rl_cluster_lib.Role.ACTOR: mesh,
      rl_cluster_lib.Role.REFERENCE: mesh,
      rl_cluster_lib.Role.ROLLOUT: mesh,
    },
    rollout_engine="vanilla",
    offload_to_cpu=False,
    training_config=rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optimizer,
      eval_every_n_steps=10**9,
      max_steps=10**9,
    ),
    rollout_config=base_rollout.RolloutConfig(
      max_tokens_to_generate=n,
      max_prompt_length=prompts.shape[1],
      kv_cache_size=prompts.shape[1] + n,
      temperature=1.0,
      top_p=1.0,
      eos_tokens=[req["eos_id"]],
    ),
  )
  cluster = rl_cluster_lib.RLCluster(
    actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=cluster_config
  )
  algo = grpo_learner.GRPOConfig(
    num_generations=g,
    num_iterations=1,
    beta=req["beta"],
    epsilon=req["epsilon"],
    kl_loss_mode="low_var_kl",  # k3, as jaxrl's and TRL's KL
    loss_agg_mode="token-mean",
  )
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=parity_reward, algo_config=algo)
  # What GRPOLearner.train sets from its first batch (sizes in prompts; the learner multiplies
  # them by G): one rollout and one log-prob call over the whole batch.
  learner._rollout_micro_batch_size = prompts.shape[0]
  learner._compute_logps_micro_batch_size = prompts.shape[0]
  prompt_ids = jnp.asarray(rows)
  completion_ids = jnp.asarray(completions)

  def train_step() -> dict:
    ref = cluster.get_ref_per_token_logps(
      prompt_tokens=prompt_ids,
      completion_tokens=completion_ids,
      pad_id=pad_id,
      eos_id=req["eos_id"],
    )
    example = grpo_learner.TrainExample(
      prompt_ids=prompt_ids,
      prompt_mask=prompt_ids != pad_id,
      completion_ids=completion_ids,
      completion_mask=completion_ids != pad_id,
      ref_per_token_logps=ref,
      advantages=jnp.asarray(advantages),
      old_per_token_logps=None,
    )
    cluster.update_actor([example], None)
    jax.block_until_ready(nnx_params())
    return {}

  def full_step() -> dict:
    texts = [tokenizer.decode(r) for r in rows]
    example = learner._generate_and_compute_advantage({"prompts": texts})
    cluster.update_actor([example], None)
    jax.block_until_ready(nnx_params())
    lengths = np.asarray(example.completion_mask).sum(axis=1)
    return {"lengths": lengths.tolist()}

  def nnx_params():
    from flax import nnx

    return nnx.state(cluster.actor_trainer.model, nnx.Param)

  versions = {
    "tunix": importlib.metadata.version("google-tunix"),
    "tunix_jax": jax.__version__,
    "tunix_flax": importlib.metadata.version("flax"),
    "tunix_optax": importlib.metadata.version("optax"),
  }
  notes = (
    "RLCluster (actor, reference, vanilla rollout) + GRPOLearner; train = "
    "get_ref_per_token_logps + update_actor; full = _generate_and_compute_advantage + "
    "update_actor; loss_agg_mode token-mean, kl low_var_kl (k3)"
  )

  def answer(obj) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()

  cold = True
  for line in sys.stdin:
    command = line.strip()
    if command == "ready":
      answer({"versions": versions, "notes": notes})
    elif command in ("train", "full"):
      compile_log = CompileLog() if cold else None  # the first call: where its compiles go
      cold = False
      t0 = time.perf_counter()
      with compile_log or contextlib.nullcontext():
        extra = (train_step if command == "train" else full_step)()
      if compile_log:
        extra["compile"] = compile_log.summary()
      seconds = time.perf_counter() - t0
      answer({"seconds": seconds, "steps": int(cluster.actor_trainer.train_steps), **extra})
    elif command == "quit":
      return
    else:
      raise ValueError(f"unknown command {command!r}; allowed: ready, train, full, quit")


if __name__ == "__main__":
  if len(sys.argv) != 2:
    raise SystemExit(__doc__)
  main(sys.argv[1])
