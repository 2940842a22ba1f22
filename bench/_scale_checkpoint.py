"""The scale rehearsal's local checkpoints: a real architecture at its real (or a smoke) size with
seeded random weights, saved by transformers as bfloat16 sharded safetensors, and beside them a
byte-level BPE tokenizer trained on the rehearsal's problems with the family's special tokens,
end-of-turn token and chat template. Nothing is downloaded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# ------------------------------------------------------------------------------------ templates

# ChatML, as Qwen2.5 / Qwen3 render a conversation without tools (the generation prompt opens
# the assistant's turn; a turn ends with <|im_end|>).
CHATML = (
  "{%- for message in messages %}"
  "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3 Instruct: BOS, then header-delimited turns ending with <|eot_id|>.
LLAMA3 = (
  "{{- bos_token }}"
  "{%- for message in messages %}"
  "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
  "message['content'] | trim + '<|eot_id|>' }}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}"
  "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
  "{%- endif %}"
)
# Gemma 3 IT: BOS, the system prompt folded into the first user turn, the assistant is 'model'.
GEMMA3 = (
  "{{- bos_token }}"
  "{%- if messages[0]['role'] == 'system' %}"
  "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
  "{%- set loop_messages = messages[1:] %}"
  "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
  "{%- for message in loop_messages %}"
  "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
  "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + "
  "message['content'] | trim + '<end_of_turn>\\n' }}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


@dataclasses.dataclass(frozen=True)
class Family:
  """What a model family's HF directory holds besides the weights: its special tokens (added
  after the BPE merges, as in the real vocabularies), which of them tokenizer_config.json names
  bos / eos / pad, the ids generation_config.json stops on, and its chat template."""

  model_type: str
  specials: tuple[str, ...]
  eos: str  # tokenizer_config.json eos_token (the Instruct checkpoints')
  stops: tuple[str, ...]  # generation_config.json eos_token_id
  chat_template: str
  end_of_turn: str  # what closes an assistant turn in the chat template
  bos: str | None = None  # also prepended by tokenizer.json's post-processor when set
  pad: str | None = None


QWEN = Family(
  model_type="qwen3",
  specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
  eos="<|im_end|>",
  stops=("<|im_end|>", "<|endoftext|>"),
  chat_template=CHATML,
  end_of_turn="<|im_end|>",
  pad="<|endoftext|>",
)
LLAMA = Family(
  model_type="llama",
  specials=(
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
  ),
  eos="<|eot_id|>",
  stops=("<|end_of_text|>", "<|eot_id|>"),
  chat_template=LLAMA3,
  end_of_turn="<|eot_id|>",
  bos="<|begin_of_text|>",
)
GEMMA = Family(
  model_type="gemma3_text",
  specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
  # As gemma-3-1b-it ships: tokenizer_config's eos is <eos>; generation also stops on the
  # chat template's <end_of_turn>.
  eos="<eos>",
  stops=("<eos>", "<end_of_turn>"),
  chat_template=GEMMA3,
  end_of_turn="<end_of_turn>",
  bos="<bos>",
  pad="<pad>",
)


@dataclasses.dataclass(frozen=True)
class Arch:
  """A checkpoint's architecture: its family, the transformers config class and the config.json
  shape of the real checkpoint (`full`), and the same structure at smoke size (`smoke`)."""

  family: Family
  config_class: str
  full: dict
  smoke: dict


_SMOKE = dict(
  vocab_size=2048,  # past what the smoke corpus merges to: padded rows, as at full size
  num_hidden_layers=2,
  hidden_size=64,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  intermediate_size=128,
)
_QWEN3 = dict(
  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
  max_position_embeddings=40_960,
  rms_norm_eps=1e-6,
  tie_word_embeddings=True,
)
_LLAMA_ROPE = {
  "rope_type": "llama3",
  "rope_theta": 500_000.0,
  "factor": 32.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 8192,
}
_LLAMA32 = dict(
  rope_parameters=_LLAMA_ROPE,
  max_position_embeddings=131_072,
  rms_norm_eps=1e-5,
  tie_word_embeddings=True,
)
_GEMMA3 = dict(
  rope_parameters={
    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
  },
  max_position_embeddings=32_768,
  rms_norm_eps=1e-6,
  query_pre_attn_scalar=256,
  final_logit_softcapping=None,
  attn_logit_softcapping=None,
  tie_word_embeddings=True,
)


def _gemma_layers(n: int) -> list[str]:
  """Gemma 3's pattern: five sliding-window layers, then one global, repeated."""
  return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


