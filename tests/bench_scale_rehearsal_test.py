"""bench/scale_rehearsal.py --smoke: every phase of the rehearsal at a tiny size, as one child."""

import json
import sys
from pathlib import Path

import pytest
from helpers import run_child

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parent.parent


def test_smoke_runs_every_phase_and_resumes_bit_identically(tmp_path):
  cmd = [sys.executable, "bench/scale_rehearsal.py", "--smoke", f"--out={tmp_path}"]
  out = run_child([*cmd, f"--workdir={tmp_path / 'work'}"], cwd=ROOT)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
  report = json.loads((tmp_path / "scale_rehearsal_smoke.json").read_text())
  phases = report["phases"]
  assert list(phases) == [
    "data", "tokenizer", "checkpoint", "sft", "rl", "resume", "export", "hf_reload",
  ]  # fmt: skip
  for name, phase in phases.items():
    assert phase["wall_s"] > 0, name

  # A Qwen3 checkpoint as transformers saves one: bfloat16 safetensors in 2 or more shards.
  ckpt = phases["checkpoint"]
  assert ckpt["model_class"] == "Qwen3ForCausalLM"
  assert len(ckpt["shards"]) >= 2 and ckpt["shard_dtypes"] == ["BF16"]
  assert ckpt["config"]["dtype"] == "bfloat16" and ckpt["config"]["tie_word_embeddings"]
  assert ckpt["jaxrl_config"]["num_layers"] == 2 and ckpt["jaxrl_config"]["vocab_size"] == 2048

  # The tokenizer beside it: the chat template, and <|im_end|> ending SFT's demonstrations and
  # generation (with <|endoftext|> from generation_config.json), as jaxrl reads the directory.
  tok = phases["tokenizer"]
  assert "chat_template.jinja" in tok["files"] and "tokenizer.json" in tok["files"]
  read = tok["jaxrl"]
  assert read["has_chat_template"] and read["example_prompt"].endswith("<|im_start|>assistant\n")
  assert read["sft_appends"] == "<|im_end|>" and read["stops_on_end_of_turn"]
  assert read["stop_tokens"] == ["<|im_end|>", "<|endoftext|>"]
  # The embedding is padded past the tokenizer, as real checkpoints are: the random policy
  # draws those rows, and they decode to nothing.
  assert tok["vocab_size"] < 2048

  # RL ran through the engine: groups of 4, 128 new tokens, bfloat16 compute over float32
  # masters, every step logged with its timings.
  settings = report["settings"]
  assert settings["sizes"]["group_size"] >= 4 and settings["sizes"]["max_new_tokens"] >= 128
  overrides = report["results"]["overrides"]
  for o in ("rl.group_size=4", "rl.max_new_tokens=128", "model.dtype=bfloat16",
            "model.param_dtype=float32", "model.remat=full", "model.scan_layers=True"):  # fmt: skip
    assert o in overrides, o
  rl = phases["rl"]
  assert [s["step"] for s in rl["steps"]] == [1, 2]
  assert all(s["generated_tokens"] > 0 and "time/rollout_s" in s["time"] for s in rl["steps"])
  assert rl["compile"]["compilations"] > 0 and rl["peak_rss_mb"] > 0
  assert isinstance(report["results"]["memory_estimate"], dict)

  # SIGKILL after the first RL checkpoint, the same command again: bit for bit the
  # uninterrupted run (final checkpoint and every metric row but the timings).
  resume = phases["resume"]
  assert resume["kill_landed"] and resume["resumed_from_step"] == 1
  assert resume["identical"], resume["problems"]
  assert resume["first_difference"] is None

  # launch.export writes the float32 masters with the tokenizer files; transformers' logits
  # of the export match jaxrl's own forward of it.
  export = phases["export"]
  assert export["shard_dtypes"] == ["F32"] and "chat_template.jinja" in export["files"]
  reload = phases["hf_reload"]
  assert reload["max_abs_diff"] < 1e-4 and reload["within_bound"]
