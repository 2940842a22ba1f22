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
import json
import os
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
sys.path.insert(0, str(BENCH_DIR))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import MODELS, machine, num_cores, versions  # noqa: E402

from jaxrl.models.config import ModelConfig  # noqa: E402
from jaxrl.models.hf import export_hf_checkpoint  # noqa: E402
from jaxrl.models.transformer import make_model  # noqa: E402
from jaxrl.quant import quantize_params  # noqa: E402

TUNIX_PYTHON = BENCH_DIR / ".venv-tunix" / "bin" / "python"
TUNIX_PEER = BENCH_DIR / "_tunix_peer.py"
TUNIX_TAG = "@@tunix "  # prefix of the Tunix child's answers on its stdout
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
class Peer:
  """A peer ready to decode: compiled and warmed up. `call()` decodes the workload once and
  returns (seconds, tokens [B, new_tokens]); in-process peers are timed around their whole
  public call, the Tunix child times its own call (no pipe in the measurement)."""

  call: Callable[[], tuple[float, np.ndarray]]
  notes: Callable[[], str] = lambda: ""
  close: Callable[[], None] = lambda: None


def _local(fn: Callable[[], np.ndarray], warmup: int, **kw) -> Peer:
  """A Peer of an in-process `fn` (which must return host tokens, so all work is done)."""
  for _ in range(warmup):
    fn()

  def call():
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out

  return Peer(call, **kw)


# ------------------------------------------------------------------------------------------ peers


def run_jaxrl(w: Workload) -> Peer:
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

  return _local(call, w.warmup)


def run_engine(w: Workload) -> Peer:
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

  def notes():
    return (
      f"steps_per_call {w.engine_steps_per_call}; last run: {stats['decode_steps']} decode "
      f"steps in {stats['generate_calls']} calls; {engine.generate_compiles} decode compile(s)"
    )

  return _local(call, w.warmup, notes=notes)


def _int8(run: Callable[[Workload], Peer]) -> Callable[[Workload], Peer]:
  """`run` on int8 params: quantized once here (quantize-on-sync), outside every timed call."""

  def run_int8(w: Workload) -> Peer:
    params = jax.block_until_ready(jax.jit(quantize_params)(w.params))
    peer = run(dataclasses.replace(w, params=params))
    inner = peer.notes
    peer.notes = lambda: "; ".join(n for n in (INT8_NOTE, inner()) if n)
    return peer

  run_int8.__doc__ = f"{run.__doc__.splitlines()[0]} With {INT8_NOTE}."
  return run_int8


def run_hf(w: Workload) -> Peer:
  """HF transformers `generate` on torch CPU: float32, eval mode, inference_mode, KV cache on."""
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(w.torch_threads)
  # The checkpoint's own class (Qwen3ForCausalLM for the benchmark models; scale_rehearsal.py
  # also times Llama and Gemma checkpoints).
  model = AutoModelForCausalLM.from_pretrained(w.checkpoint, dtype=torch.float32).eval()
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

  threads = torch.get_num_threads()
  return _local(call, w.warmup, notes=lambda: f"torch threads {threads}")


