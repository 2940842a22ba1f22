"""GRPO on byte-level arithmetic with a tiny Qwen3-shaped model: the embedded default.

Launch (installs into .venv on first use):
  bash launch/train.sh                                    # = --config=configs/grpo_arith.py
  bash launch/train.sh --config=configs/grpo_arith.py:smoke --config.rl.kl.beta=0.0
  python -m launch.train --config=configs/grpo_arith.py --config.workdir=/tmp/arith

The warm-start imitates a careless teacher: 60% of its demonstrations of problems that need a
carry or borrow are written with it forgotten (27+15=32, 42-15=33), the rest correctly; RL's
exact-match reward and the held-out set use the true answers. SFT learns the teacher's habit,
and GRPO has to unlearn it from the reward alone.

Expected on a 2-core CPU (seeds 0-4, README and docs/results.md): held-out greedy accuracy 0.00
at init; 0.637 (0.566-0.729) after the 1,200-step warm-start, 65-83% of the carry problems
answered with the teacher's slip; 0.914 (0.873-0.988) after 200 GRPO steps, 0.5-7% careless
(mean, min-max over 10 runs on an Intel Xeon: seeds 0-4 on XLA's AVX-512 and AVX2 code paths),
GRPO adding +0.240 to +0.312 on every run. On an AMD EPYC with AVX-512 (other rounding):
0.911 (0.840-0.982), +0.205 to +0.338. About 6-7 minutes alone on a 2-core VM.
The same seed repeats bit for bit on the same CPU type. `:smoke` takes well under a minute and
only checks that everything moves.
"""

import ml_collections

from jaxrl.config import complete


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.workdir = "runs/grpo_arith"
  c.resume = True

  c.mesh = dict(data=1, fsdp=-1, tensor=1, rules="fsdp_tp")
  c.model = dict(preset="arith_small", dtype="float32")
  c.task = dict(name="arithmetic", max_digits=2, ops="+-", held_out_fraction=0.1,
                allow_negative=False, operand_dist="uniform")  # fmt: skip
  c.reward = dict(name="exact_match", on_error="raise")

  # The warm-start has to get past the phase where the model learns carries: at lr 3e-3 x 64 x
  # 900 it ended on that slope (0.15-0.83 held-out over seeds and CPU types). lr 1e-3, b2 0.99,
  # twice the problems per step and 1,200 steps end past it on every seed (docs/results.md).
  # Learnt from correct demonstrations only, it then left GRPO nothing to do (0.97 -> 0.98);
  # from a careless teacher's it ends wrong on most carry problems, in a way a reward can fix.
  c.sft = dict(steps=1200, batch_size=128, learning_rate=1e-3, warmup_steps=20, weight_decay=0.0,
               b2=0.99, num_microbatches=1, operand_dist="by_digits",
               careless_rate=0.6)  # fmt: skip
  c.rl = dict(
    steps=200,
    prompts_per_step=64,
    group_size=8,
    max_prompt_len=8,  # BOS + "99+99=" + 1 spare
    max_new_tokens=6,  # "198" + EOS + 2 spare: a wrong, longer answer is scored, not cut
    advantage="grpo",
    scale_by_std=True,
    sampling=dict(temperature=1.0, top_k=0, top_p=1.0),
    loss=dict(
      name="ppo_clip",
      aggregation="token-mean",
      eps_low=0.2,
      eps_high=0.2,
      dual_clip_c=3.0,
      entropy_coef=0.0,
    ),  # fmt: skip
    kl=dict(beta=0.0, estimator="k3", in_reward=False),
    optim=dict(
      learning_rate=1e-4,
      schedule="constant",
      warmup_steps=5,
      weight_decay=0.0,
      b2=0.999,
      grad_clip=1.0,
    ),  # fmt: skip
    num_microbatches=1,
    num_minibatches=1,
    ppo_epochs=1,
    # Most groups of 8 end all-correct (zero advantage, no gradient): the update runs over the
    # other rows only and is the same, at a fraction of the train step's compute.
    skip_zero_advantage="auto",
    # The engine, every sample of a step in its own slot: the 64 prompts (one length bucket)
    # are prefilled in one call and all 512 samples decode side by side.
    rollout=dict(
      batching="continuous",
      slots=0,
      page_size=16,
      num_pages=0,
      steps_per_call=8,
      quantize="none",
    ),
  )
  # Greedy accuracy, and the accuracy of 2 samples per problem at the RL temperature: the
  # expected reward RL raises, which still moves where greedy accuracy has reached its ceiling.
  c.eval = dict(every=10, num_examples=512, num_samples=2)
  c.checkpoint = dict(every=50, max_to_keep=2)
  c.log = dict(progress=True, tensorboard=True)

  if arg == "smoke":
    c.workdir = "runs/grpo_arith_smoke"
    c.sft.steps = 60
    c.sft.batch_size = 32
    # A minute's pipeline check: the faster (knife-edge) rate makes 60 steps move visibly, on
    # correct demonstrations (from the careless teacher's, 60 steps get no held-out answer
    # right on the AVX2 code path).
    c.sft.learning_rate = 3e-3
    c.sft.b2 = 0.999
    c.sft.careless_rate = 0.0
    c.rl.steps = 6
    c.rl.prompts_per_step = 8
    c.rl.group_size = 4
    c.eval.every = 0  # before SFT, before RL and after it
    c.eval.num_examples = 64
    c.checkpoint.every = 20  # SFT at 20, 40, 60; RL at its last step
  elif arg:
    raise ValueError(f"unknown config variant {arg!r}; valid: '' (full) or 'smoke'")
  return complete(c)
