"""launch.export: a run's RL / SFT checkpoint as an HF directory that transformers, jaxrl read."""

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from fixtures import smoke_configdict
from flax import nnx
from helpers import run_child

from jaxrl.config import validate
from jaxrl.models.hf import load_hf_checkpoint
from jaxrl.models.transformer import apply as _apply
from jaxrl.models.transformer import positions_from_mask
from jaxrl.rl.loop import Trainer
from launch.export import ExportError, export

ROOT = Path(__file__).parent.parent
# Jitted with the graphdef static: an eager forward dispatches op by op and is slow on CPU.
apply = jax.jit(_apply, static_argnums=0)


def _config(workdir, **model):
  # The tiny model: prime sizes and an untied head, so a transposed weight shows.
  return smoke_configdict(
    workdir,
    model=model,
    # Trained on all 8 test devices and exported by a one-device process: the export reads a
    # sharded checkpoint onto another device count.
    mesh={"devices": 0},
    sft={"steps": 4},
    rl={
      "steps": 2,
      "prompts_per_step": 4,  # 4 x 2 rows: the batch splits over the 8 test devices
      "group_size": 2,
      # A near-random model earns no reward, so all advantages are 0: the entropy bonus (from
      # the first update, no warmup) is what makes RL move the weights away from the SFT ones.
      "loss": {"entropy_coef": 0.01},
      "optim": {"warmup_steps": 0},
    },
    eval={"num_examples": 8},
    checkpoint={"every": 1},
  )


def _pure(params):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(params))


def _assert_params_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, _pure(a), _pure(b))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """One tiny SFT + RL run; the params each phase ended with, copied to host as references."""
  workdir = tmp_path_factory.mktemp("run")
  trainer = Trainer(validate(_config(workdir)), log=lambda *_: None)
  try:
    # What Trainer.run does, with a host copy of the SFT params before RL donates their buffers.
    trainer.run_sft()
    sft = jax.device_get(trainer.sft_params)
    # Between the phases only SFT is on disk: what `latest` and a missing phase do then.
    before_rl = {"latest": trainer.restore_params("latest")}
    try:
      trainer.restore_params("rl")
    except FileNotFoundError as e:
      before_rl["rl"] = str(e)
    trainer.run_rl()
    trainer.rl_ckpt.wait()
    rl = jax.device_get(trainer.state.policy.params)
    yield dict(workdir=workdir, trainer=trainer, sft=sft, rl=rl, before_rl=before_rl)
  finally:
    trainer.close()


@pytest.fixture(scope="module")
def rl_export(run, tmp_path_factory):
  out = tmp_path_factory.mktemp("export") / "rl"
  line = export(_config(run["workdir"]), out)  # default phase: latest = the newest RL one
  return out, line


@pytest.mark.e2e
def test_default_export_is_the_final_rl_params_exactly(run, rl_export):
  out, line = rl_export
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
  n = sum(x.size for x in jax.tree.leaves(run["rl"]))
  assert f"exported rl step 2 of {run['workdir']} ({n:,} params, qwen3) to {out}" in line
  assert "byte tokenizer: no tokenizer files written" in line
  cfg, _, params = load_hf_checkpoint(out)
  assert cfg == run["trainer"].ctx.model_cfg
  _assert_params_equal(params, run["rl"])
  # The Trainer's own restore gives the same arrays the export was written from.
  phase, step, restored = run["trainer"].restore_params("rl")
  assert (phase, step) == ("rl", 2)
  _assert_params_equal(restored, run["rl"])


@pytest.mark.e2e
def test_export_logits_match_transformers(run, rl_export):
  out, _ = rl_export
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval().float()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 259, size=(2, 11)).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  valid[1, :3] = False  # left padding
  tokens = np.where(valid, tokens, 0)
  positions = positions_from_mask(valid)
  with torch.no_grad():
    ref = model(
      input_ids=torch.from_numpy(tokens).long(),
      attention_mask=torch.from_numpy(valid).long(),
      position_ids=torch.from_numpy(np.array(positions)).long(),
    ).logits.numpy()
  trainer = run["trainer"]
  params = jax.device_put(run["rl"])
  ours, _ = apply(trainer.ctx.graphdef, params, tokens, positions, valid)
  np.testing.assert_allclose(np.asarray(ours)[valid], ref[valid], atol=1e-4, rtol=0)