ARCHS: dict[str, Arch] = {
  "qwen3-0.6b": Arch(
    QWEN,
    "Qwen3Config",
    dict(
      vocab_size=151_936,
      num_hidden_layers=28,
      hidden_size=1024,
      num_attention_heads=16,
      num_key_value_heads=8,
      head_dim=128,
      intermediate_size=3072,
      **_QWEN3,
    ),
    dict(_SMOKE, **_QWEN3),
  ),
  "qwen3-1.7b": Arch(
    QWEN,
    "Qwen3Config",
    dict(
      vocab_size=151_936,
      num_hidden_layers=28,
      hidden_size=2048,
      num_attention_heads=16,
      num_key_value_heads=8,
      head_dim=128,
      intermediate_size=6144,
      **_QWEN3,
    ),
    dict(_SMOKE, **_QWEN3),
  ),
  "llama-3.2-1b": Arch(
    LLAMA,
    "LlamaConfig",
    dict(
      vocab_size=128_256,
      num_hidden_layers=16,
      hidden_size=2048,
      num_attention_heads=32,
      num_key_value_heads=8,
      head_dim=64,
      intermediate_size=8192,
      **_LLAMA32,
    ),
    dict(_SMOKE, **_LLAMA32),
  ),
  "gemma-3-1b": Arch(
    GEMMA,
    "Gemma3TextConfig",
    dict(
      vocab_size=262_144,
      num_hidden_layers=26,
      hidden_size=1152,
      num_attention_heads=4,
      num_key_value_heads=1,
      head_dim=256,
      intermediate_size=6912,
      sliding_window=512,
      layer_types=_gemma_layers(26),
      **_GEMMA3,
    ),
    # One sliding and one global layer; a window shorter than the rehearsal's sequences.
    dict(
      _SMOKE,
      num_key_value_heads=1,
      sliding_window=16,
      layer_types=["sliding_attention", "full_attention"],
      **_GEMMA3,
    ),
  ),
}


# ------------------------------------------------------------------------------------ tokenizer


def train_tokenizer(family: Family, texts: list[str], vocab_size: int):
  """A byte-level BPE (`tokenizers`) trained on `texts` up to `vocab_size` ids in all (the
  trainer stops earlier when the corpus has no merges left), then the family's special tokens
  appended; a BOS post-processor for the families whose tokenizer adds one."""
  from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
  )

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size - len(family.specials),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in family.specials])
  if family.bos is not None:
    bos = (family.bos, tok.token_to_id(family.bos))
    tok.post_processor = processors.TemplateProcessing(
      single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B", special_tokens=[bos]
    )
  return tok


def token_ids(family: Family, tok) -> dict:
  """The ids config.json and generation_config.json name: bos, eos (the stop list), pad."""
  ids = {
    "eos_token_id": [tok.token_to_id(s) for s in family.stops],
    "bos_token_id": None if family.bos is None else tok.token_to_id(family.bos),
    "pad_token_id": None if family.pad is None else tok.token_to_id(family.pad),
  }
  if len(ids["eos_token_id"]) == 1:
    ids["eos_token_id"] = ids["eos_token_id"][0]
  return ids


def save_tokenizer(family: Family, tok, out: Path) -> dict:
  """Writes tokenizer.json, tokenizer_config.json and the chat template into `out` through
  transformers; returns what was written (size, specials, eos)."""
  from transformers import PreTrainedTokenizerFast

  fast = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    bos_token=family.bos,
    eos_token=family.eos,
    pad_token=family.pad,
    unk_token="<unk>" if "<unk>" in family.specials else None,
    chat_template=family.chat_template,
  )
  fast.save_pretrained(out)
  return {
    "vocab_size": tok.get_vocab_size(with_added_tokens=True),
    "specials": {s: tok.token_to_id(s) for s in family.specials},
    "eos_token": family.eos,
    "end_of_turn": family.end_of_turn,
    "stops": list(family.stops),
    "files": sorted(p.name for p in out.iterdir() if "token" in p.name or "chat" in p.name),
  }


# ----------------------------------------------------------------------------------- checkpoint


def hf_config(arch: Arch, *, smoke: bool, ids: dict):
  """The transformers config of `arch` (its smoke shape with `smoke`), with the tokenizer's ids."""
  import transformers

  shape = arch.smoke if smoke else arch.full
  cls = getattr(transformers, arch.config_class)
  return cls(**shape, **ids, initializer_range=0.02, attention_bias=False)


def build_checkpoint(arch: Arch, out: Path, *, smoke: bool, seed: int, ids: dict) -> dict:
  """Random weights (seeded, N(0, 0.02) as transformers initialises them), built directly in
  bfloat16 and saved by `save_pretrained` as at least 2 safetensors shards, with
  generation_config.json stopping on the family's stop ids. Returns what was written."""
  import torch
  from transformers import AutoModelForCausalLM, GenerationConfig

  torch.manual_seed(seed)
  config = hf_config(arch, smoke=smoke, ids=ids)
  model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
  model.generation_config = GenerationConfig(**ids)
  tensors = {id(p): p for p in model.parameters()}.values()  # a tied head is one tensor
  params = sum(p.numel() for p in tensors)
  nbytes = sum(p.numel() * p.element_size() for p in tensors)
  largest = max(p.numel() * p.element_size() for p in tensors)
  # Shards of about a third of the weights (never below the largest tensor): 2 or more files.
  shard = max(largest, nbytes // 3 + 1)
  model.save_pretrained(out, max_shard_size=shard)
  shards = sorted(p.name for p in out.glob("model*.safetensors"))
  if len(shards) < 2:
    raise RuntimeError(f"save_pretrained wrote {shards}; expected at least 2 shards")
  return {
    "model_class": type(model).__name__,
    "params": params,
    "bytes": nbytes,
    "max_shard_size": shard,
    "shards": shards,
    "shard_dtypes": shard_dtypes(out),
    "config": json.loads((out / "config.json").read_text()),
    "generation_config": json.loads((out / "generation_config.json").read_text()),
  }


def shard_dtypes(ckpt: Path) -> list[str]:
  """The dtypes of every tensor in the directory's safetensors shards, as the headers say."""
  found = set()
  for file in ckpt.glob("model*.safetensors"):
    with open(file, "rb") as f:
      n = int.from_bytes(f.read(8), "little")
      header = json.loads(f.read(n))
    found |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
  return sorted(found)
