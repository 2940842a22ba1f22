"""GRPO on GSM8K with a Hugging Face checkpoint (default Qwen2.5-0.5B-Instruct), chat-templated.

Launch (the checkpoint and data are local files: nothing is downloaded):
  bash launch/train.sh --config=configs/grpo_gsm8k.py \
    --config.model.path=/path/to/Qwen2.5-0.5B-Instruct \
    --config.task.path=/path/to/gsm8k/train.jsonl --config.task.held_out_path=/path/to/test.jsonl
  bash launch/train.sh --config=configs/grpo_gsm8k.py:smoke     # tiny random model, synthetic data

GSM8K JSONL lines are {"question": ..., "answer": "... #### 72"} (the openai/gsm8k layout); the
reward is `gsm8k` (final number after '####', in \\boxed{}, or the last number). Any supported
family loads the same way (Llama 3, Qwen2/2.5, Qwen3, Gemma 3, Qwen3-MoE, Mixtral); the tokenizer
and chat template come from the checkpoint directory.

Precision: the learner computes in bfloat16 over float32 master weights and optimizer state
(model.dtype / model.param_dtype; bfloat16 storage would round this config's 1e-6 updates away),
and the sampler reads a bfloat16 copy of the matrices made once per step. Memory: every block is
rematerialised on the backward pass and the log-prob head runs 1024 tokens at a time, so a step
never holds the batch's [tokens x vocab] logits.

Expected: the full config is sized for an accelerator (32 prompts x 8 samples x up to 512 new
tokens per step) and has not been run yet (this project's machines are 2-core CPUs without model
downloads): the held-out accuracy before RL is the checkpoint's own and should rise over the
first few hundred steps; watch eval/accuracy and rl/reward_mean. `:smoke` swaps in the tiny
random preset, the byte tokenizer and generated GSM8K-format word problems and runs in about a
minute on a CPU; its accuracy stays at 0 (it checks that everything runs, not that it learns).
"""

import ml_collections

from jaxrl.config import complete

SYSTEM_PROMPT = (
  "Solve the math problem step by step. End with the final answer as a number after '####'."
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.workdir = "runs/grpo_gsm8k"
  c.resume = True

  c.mesh = dict(data=1, fsdp=-1, tensor=1, rules="fsdp_tp")
  c.model = dict(
    preset="qwen2p5_0p5b_instruct", path="checkpoints/Qwen2.5-0.5B-Instruct", tokenizer="",
    dtype="bfloat16", param_dtype="float32", max_seq_len=0, remat="full", scan_layers=True,
    logits_chunk=1024,
  )  # fmt: skip
  c.task = dict(
    name="jsonl", path="data/gsm8k/train.jsonl", held_out_path="data/gsm8k/test.jsonl",
    prompt_field="question", answer_field="answer", answer_format="gsm8k",
    prompt_template="{prompt}", chat=True, system_prompt=SYSTEM_PROMPT,
  )  # fmt: skip
  c.reward = dict(name="gsm8k", on_error="zero")

  c.sft = dict(steps=0, batch_size=32, learning_rate=1e-5, warmup_steps=0)  # instruct: no SFT
  c.rl = dict(
    steps=500,
    prompts_per_step=32,
    group_size=8,
    max_prompt_len=256,
    max_new_tokens=512,
    advantage="grpo",
    sampling=dict(temperature=1.0),
    loss=dict(name="ppo_clip", aggregation="token-mean", eps_low=0.2, eps_high=0.28),
    kl=dict(beta=0.001, estimator="k3"),
    optim=dict(learning_rate=1e-6, schedule="constant", warmup_steps=10, grad_clip=1.0),
    num_microbatches=8,
    rollout=dict(batching="continuous", slots=0, page_size=16, steps_per_call=16, quantize="none"),
  )
  c.eval = dict(every=25, num_examples=512)
  c.checkpoint = dict(every=25, max_to_keep=2)
  c.log = dict(progress=True, tensorboard=True)

  if arg == "smoke":
    c.workdir = "runs/grpo_gsm8k_smoke"
    c.model = dict(preset="tiny", path="", tokenizer="byte", dtype="float32", max_seq_len=320,
                   remat="none", scan_layers=False, logits_chunk=0)  # fmt: skip
    c.task = dict(name="word_problems", num_problems=200, held_out_fraction=0.1,
                  prompt_template="Q: {prompt}\nA:", chat=False)  # fmt: skip
    c.sft = dict(steps=30, batch_size=16, learning_rate=3e-3, warmup_steps=5)
    c.rl.steps = 3
    c.rl.prompts_per_step = 4
    c.rl.group_size = 2
    c.rl.max_prompt_len = 192  # the longest generated problem is 163 bytes with the template
    c.rl.max_new_tokens = 128  # the SFT solutions (up to 115 bytes with EOS) must fit
    c.rl.kl.beta = 0.001
    c.rl.optim.learning_rate = 1e-4
    c.rl.num_microbatches = 1
    c.rl.rollout.steps_per_call = 8
    c.eval = dict(every=3, num_examples=8)
    c.checkpoint = dict(every=3, max_to_keep=1)
  elif arg:
    raise ValueError(f"unknown config variant {arg!r}; valid: '' (full) or 'smoke'")
  return complete(c)