@pytest.mark.e2e
def test_sft_phase_exports_the_sft_params(run, tmp_path):
  line = export(_config(run["workdir"]), tmp_path / "sft", phase="sft")
  assert "exported sft step 4" in line
  _, _, params = load_hf_checkpoint(tmp_path / "sft")
  _assert_params_equal(params, run["sft"])
  # RL moved the weights, so the two exports are really different checkpoints.
  moved = jax.tree.leaves(
    jax.tree.map(lambda a, b: not np.array_equal(a, b), _pure(params), _pure(run["rl"]))
  )
  assert any(moved)


@pytest.mark.e2e
def test_bad_out_and_phase(run, tmp_path):
  cfg = _config(run["workdir"])
  (tmp_path / "file").write_text("x")
  with pytest.raises(ExportError, match=r"--out='.*file' exists and is not a directory"):
    export(cfg, tmp_path / "file")
  with pytest.raises(ExportError, match=r"phase='best' is invalid; allowed: latest, rl, sft"):
    export(cfg, tmp_path / "out", phase="best")
  tok = tmp_path / "tok"
  tok.mkdir()
  with pytest.raises(ExportError, match=r"is config.model.tokenizer; choose another"):
    export(_config(run["workdir"], tokenizer=str(tok)), tok)


def _export_cli(*flags):
  return run_child(
    [sys.executable, "-m", "launch.export", "--config=configs/grpo_arith.py:smoke", *flags],
    cwd=ROOT,
  )


@pytest.mark.e2e
def test_cli_empty_workdir_and_bad_phase_fail_with_one_clear_line(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  out = _export_cli(f"--config.workdir={empty}", f"--out={tmp_path / 'out'}")
  assert out.returncode != 0
  assert f"error: no checkpoint in workdir '{empty}'" in out.stderr, out.stderr[-2000:]
  assert "checkpointed phases: none" in out.stderr
  assert "Traceback" not in out.stderr
  assert not (tmp_path / "out").exists() and not list(empty.iterdir())
  out = _export_cli(f"--config.workdir={empty}", f"--out={tmp_path / 'out'}", "--phase=best")
  assert out.returncode != 0
  assert "flag --phase=best: value should be one of <latest|rl|sft>" in out.stderr


@pytest.mark.e2e
def test_restore_params_latest_is_sft_until_rl_has_a_checkpoint(run):
  phase, step, params = run["before_rl"]["latest"]
  assert (phase, step) == ("sft", 4)
  _assert_params_equal(params, run["sft"])
  checkpoints = run["workdir"] / "checkpoints"
  assert run["before_rl"]["rl"] == (
    f"no rl checkpoint in {checkpoints}; checkpointed phases: sft (step 4)"
  )
  with pytest.raises(ValueError, match=r"phase='best' is invalid; allowed: 'rl', 'sft', 'latest'"):
    run["trainer"].restore_params("best")


@pytest.mark.e2e
def test_hf_tokenizer_files_are_copied_and_latest_falls_back_to_sft(run, tmp_path):
  """The run's SFT checkpoints alone, exported under a config with an HF tokenizer."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  # Byte-level BPE without merges: 3 specials + 256 bytes = the byte tokenizer's 259 ids, so
  # the run's checkpoints fit a model sized by this tokenizer.
  backend = Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe = trainers.BpeTrainer(
    vocab_size=259,
    special_tokens=["<pad>", "<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  backend.train_from_iterator(["12+7=19", "40-3=37"], bpe)
  assert backend.get_vocab_size() == 259
  tok_dir = tmp_path / "tok"
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
  ).save_pretrained(tok_dir)
  (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
  workdir = tmp_path / "sft_only"
  shutil.copytree(run["workdir"] / "checkpoints" / "sft", workdir / "checkpoints" / "sft")
  line = export(_config(workdir, tokenizer=str(tok_dir)), tmp_path / "out")
  assert "exported sft step 4" in line
  _, _, params = load_hf_checkpoint(tmp_path / "out")
  _assert_params_equal(params, run["sft"])
  copied = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
  assert line.endswith(f"tokenizer files from {tok_dir}: {', '.join(copied)}")
  for name in copied:
    assert (tmp_path / "out" / name).read_bytes() == (tok_dir / name).read_bytes()
  text = "12+7=19"
  exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  assert exported(text)["input_ids"] == backend.encode(text).ids