def run_tunix(w: Workload) -> Peer:
  """Tunix `Sampler` in its own venv (it needs safetensors<0.8): a child process that loads the
  checkpoint, warms up, then decodes once per line it reads and answers with its own timing."""
  if not TUNIX_PYTHON.exists():
    raise FileNotFoundError(
      f"{TUNIX_PYTHON} is missing; create the Tunix venv first (see bench/README.md)"
    )
  tmp = tempfile.TemporaryDirectory()
  request = Path(tmp.name) / "request.json"
  request.write_text(
    json.dumps(
      {
        "checkpoint": str(w.checkpoint),
        "prompts": w.prompts.tolist(),
        "new_tokens": w.new_tokens,
        "warmup": w.warmup,
        "pad_id": PAD_ID,
        "eos_id": NO_EOS,
        "threads": num_cores(),
      }
    )
  )
  proc = subprocess.Popen(
    [str(TUNIX_PYTHON), str(TUNIX_PEER), str(request)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")},
  )

  def ask(command: str) -> dict:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    for line in proc.stdout:  # the child's own prints are skipped; answers are tagged
      if line.startswith(TUNIX_TAG):
        return json.loads(line[len(TUNIX_TAG) :])
    proc.wait()
    raise RuntimeError(f"tunix peer failed (exit {proc.returncode}):\n{proc.stderr.read()[-4000:]}")

  ready = ask("ready")
  _VERSIONS.update(ready.get("versions", {}))

  def call():
    answer = ask("call")
    return answer["seconds"], np.asarray(answer["tokens"], np.int32)

  def close():
    if proc.poll() is None:
      proc.stdin.write("quit\n")
      proc.stdin.close()
      proc.wait(timeout=60)
    tmp.cleanup()

  return Peer(call, notes=lambda: ready["notes"], close=close)


PEERS: dict[str, Callable[[Workload], Peer]] = {
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
  ap.add_argument(
    "--gap", type=float, default=0.25, help="seconds of idle before every timed call (0 = none)"
  )
  ap.add_argument("--quick", action="store_true", help="sanity run: 2 reps of 32 new tokens")
  ap.add_argument(
    "--torch-threads",
    type=int,
    default=num_cores(),
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
  if args.gap < 0:
    raise SystemExit(f"--gap must be >= 0, got {args.gap}")

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
      ready = {}
      try:
        for peer in peers:
          print(f"[{model}] {peer}: compiling and warming up ...", flush=True)
          ready[peer] = PEERS[peer](w)
        tokens, times = {}, {p: [] for p in peers}
        for rep in range(args.reps):
          # One timed call of every peer per repetition, in an order rotated by one each time:
          # a drift in the machine's speed (this VM's moves by 2x within minutes) falls on all
          # peers alike, and each call's neighbours in time are the other peers' calls.
          for peer in peers[rep % len(peers) :] + peers[: rep % len(peers)]:
            time.sleep(args.gap)  # let spinning threads of the previous peer (torch) settle
            seconds, out = ready[peer].call()
            if out.shape != (args.batch, args.new_tokens):
              raise RuntimeError(
                f"{peer} produced tokens of shape {out.shape}; expected "
                f"{(args.batch, args.new_tokens)}"
              )
            if peer in tokens and not np.array_equal(tokens[peer], out):
              raise RuntimeError(f"{peer} decoded other tokens in repetition {rep + 1}")
            tokens[peer] = out
            times[peer].append(seconds)
          print(f"[{model}] repetition {rep + 1}/{args.reps} done", flush=True)
        notes = {peer: ready[peer].notes() for peer in peers}
      finally:
        for peer in ready.values():
          peer.close()
      for peer in peers:
        med = statistics.median(times[peer])
        tps = args.batch * args.new_tokens / med
        results.append(
          {
            "model": model,
            "peer": peer,
            "median_s": med,
            "tokens_per_s": tps,
            "times_s": times[peer],
            "tokens_per_call": args.batch * args.new_tokens,
            "notes": notes[peer],
          }
        )
        print(
          f"[{model}] {peer}: {tps:9.1f} tok/s (median {med:.3f} s of {len(times[peer])})",
          flush=True,
        )
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
      # The ratio call by call (peer time / runner time of the same repetition): its spread
      # says how much the machine moved it.
      paired = [t / m for t, m in zip(r["times_s"], mine["times_s"], strict=True)]
      r[f"paired_ratio_{runner}_over_peer"] = {
        "median": statistics.median(paired),
        "min": min(paired),
        "max": max(paired),
      }

  heads = "".join(f"{runner + '/peer':>18}" for runner in runners)
  print(f"\n{'model':8} {'peer':12} {'tok/s':>10} {'median s':>10}{heads}")
  for r in results:
    ratios = "".join(f"{r[f'ratio_{runner}_over_peer']:18.2f}" for runner in runners)
    print(f"{r['model']:8} {r['peer']:12} {r['tokens_per_s']:10.1f} {r['median_s']:10.3f}{ratios}")
  for r in results:
    for runner in runners:
      # The engine (the rollout path) against everything, the other runners against the peers.
      if runner != r["peer"] and (runner == "engine" or r["peer"] not in JAXRL_RUNNERS):
        p = r[f"paired_ratio_{runner}_over_peer"]
        print(
          f"{r['model']} {runner}/{r['peer']} call by call: median {p['median']:.2f} "
          f"(min {p['min']:.2f}, max {p['max']:.2f})"
        )
  for key, a in agreement.items():
    print(
      f"greedy agreement {key}: first {a['min_prefix']} tokens equal in every row "
      f"(mean {a['mean_prefix']:.1f}); {a['rows_identical']}/{a['rows']} rows identical"
      + ("" if a["required"] else " (int8 vs float32: reported, not required)")
    )

  report = {
    "benchmark": "decode_throughput",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "versions": {**versions(), **_VERSIONS},
    "settings": {
      "batch": args.batch,
      "prompt_len": args.prompt_len,
      "new_tokens": args.new_tokens,
      "reps": args.reps,
      "gap_s": args.gap,
      "order": "interleaved: one call per peer per repetition, order rotated each repetition",
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
