"""Run components from config: tokenizer, model (preset / HF dir, LoRA), task, prompts; and one
end-to-end RL run on an HF checkpoint directory with a chat template and GSM8K-format JSONL."""

import json

import jax
import numpy as np
import pytest
from helpers import numpy_model

import configs.grpo_gsm8k as grpo_gsm8k
from jaxrl.config import ConfigError, validate
from jaxrl.data import word_problems
from jaxrl.mesh import get_rules, make_mesh
from jaxrl.models.config import ModelConfig
from jaxrl.models.hf import export_hf_checkpoint
from jaxrl.rl import components
from jaxrl.rl.loop import Trainer
from jaxrl.tokenizer import ByteTokenizer, HFTokenizer

pytestmark = pytest.mark.integration

CHATML = (
  "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
  "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny random Qwen3 checkpoint + a ChatML BPE tokenizer trained on word problems."""
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  path = tmp_path_factory.mktemp("hf")
  corpus = [p["question"] + " " + p["answer"] for p in word_problems.generate(300, seed=5)]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  trainer = trainers.BpeTrainer(
    vocab_size=331, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(corpus, trainer)
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
  ).save_pretrained(path)
  vocab = HFTokenizer(path).vocab_size
  cfg = ModelConfig.tiny(vocab_size=vocab).replace(max_seq_len=384)
  _, params = numpy_model(cfg, seed=3)
  export_hf_checkpoint(cfg, params, path)
  data = path / "data"
  data.mkdir()
  word_problems.write_jsonl(data / "train.jsonl", 64, seed=1)
  word_problems.write_jsonl(data / "test.jsonl", 8, seed=2)
  return path


def _gsm8k_config(hf_dir, workdir, beta=0.0, **model):
  c = grpo_gsm8k.get_config("smoke")
  c.workdir = str(workdir)
  c.log.progress = False
  c.log.tensorboard = False
  c.model = dict(path=str(hf_dir), tokenizer="", dtype="float32", **model)
  c.task = dict(
    name="jsonl",
    path=str(hf_dir / "data" / "train.jsonl"),
    held_out_path=str(hf_dir / "data" / "test.jsonl"),
    chat=True,
    system_prompt="Answer after ####.",
  )
  c.sft.steps = 4
  c.rl.steps = 2
  c.rl.max_prompt_len = 192
  c.rl.max_new_tokens = 128
  c.rl.kl.beta = beta
  c.eval = dict(every=2, num_examples=4)
  return validate(c)


def test_prompt_encoder_template_and_chat(hf_dir):
  cfg = validate(grpo_gsm8k.get_config("smoke"))
  enc = components.PromptEncoder(cfg.task, ByteTokenizer())
  rec = {"prompt": "2 + 2?", "answer": "4"}
  assert enc.text(rec) == "Q: 2 + 2?\nA:"
  assert enc(rec) == ByteTokenizer().encode("Q: 2 + 2?\nA:", add_bos=True)
  chat = _gsm8k_config(hf_dir, "/tmp/unused").task
  tok = HFTokenizer(hf_dir)
  enc = components.PromptEncoder(chat, tok)
  want = "<|im_start|>system\nAnswer after ####.<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n"
  assert enc.text(rec) == want + "<|im_start|>assistant\n"
  assert enc(rec) == tok.encode(enc.text(rec), add_bos=False)
  bad = validate({"task": {"prompt_template": "{missing}"}}).task
  with pytest.raises(ConfigError, match="prompt_template"):
    components.PromptEncoder(bad, ByteTokenizer())(rec)
  with pytest.raises(ConfigError, match="chat"):
    components.PromptEncoder(chat, ByteTokenizer())


def test_model_from_preset_and_from_hf_dir(hf_dir):
  mesh, rules = make_mesh(1, -1, 1), get_rules("fsdp_tp")
  section = validate({"model": {"preset": "tiny", "max_seq_len": 96}}).model
  cfg, _, params = components.build_model(section, ByteTokenizer(), mesh, rules, seed=0)
  assert cfg.vocab_size == 259 and cfg.max_seq_len == 96 and cfg.lora_rank == 0
  section = validate({"model": {"path": str(hf_dir), "lora_rank": 4, "lora_targets": "q,v"}}).model
  tok = components.build_tokenizer(section)
  assert isinstance(tok, HFTokenizer)
  cfg, _, params = components.build_model(section, tok, mesh, rules, seed=0)
  assert cfg.lora_rank == 4 and cfg.lora_targets == ("q", "v") and cfg.max_seq_len == 384
  assert not cfg.scan_layers and cfg.remat == "none"
  # How the forward runs reaches the model from either source; the params are the same.
  run_opts = {"scan_layers": True, "remat": "full", "attention_kernel": "pallas_tpu"}
  run_opts |= {"moe_kernel": "pallas_tpu", "kernel_interpret": True}
  for source in ({"preset": "tiny"}, {"path": str(hf_dir)}):
    section = validate({"model": {**source, **run_opts}}).model
    tok = components.build_tokenizer(section)
    scanned, _, scanned_params = components.build_model(section, tok, mesh, rules, seed=0)
    assert scanned.scan_layers and scanned.remat == "full", source
    assert (scanned.attention_kernel, scanned.moe_kernel) == ("pallas_tpu", "pallas_tpu")
    assert scanned.matmul_kernel == "reference" and scanned.kernel_interpret
    plain = validate({"model": source}).model
    _, _, plain_params = components.build_model(plain, tok, mesh, rules, seed=0)
    assert jax.tree.structure(scanned_params) == jax.tree.structure(plain_params)
  with pytest.raises(ConfigError, match="model.path"):
    components.build_model(
      validate({"model": {"path": str(hf_dir / "data")}}).model, tok, mesh, rules, seed=0
    )
  with pytest.raises(ConfigError, match="model.tokenizer"):
    components.build_tokenizer(validate({"model": {"tokenizer": "/nonexistent"}}).model)


@pytest.mark.e2e
def test_rl_on_an_hf_checkpoint_with_chat_template_and_lora(hf_dir, tmp_path):
  """SFT + GRPO through the engine on the exported checkpoint: only adapters move, the KL
  reference is the policy RL starts from (so KL starts at 0), and the sampler matches the
  learner."""
  cfg = _gsm8k_config(hf_dir, tmp_path, beta=0.1, lora_rank=4)
  trainer = Trainer(cfg, log=lambda *_: None)
  base = {k: np.array(v) for k, v in _leaves(trainer.ctx.init_params).items() if "lora" not in k}
  trainer.run()
  after = _leaves(trainer.state.policy.params)
  for k, v in base.items():
    np.testing.assert_array_equal(np.asarray(after[k]), v, err_msg=k)  # the base is frozen
  assert any("lora" in k and np.any(np.asarray(v)) for k, v in after.items() if "['b']" in k)
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in lines if r["phase"] == "rl"]
  assert len(rl) == 2 and all(np.isfinite(r["rl/loss"]) for r in rl)
  assert max(r["rl/logprob_gap"] for r in rl) < 1e-5
  assert all(r["rl/kl"] >= 0 for r in rl)
  assert rl[0]["rollout/prefill_prompts"] == cfg.rl.prompts_per_step  # one prefill per group
  # Prompts of one length bucket share a call; past the prefill chunk they are chunked alone.
  assert 1 <= rl[0]["rollout/prefill_calls"] <= cfg.rl.prompts_per_step
  assert trainer.sampler.engine.generate_compiles == 1
  trainer.close()


def _leaves(params):
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(p): x for p, x in flat}
