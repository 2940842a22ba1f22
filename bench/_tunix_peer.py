"""Tunix `Sampler` decode timing; runs in bench/.venv-tunix, driven by decode_throughput.py.

Usage: bench/.venv-tunix/bin/python bench/_tunix_peer.py REQUEST.json
The request names an HF-format Qwen3 checkpoint, the prompt tokens [B, P], the number of new
tokens and the warm-up call count. The child loads the model, warms up, then answers one line
per command read from stdin: `ready` (versions and notes), `call` (decode once: its seconds and
tokens [B, N]), `quit`. Answers are single JSON lines tagged with TAG, so anything else the
libraries print on stdout is skipped by the parent. The parent interleaves these calls with
its other peers' (decode_throughput.py says why). Standalone on purpose: this venv has Tunix,
not jaxrl.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3_model
from tunix.models.qwen3 import params as qwen3_params

TUNIX_ROPE_THETA = 1_000_000
TAG = "@@tunix "  # decode_throughput.TUNIX_TAG


class IdTokenizer:
  """Prompts travel as space-separated token ids, so the Sampler sees exactly our tokens.

  No BOS is prepended (bos_id is None). The pad id must be a token the model can never emit:
  Tunix masks every cache column whose token equals pad_id, generated ones included.
  """

  def __init__(self, pad_id: int, eos_id: int):
    self._pad, self._eos = pad_id, eos_id

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(t)) for t in ids)

  def bos_id(self):
    return None

  def eos_id(self) -> int:
    return self._eos

  def pad_id(self) -> int:
    return self._pad


def tunix_config(hf: dict) -> qwen3_model.ModelConfig:
  """Tunix's Qwen3 config for an HF config.json (dense, float32)."""
  rope = hf.get("rope_parameters") or {}
  theta = rope.get("rope_theta", hf.get("rope_theta", 10_000))
  if theta != TUNIX_ROPE_THETA:
    # Tunix 0.1.7's Qwen3 attention calls apply_rope with its default theta, not the config's.
    raise ValueError(f"rope_theta={theta}: Tunix's Qwen3 only runs rope_theta={TUNIX_ROPE_THETA}")
  return qwen3_model.ModelConfig(
    num_layers=hf["num_hidden_layers"],
    vocab_size=hf["vocab_size"],
    embed_dim=hf["hidden_size"],
    hidden_dim=hf["intermediate_size"],
    num_heads=hf["num_attention_heads"],
    head_dim=hf["head_dim"],
    num_kv_heads=hf["num_key_value_heads"],
    rope_theta=TUNIX_ROPE_THETA,
    norm_eps=hf["rms_norm_eps"],
    use_tied_embedding=hf["tie_word_embeddings"],
    dtype=jnp.float32,
    param_dtype=jnp.float32,
  )


def main(request_path: str) -> None:
  req = json.loads(Path(request_path).read_text())
  ckpt = req["checkpoint"]
  hf = json.loads((Path(ckpt) / "config.json").read_text())
  cfg = tunix_config(hf)
  model = qwen3_params.create_model_from_safe_tensors(ckpt, cfg, dtype=jnp.float32)
  prompts = np.asarray(req["prompts"], np.int32)  # [B, P]
  b, p = prompts.shape
  n = req["new_tokens"]
  # Tunix never emits pad; a pad outside the vocabulary keeps generated tokens attendable.
  pad_id = -1
  tokenizer = IdTokenizer(pad_id=pad_id, eos_id=req["eos_id"])
  cache = sampler_lib.CacheConfig(
    cache_size=p + n,
    num_layers=cfg.num_layers,
    num_kv_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
  )
  sampler = sampler_lib.Sampler(model, tokenizer, cache)
  texts = [tokenizer.decode(row) for row in prompts]

  def call() -> np.ndarray:
    out = sampler(
      texts,
      max_generation_steps=n,
      max_prompt_length=p,
      eos_tokens=[req["eos_id"]],
      temperature=0.0,
    )
    return np.stack([np.asarray(t, np.int32) for t in out.tokens])

  for _ in range(req["warmup"]):
    call()
  versions = {
    "tunix": importlib.metadata.version("google-tunix"),
    "tunix_jax": jax.__version__,
    "tunix_flax": importlib.metadata.version("flax"),
  }
  notes = f"pad_id {pad_id}; the decode loop runs {n} model calls for {n} tokens"

  def answer(obj) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()

  for line in sys.stdin:
    command = line.strip()
    if command == "ready":
      answer({"versions": versions, "notes": notes})
    elif command == "call":
      t0 = time.perf_counter()
      tokens = call()
      seconds = time.perf_counter() - t0
      if tokens.shape != (b, n):
        raise RuntimeError(f"tunix produced tokens of shape {tokens.shape}; expected {(b, n)}")
      answer({"seconds": seconds, "tokens": tokens.tolist()})
    elif command == "quit":
      return
    else:
      raise ValueError(f"unknown command {command!r}; allowed: ready, call, quit")


if __name__ == "__main__":
  if len(sys.argv) != 2:
    raise SystemExit(__doc__)
  main(sys.argv[1])
