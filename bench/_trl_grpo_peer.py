"""TRL GRPOTrainer step timing; runs in bench/.venv-trl (torch CPU), driven by grpo_step.py.

Usage: bench/.venv-trl/bin/python bench/_trl_grpo_peer.py REQUEST.json
The request is grpo_step.py's (checkpoint, prompts [P, L], G, the fixed completions [P * G, N] and
advantages [P * G], GRPO and optimizer settings). The child builds a `trl.GRPOTrainer` on the
checkpoint (TRL makes the frozen reference model itself, since beta > 0) with its AdamW optimizer
and constant schedule, then answers one JSON line per command read from stdin:

  ready  versions and notes
  train  one train step on the fixed completions, as the trainer runs it after a rollout: the
         reference log-probs (`_get_per_token_logps_and_entropies` on `ref_model`, no grad), then
         what Trainer's inner loop does per step: `compute_loss` (policy forward, GRPO loss),
         `accelerator.backward`, gradient clipping, `optimizer.step`, `lr_scheduler.step`,
         `zero_grad`
  full   one whole step: `_generate_and_score_completions` (HF generate, reward, advantages,
         reference log-probs) on the G-times-repeated prompt rows, then the same update
  quit

Each answer holds the call's own seconds (the pipe is not timed). torch float32 on CPU, all
cores (torch.set_num_threads(request threads)). Standalone: this venv has TRL, not jaxrl.
bench/device_rehearsal.py runs it on a GPU with the optional request keys `use_cpu` (default
true), `bf16` (autocast over the float32 weights; default false) and `gradient_checkpointing`
(default false); its train answers then carry the CUDA peak bytes.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

TAG = "@@trl-grpo "  # grpo_step.TRL_TAG


def id_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
  """Token ids written as space-separated numbers, so TRL tokenizes exactly our tokens. The EOS
  (also the pad) is one id past the model's vocabulary: never sampled, so every completion runs
  the full length, as in the other peers."""
  vocab = {str(i): i for i in range(vocab_size)}
  vocab["<eos>"] = vocab_size
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return PreTrainedTokenizerFast(
    tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<eos>"
  )


def parity_reward(prompts, completions, **_):
  """The benchmark's reward (grpo_step.parity_reward): the share of even token ids."""
  out = []
  for text in completions:
    ids = [int(t) for t in text.split() if t.isdigit()]
    out.append(sum(t % 2 == 0 for t in ids) / max(len(ids), 1))
  return out


def main(request_path: str) -> None:
  req = json.loads(Path(request_path).read_text())
  torch.set_num_threads(req["threads"])
  torch.manual_seed(0)
  ckpt = req["checkpoint"]
  g, n = req["group_size"], req["new_tokens"]
  prompts = torch.as_tensor(req["prompts"], dtype=torch.long)  # [P, L]
  rows = prompts.repeat_interleave(g, dim=0)  # [P * G, L], prompt-major
  completions = torch.as_tensor(req["completions"], dtype=torch.long)  # [P * G, N]
  advantages = torch.as_tensor(req["advantages"], dtype=torch.float32)  # [P * G]
  model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
  tokenizer = id_tokenizer(model.config.vocab_size)
  texts = [" ".join(str(int(t)) for t in row) for row in prompts]
  out_dir = tempfile.TemporaryDirectory()
  args = GRPOConfig(
    output_dir=out_dir.name,
    per_device_train_batch_size=rows.shape[0],
    gradient_accumulation_steps=1,
    steps_per_generation=1,
    num_generations=g,
    num_iterations=1,
    max_completion_length=n,
    temperature=1.0,
    top_p=1.0,
    beta=req["beta"],
    epsilon=req["epsilon"],
    loss_type="bnpo",  # sum of the batch's token losses / its token count, as jaxrl's token-mean
    learning_rate=req["learning_rate"],
    weight_decay=req["weight_decay"],
    adam_beta1=0.9,
    adam_beta2=0.999,
    max_grad_norm=req["grad_clip"],
    lr_scheduler_type="constant",
    warmup_steps=0,
    max_steps=10**6,
    use_cpu=req.get("use_cpu", True),
    bf16=req.get("bf16", False),
    fp16=False,
    report_to="none",
    logging_steps=10**6,
    save_strategy="no",
    seed=0,
    # Only when asked: newer transformers warn that the argument is deprecated.
    **({"gradient_checkpointing": True} if req.get("gradient_checkpointing") else {}),
  )
  trainer = GRPOTrainer(
    model=model,
    reward_funcs=parity_reward,
    args=args,
    train_dataset=Dataset.from_dict({"prompt": texts}),
    processing_class=tokenizer,
  )
  trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
  trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before its steps
  model = trainer.model
  model.train()
  device = trainer.accelerator.device
  rows, completions, advantages = rows.to(device), completions.to(device), advantages.to(device)
  ref_model = trainer.ref_model
  steps = 0

  def update(inputs) -> None:
    nonlocal steps
    loss = trainer.compute_loss(model, inputs)
    trainer.accelerator.backward(loss)
    trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad(set_to_none=True)
    steps += 1

  def train_step() -> dict:
    ids = torch.cat([rows, completions], dim=1)
    attention = torch.ones_like(ids)
    with torch.no_grad():
      ref, _, _ = trainer._get_per_token_logps_and_entropies(
        ref_model, ids, attention, n, batch_size=ids.shape[0]
      )
    mask = torch.ones_like(completions)
    inputs = {
      "prompt_ids": rows,
      "prompt_mask": torch.ones_like(rows),
      "completion_ids": completions,
      "completion_mask": mask,
      "advantages": advantages,
      "num_items_in_batch": mask.sum(),
      "ref_per_token_logps": ref,
    }
    update(inputs)
    return {}

  def full_step() -> dict:
    batch = [{"prompt": t} for t in texts for _ in range(g)]
    inputs = trainer._generate_and_score_completions(batch)
    update(inputs)
    return {"lengths": inputs["completion_mask"].sum(dim=1).tolist()}

  versions = {
    "trl": importlib.metadata.version("trl"),
    "trl_torch": torch.__version__,
    "trl_transformers": importlib.metadata.version("transformers"),
    "trl_accelerate": importlib.metadata.version("accelerate"),
  }
  notes = (
    f"GRPOTrainer, torch threads {torch.get_num_threads()}, loss_type bnpo, k3 KL; train = "
    "ref logps + compute_loss + backward + clip + AdamW step; full = "
    "_generate_and_score_completions (HF generate) + the same update"
  )

  def answer(obj) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()

  for line in sys.stdin:
    command = line.strip()
    if command == "ready":
      answer({"versions": versions, "notes": notes})
    elif command in ("train", "full"):
      t0 = time.perf_counter()
      extra = (train_step if command == "train" else full_step)()
      if torch.cuda.is_available():
        torch.cuda.synchronize()  # the step's kernels are queued, not done, when it returns
        extra["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
      seconds = time.perf_counter() - t0
      answer({"seconds": seconds, "steps": steps, **extra})
    elif command == "quit":
      out_dir.cleanup()
      return
    else:
      raise ValueError(f"unknown command {command!r}; allowed: ready, train, full, quit")


if __name__ == "__main__":
  if len(sys.argv) != 2:
    raise SystemExit(__doc__)
  main(sys.argv[1])
