"""Decode throughput (tokens/s) of jaxrl's samplers vs HF `generate` and Tunix's Sampler on CPU.

Every peer decodes the same random-weight Qwen3-shaped model (built once with jaxrl, exported to
safetensors, loaded by each peer), the same prompts, greedily, and exactly `--new-tokens` tokens
per row (EOS stopping is off everywhere). Compilation / warm-up calls are excluded; the median of
`--reps` timed calls is reported.

  .venv/bin/python bench/decode_throughput.py                      # full run, all peers
  .venv/bin/python bench/decode_throughput.py --quick              # sanity run
  .venv/bin/python bench/decode_throughput.py --models small --peers jaxrl,hf

The `-int8` peers run the same samplers on W8A8 int8 weights (`jaxrl.quant.quantize_params`):
different numerics, so their greedy agreement with the float32 peers is reported, not required.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl.models.config import ModelConfig  # noqa: E402
from jaxrl.models.hf import export_hf_checkpoint  # noqa: E402
from jaxrl.models.transformer import make_model  # noqa: E402
from jaxrl.quant import quantize_params  # noqa: E402

TUNIX_PYTHON = BENCH_DIR / ".venv-tunix" / "bin" / "python"
TUNIX_PEER = BENCH_DIR / "_tunix_peer.py"
DEFAULT_OUT = BENCH_DIR / "results" / "decode_throughput.json"
PAD_ID = 0
# Byte tokenizer ids are in [0, 259): -1 can never be sampled, so no row ever stops early.
NO_EOS = -1
SEED = 0
ENGINE_PAGE_SIZE = 16
INT8_NOTE = (
  "W8A8 int8 (per-channel weights, per-token activations); not the same numerics as the float32 "
  "peers"
)


def _qwen3_shaped(num_layers: int, embed_dim: int, heads: int, kv_heads: int, mlp: int):
  return ModelConfig(
    vocab_size=259,
    num_layers=num_layers,
    embed_dim=embed_dim,
    num_heads=heads,
    num_kv_heads=kv_heads,
    head_dim=64,
    mlp_dim=mlp,
    # Tunix's Qwen3 attention hard-codes Qwen3's theta (it ignores its config's rope_theta).
    rope_theta=1_000_000.0,
    qk_norm=True,
    tie_embeddings=True,
    max_seq_len=1024,
  )


MODELS: dict[str, Callable[[], ModelConfig]] = {
  "small": lambda: _qwen3_shaped(4, 256, 4, 2, 1024),
  "medium": lambda: _qwen3_shaped(8, 512, 8, 4, 2048),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """What every peer decodes: one model checkpoint and one prompt batch."""

  model: str
  cfg: ModelConfig
  graphdef: object
  params: object
  checkpoint: Path  # HF-format directory (config.json + model.safetensors)
  prompts: np.ndarray  # [B, P] int32, no padding
  new_tokens: int
  warmup: int
  reps: int
  torch_threads: int
  engine_steps_per_call: int


@dataclasses.dataclass
class PeerResult:
  times_s: list[float]  # one per timed call, each decoding B x new_tokens tokens
  tokens: np.ndarray  # [B, new_tokens] int32 from the last call
  notes: str = ""


def _timed(fn: Callable[[], np.ndarray], warmup: int, reps: int) -> tuple[list[float], np.ndarray]:
  """Calls `fn` (which must return host tokens, so all work is done) warmup + reps times."""
  for _ in range(warmup):
    out = fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return times, out


# ------------------------------------------------------------------------------------------ peers


def run_jaxrl(w: Workload) -> PeerResult:
  """jaxrl v0 sampler: one jitted prefill + while_loop decode over a fixed-size KV cache."""
  from jaxrl.rollout.reference import make_sampler, row_keys
  from jaxrl.rollout.sampling import SamplingParams

  b, p = w.prompts.shape
  sample = make_sampler(
    w.graphdef,
    w.cfg,
    prompt_len=p,
    max_new_tokens=w.new_tokens,
    eos_id=NO_EOS,
    pad_id=PAD_ID,
    sampling=SamplingParams(temperature=0.0),
  )
  tokens = jnp.asarray(w.prompts)
  mask = jnp.ones((b, p), bool)
  keys = row_keys(jax.random.key(SEED), np.arange(b))

  def call():
    out = sample(w.params, tokens, mask, keys)
    return np.asarray(out.tokens)

  times, out = _timed(call, w.warmup, w.reps)
  return PeerResult(times, out)


def run_engine(w: Workload) -> PeerResult:
  """jaxrl continuous-batching engine through its Driver: B requests, B slots, one paged pool."""
  try:
    from jaxrl.rollout.driver import Driver, Request
    from jaxrl.rollout.engine import Engine
  except ImportError as e:
    raise NotImplementedError(f"the jaxrl engine is not importable yet ({e})") from e
  from jaxrl.rollout.sampling import SamplingParams

  b, p = w.prompts.shape
  n = w.new_tokens
  pages_per_seq = -(-(p + n) // ENGINE_PAGE_SIZE)
  engine = Engine(
    w.cfg,
    w.graphdef,
    max_concurrent_decodes=b,
    num_pages=b * pages_per_seq,
    page_size=ENGINE_PAGE_SIZE,
    max_prefill_length=p,
    max_target_length=p + n,
  )
  # No eos_id and no tokenizer: the driver has no stop token, so every request runs n tokens.
  driver = Driver(engine, steps_per_call=w.engine_steps_per_call, eos_id=None)
  greedy = SamplingParams(temperature=0.0)
  requests = [
    Request(prompt=row.tolist(), request_id=i, sampling=greedy, max_new_tokens=n)
    for i, row in enumerate(w.prompts)
  ]
  stats = {}

  def call():
    result = driver.run(w.params, requests, seed=SEED)
    stats.update(result.stats)
    done = sorted(result.finished, key=lambda c: c.request_id)
    return np.stack([c.tokens for c in done])

  times, out = _timed(call, w.warmup, w.reps)
  notes = (
    f"steps_per_call {w.engine_steps_per_call}; last run: {stats['decode_steps']} decode steps in "
    f"{stats['generate_calls']} calls; {engine.generate_compiles} decode compile(s)"
  )
  return PeerResult(times, out, notes=notes)


def _int8(run: Callable[[Workload], PeerResult]) -> Callable[[Workload], PeerResult]:
  """`run` on int8 params: quantized once here (quantize-on-sync), outside every timed call."""

  def run_int8(w: Workload) -> PeerResult:
    params = jax.block_until_ready(jax.jit(quantize_params)(w.params))
    r = run(dataclasses.replace(w, params=params))
    return PeerResult(r.times_s, r.tokens, "; ".join(n for n in (INT8_NOTE, r.notes) if n))

  run_int8.__doc__ = f"{run.__doc__.splitlines()[0]} With {INT8_NOTE}."
  return run_int8


def run_hf(w: Workload) -> PeerResult:
  """HF transformers `generate` on torch CPU: float32, eval mode, inference_mode, KV cache on."""
  import torch
  from transformers import Qwen3ForCausalLM

  torch.set_num_threads(w.torch_threads)
  model = Qwen3ForCausalLM.from_pretrained(w.checkpoint, dtype=torch.float32).eval()
  ids = torch.as_tensor(w.prompts, dtype=torch.long)
  attn = torch.ones_like(ids)
  n = w.new_tokens

  def call():
    with torch.inference_mode():
      out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        use_cache=True,
        eos_token_id=None,
        pad_token_id=PAD_ID,
      )
    return out[:, ids.shape[1] :].numpy().astype(np.int32)

  times, out = _timed(call, w.warmup, w.reps)
  return PeerResult(times, out, notes=f"torch threads {torch.get_num_threads()}")


def run_tunix(w: Workload) -> PeerResult:
  """Tunix `Sampler` in its own venv (it needs safetensors<0.8), as a JSON-in/JSON-out child."""
  if not TUNIX_PYTHON.exists():
    raise FileNotFoundError(
      f"{TUNIX_PYTHON} is missing; create the Tunix venv first (see bench/README.md)"
    )
  with tempfile.TemporaryDirectory() as tmp:
    request = Path(tmp) / "request.json"
    response = Path(tmp) / "response.json"
    request.write_text(
      json.dumps(
        {
          "checkpoint": str(w.checkpoint),
          "prompts": w.prompts.tolist(),
          "new_tokens": w.new_tokens,
          "warmup": w.warmup,
          "reps": w.reps,
          "pad_id": PAD_ID,
          "eos_id": NO_EOS,
          "threads": _num_cores(),
        }
      )
    )
    proc = subprocess.run(
      [str(TUNIX_PYTHON), str(TUNIX_PEER), str(request), str(response)],
      capture_output=True,
      text=True,
      env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")},
    )
    if proc.returncode != 0:
      raise RuntimeError(f"tunix peer failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(response.read_text())
  _VERSIONS.update(result.get("versions", {}))
  return PeerResult(result["times_s"], np.asarray(result["tokens"], np.int32), result["notes"])


PEERS: dict[str, Callable[[Workload], PeerResult]] = {
  "jaxrl": run_jaxrl,
  "engine": run_engine,
  "jaxrl-int8": _int8(run_jaxrl),
  "engine-int8": _int8(run_engine),
  "hf": run_hf,
  "tunix": run_tunix,
}
JAXRL_RUNNERS = ("jaxrl", "engine", "jaxrl-int8", "engine-int8")  # ratios: runner tok/s / peer's
# Greedy agreement is measured against the first of these that ran: never an int8 peer, whose
# argmax may legitimately differ from the float32 model's.
FLOAT_REFERENCES = ("jaxrl", "engine")
INT8_PEERS = ("jaxrl-int8", "engine-int8")
_VERSIONS: dict[str, str] = {}


# ------------------------------------------------------------------------------------ reporting


def _num_cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _machine() -> dict:
  model = platform.processor() or "unknown"
  try:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
      if line.startswith("Model name:"):
        model = line.split(":", 1)[1].strip()
  except FileNotFoundError:
    pass
  return {"cpu": model, "cores": _num_cores(), "platform": platform.platform()}


def _versions() -> dict:
  out = {"python": platform.python_version()}
  for pkg in ("jax", "jaxlib", "flax", "torch", "transformers"):
    try:
      out[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      out[pkg] = None
  return out


def prefix_agreement(a: np.ndarray, b: np.ndarray) -> dict:
  """How many leading greedy tokens two peers share, per row ([B, N] each)."""
  same = np.cumprod(a == b, axis=1)
  prefix = same.sum(axis=1)
  return {
    "min_prefix": int(prefix.min()),
    "mean_prefix": float(prefix.mean()),
    "rows_identical": int((prefix == a.shape[1]).sum()),
    "rows": int(a.shape[0]),
  }


def _parse_list(value: str, allowed, flag: str) -> list[str]:
  items = [v.strip() for v in value.split(",") if v.strip()]
  bad = [v for v in items if v not in allowed]
  if bad or not items:
    raise SystemExit(f"{flag}={value!r}: unknown {bad or 'empty'}; allowed: {', '.join(allowed)}")
  return items


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--models", default="small,medium", help=f"from {', '.join(MODELS)}")
  ap.add_argument(
    "--peers",
    default="jaxrl,engine,jaxrl-int8,engine-int8,hf,tunix",
    help=f"from {', '.join(PEERS)}",
  )
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--prompt-len", type=int, default=16)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--reps", type=int, default=5, help="timed calls per peer (median reported)")
  ap.add_argument("--warmup", type=int, default=1, help="untimed calls first (compilation)")
  ap.add_argument("--quick", action="store_true", help="sanity run: 2 reps of 32 new tokens")
  ap.add_argument(
    "--torch-threads",
    type=int,
    default=_num_cores(),
    help="torch intra-op threads for HF (default: all cores; on a loaded machine use 1, since\n"
    "spinning OpenMP threads slow down many-fold when cores are oversubscribed)",
  )
  ap.add_argument(
    "--engine-steps-per-call", type=int, default=8, help="engine decode steps per device call"
  )
  ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
  args = ap.parse_args(argv)
  models = _parse_list(args.models, MODELS, "--models")
  peers = _parse_list(args.peers, PEERS, "--peers")
  if args.quick:
    args.reps, args.new_tokens = min(args.reps, 2), min(args.new_tokens, 32)
  for name in (
    "batch",
    "prompt_len",
    "new_tokens",
    "reps",
    "torch_threads",
    "engine_steps_per_call",
  ):
    if getattr(args, name) <= 0:
      raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  if args.warmup < 0:
    raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")

  rng = np.random.default_rng(SEED)
  results, agreement = [], {}
  with tempfile.TemporaryDirectory() as tmp:
    for model in models:
      cfg = MODELS[model]()
      if args.prompt_len + args.new_tokens > cfg.max_seq_len:
        raise SystemExit(f"--prompt-len + --new-tokens must be <= {cfg.max_seq_len}")
      graphdef, params = make_model(cfg, seed=SEED)
      ckpt = Path(tmp) / model
      export_hf_checkpoint(cfg, params, ckpt)
      # Byte tokens (ids 3..258), so no prompt holds pad / bos / eos.
      prompts = rng.integers(3, cfg.vocab_size, (args.batch, args.prompt_len), dtype=np.int32)
      w = Workload(
        model,
        cfg,
        graphdef,
        params,
        ckpt,
        prompts,
        args.new_tokens,
        args.warmup,
        args.reps,
        args.torch_threads,
        args.engine_steps_per_call,
      )
      tokens = {}
      for peer in peers:
        print(f"[{model}] {peer}: running ...", flush=True)
        r = PEERS[peer](w)
        if r.tokens.shape != (args.batch, args.new_tokens):
          raise RuntimeError(
            f"{peer} produced tokens of shape {r.tokens.shape}; expected "
            f"{(args.batch, args.new_tokens)}"
          )
        tokens[peer] = r.tokens
        med = statistics.median(r.times_s)
        tps = args.batch * args.new_tokens / med
        results.append(
          {
            "model": model,
            "peer": peer,
            "median_s": med,
            "tokens_per_s": tps,
            "times_s": r.times_s,
            "tokens_per_call": args.batch * args.new_tokens,
            "notes": r.notes,
          }
        )
        print(f"[{model}] {peer}: {tps:9.1f} tok/s (median {med:.3f} s of {args.reps})", flush=True)
      # Greedy tokens of every peer against the first float32 jaxrl runner: same weights, same
      # argmax. For int8 peers the agreement is only reported (different numerics).
      ref = next((p for p in FLOAT_REFERENCES if p in tokens), None)
      for peer in peers:
        if ref is not None and peer != ref:
          a = prefix_agreement(tokens[ref], tokens[peer])
          a["required"] = peer not in INT8_PEERS
          agreement[f"{model}/{ref}~{peer}"] = a

  runners = [p for p in JAXRL_RUNNERS if p in peers]
  for r in results:
    for runner in runners:
      mine = next(x for x in results if x["model"] == r["model"] and x["peer"] == runner)
      r[f"ratio_{runner}_over_peer"] = mine["tokens_per_s"] / r["tokens_per_s"]

  heads = "".join(f"{runner + '/peer':>18}" for runner in runners)
  print(f"\n{'model':8} {'peer':12} {'tok/s':>10} {'median s':>10}{heads}")
  for r in results:
    ratios = "".join(f"{r[f'ratio_{runner}_over_peer']:18.2f}" for runner in runners)
    print(f"{r['model']:8} {r['peer']:12} {r['tokens_per_s']:10.1f} {r['median_s']:10.3f}{ratios}")
  for key, a in agreement.items():
    print(
      f"greedy agreement {key}: first {a['min_prefix']} tokens equal in every row "
      f"(mean {a['mean_prefix']:.1f}); {a['rows_identical']}/{a['rows']} rows identical"
      + ("" if a["required"] else " (int8 vs float32: reported, not required)")
    )

  report = {
    "benchmark": "decode_throughput",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": _machine(),
    "versions": {**_versions(), **_VERSIONS},
    "settings": {
      "batch": args.batch,
      "prompt_len": args.prompt_len,
      "new_tokens": args.new_tokens,
      "reps": args.reps,
      "warmup": args.warmup,
      "quick": args.quick,
      "torch_threads": args.torch_threads,
      "engine_steps_per_call": args.engine_steps_per_call,
      "sampling": "greedy, EOS stopping off",
      "dtype": "float32; -int8 peers: " + INT8_NOTE,
      "models": {m: dataclasses.asdict(MODELS[m]()) for m in models},
    },
    "results": results,
    "greedy_agreement": agreement,
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {args.out}")
  return report


if __name__ == "__main__":
  main()
