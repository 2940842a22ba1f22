"""Tokenizer tests: ByteTokenizer round trips; HFTokenizer parity with transformers; errors."""

import json
import os
import shutil

import numpy as np
import pytest

from jaxrl.tokenizer import (
  ByteTokenizer,
  ChatTemplateError,
  HFTokenizer,
  TokenizerFileError,
  load_tokenizer,
)

TEXTS = ["", "12+34=46", "Hello, world!\n\t~", "héllo wörld", "数学 ∑ x²", "emoji 🙂👍🏽"]


def test_vocab_and_special_ids():
  tok = ByteTokenizer()
  assert tok.vocab_size == 259
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert ids == [b + 3 for b in text.encode("utf-8")]  # one id per UTF-8 byte, shifted by 3
  assert all(3 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text
  assert tok.decode(np.asarray(ids, np.int32)) == text  # a row of a token array works too


def test_multibyte_characters_take_one_id_per_byte():
  tok = ByteTokenizer()
  assert tok.encode("A") == [68]
  assert tok.encode("é") == [0xC3 + 3, 0xA9 + 3]
  assert len(tok.encode("🙂")) == 4


def test_add_bos():
  tok = ByteTokenizer()
  assert tok.encode("ab", add_bos=True) == [tok.bos_id, 100, 101]
  assert tok.encode("", add_bos=True) == [tok.bos_id]
  assert tok.decode(tok.encode("ab", add_bos=True)) == "ab"


def test_decode_stops_at_eos_and_skips_specials():
  tok = ByteTokenizer()
  ids = [tok.bos_id, *tok.encode("ok"), tok.pad_id, *tok.encode("!"), tok.eos_id]
  assert tok.decode(ids + tok.encode("junk") + [tok.pad_id] * 3) == "ok!"
  assert tok.decode([tok.eos_id, *tok.encode("x")]) == ""


def test_specials_without_skipping_raise():
  tok = ByteTokenizer()
  assert tok.decode(tok.encode("fine"), skip_special=False) == "fine"
  for special in (tok.pad_id, tok.bos_id, tok.eos_id):
    with pytest.raises(ValueError, match="special"):
      tok.decode([*tok.encode("a"), special], skip_special=False)


@pytest.mark.parametrize("bad", [259, 1000, -1])
@pytest.mark.parametrize("skip_special", [True, False])
def test_out_of_range_ids_raise(bad, skip_special):
  tok = ByteTokenizer()
  with pytest.raises(ValueError, match=rf"token {bad} is outside the byte vocabulary \[0, 259\)"):
    tok.decode([*tok.encode("a"), bad], skip_special=skip_special)


def test_completion_cut_inside_a_character_decodes_with_replacement():
  tok = ByteTokenizer()
  ids = tok.encode("aé")[:-1]  # a completion truncated after the first byte of "é"
  assert tok.decode(ids) == "a\ufffd"


def test_byte_tokenizer_eos_ids():
  assert ByteTokenizer().eos_ids == (ByteTokenizer.eos_id,)


# ------------------------------------------------------------------------------- HFTokenizer

CORPUS = [
  "The answer is 42.",
  "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
  "How many clips did Natalia sell altogether in April and May? #### 72",
  "hello world, how are you today? I am fine, thank you!",
  "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
  "système, naïve café: 数学 ∑ x²",
]

# ChatML as in Qwen2.5-Instruct: a default system prompt, tools rendered with tojson.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\n' + 'You are Qwen, created by Alibaba Cloud. '
            + 'You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first)
          or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3.1 / 3.2 Instruct style: BOS in the template, strftime_now, raise_exception, loop control.
LLAMA_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Conversation roles must be user or assistant, got '
            + message['role']) }}
    {%- endif %}
    {%- if message['content'] == '' %}{% continue %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
LLAMA_SPECIALS += ["<|end_header_id|>", "<|eot_id|>"]

CONVERSATIONS = [
  [{"role": "user", "content": "What is 12 + 30?"}],
  [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May."},
  ],
  [
    {"role": "system", "content": "Answer with #### n."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4\n#### 4"},
    {"role": "user", "content": "And 3 × 3? Réponds en français."},
  ],
]


def _train_bpe(specials, *, bos=None):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(CORPUS, trainer)
  if bos is not None:
    tok.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
  return tok


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
  """A Qwen2.5-Instruct-shaped tokenizer: no BOS, eos <|im_end|>, pad <|endoftext|>."""
  import transformers

  path = tmp_path_factory.mktemp("qwen")
  hf = transformers.PreTrainedTokenizerFast(
    tokenizer_object=_train_bpe(QWEN_SPECIALS),
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    chat_template=QWEN_TEMPLATE,
  )
  hf.save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  """A Llama-3.2-Instruct-shaped tokenizer: BOS from the post-processor, no pad, two stop ids."""
  import transformers

  path = tmp_path_factory.mktemp("llama")
  backend = _train_bpe(LLAMA_SPECIALS, bos="<|begin_of_text|>")
  hf = transformers.PreTrainedTokenizerFast(
    tokenizer_object=backend,
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    chat_template=LLAMA_TEMPLATE,
  )
  hf.save_pretrained(path)
  stops = [backend.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
  with open(path / "generation_config.json", "w") as f:
    json.dump({"bos_token_id": backend.token_to_id("<|begin_of_text|>"), "eos_token_id": stops}, f)
  return path


def _hf(path):
  import transformers

  return transformers.AutoTokenizer.from_pretrained(path)


def _copy(src, dst, **config_updates):
  """A copy of a tokenizer directory with tokenizer_config.json fields replaced (None: removed)."""
  shutil.copytree(src, dst)
  with open(dst / "tokenizer_config.json") as f:
    config = json.load(f)
  for k, v in config_updates.items():
    if v is None:
      config.pop(k, None)
    else:
      config[k] = v
  with open(dst / "tokenizer_config.json", "w") as f:
    json.dump(config, f)
  return dst


ENCODE_TEXTS = [*CORPUS, "", "  leading spaces and trailing  ", "unseen words: zyzzyva quux 🙂"]
ENCODE_TEXTS += ["<|im_start|>user\nhi<|im_end|>", "a<|eot_id|>b"]


@pytest.mark.parametrize("which", ["qwen_dir", "llama_dir"])
def test_encode_matches_transformers(which, request):
  path = request.getfixturevalue(which)
  ours, ref = HFTokenizer(path), _hf(path)
  for text in ENCODE_TEXTS:
    assert ours.encode(text, add_bos=True) == ref(text)["input_ids"], text
    assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"], text
  assert ours.vocab_size == len(ref)


def test_bos_handling(qwen_dir, llama_dir):
  qwen, llama = HFTokenizer(qwen_dir), HFTokenizer(llama_dir)
  assert qwen.bos_id is None and not qwen.add_bos_token
  assert qwen.encode("hello", add_bos=True) == qwen.encode("hello")
  bos = _hf(llama_dir).convert_tokens_to_ids("<|begin_of_text|>")
  assert llama.bos_id == bos and llama.add_bos_token
  assert llama.encode("hello", add_bos=True) == [bos, *llama.encode("hello")]


def test_add_bos_token_flag_overrides_post_processor(llama_dir, tmp_path):
  # Model-specific transformers tokenizers (Llama, Gemma) pass add_bos_token on, which rebuilds
  # the post-processor; PreTrainedTokenizerFast given the flag explicitly does the same.
  import transformers

  for flag in (False, True):
    path = _copy(llama_dir, tmp_path / f"tok_{flag}", add_bos_token=flag)
    ours = HFTokenizer(path)
    ref = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(path / "tokenizer.json"),
      bos_token="<|begin_of_text|>",
      eos_token="<|eot_id|>",
      add_bos_token=flag,
    )
    for text in ENCODE_TEXTS:
      assert ours.encode(text, add_bos=True) == ref(text)["input_ids"], (flag, text)
    assert (ours.encode("hi", add_bos=True)[0] == ours.bos_id) == flag


@pytest.mark.parametrize("which", ["qwen_dir", "llama_dir"])
def test_decode_matches_transformers(which, request):
  path = request.getfixturevalue(which)
  ours, ref = HFTokenizer(path), _hf(path)
  for text in ENCODE_TEXTS:
    ids = ref(text)["input_ids"]
    assert ours.decode(ids, skip_special=False) == ref.decode(ids), text
    assert ours.decode(np.asarray(ids, np.int32), skip_special=False) == ref.decode(ids)
  # Specials other than EOS are dropped; skip_special also stops at the first stop id.
  ids = ref("<|im_start|>a<|endoftext|> b")["input_ids"] if which == "qwen_dir" else None
  ids = ids or ref("<|start_header_id|>a<|end_header_id|> b")["input_ids"]
  assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
  body = ref("the answer is 42", add_special_tokens=False)["input_ids"]
  tail = ref("junk after eos", add_special_tokens=False)["input_ids"]
  for eos in ours.eos_ids:
    assert ours.decode([*body, eos, *tail]) == ref.decode(body, skip_special_tokens=True)
    assert ours.decode([*body, eos, *tail], skip_special=False) == ref.decode([*body, eos, *tail])


def test_decode_negative_raises(qwen_dir):
  tok = HFTokenizer(qwen_dir)
  with pytest.raises(
    ValueError, match=rf"token -1 is outside the vocabulary \[0, {tok.vocab_size}\)"
  ):
    tok.decode([5, -1])


def test_decode_drops_ids_past_the_tokenizer_as_transformers_does(qwen_dir):
  """A checkpoint's embedding padded past its tokenizer: a sampled padding row has no text."""
  import transformers

  tok, ref = HFTokenizer(qwen_dir), transformers.AutoTokenizer.from_pretrained(qwen_dir)
  ids = [5, tok.vocab_size, 6, tok.vocab_size + 1000]
  assert tok.decode(ids) == tok.decode([5, 6]) == ref.decode(ids, skip_special_tokens=True)
  assert tok.decode(ids, skip_special=False) == ref.decode(ids)


@pytest.mark.parametrize("which", ["qwen_dir", "llama_dir"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(which, add_generation_prompt, conversation, request):
  path = request.getfixturevalue(which)
  ours, ref = HFTokenizer(path), _hf(path)
  messages = CONVERSATIONS[conversation]
  text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  expected = ref.apply_chat_template(
    messages, tokenize=False, add_generation_prompt=add_generation_prompt
  )
  assert text == expected
  ids = ours.apply_chat_template(
    messages, add_generation_prompt=add_generation_prompt, tokenize=True
  )
  assert ids == ref.apply_chat_template(
    messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
  )


def test_chat_template_extras_match_transformers(qwen_dir, llama_dir):
  messages = CONVERSATIONS[1]
  tools = [{"name": "calc", "description": "évalue <expr> & rend le résultat", "parameters": {}}]
  ours, ref = HFTokenizer(qwen_dir), _hf(qwen_dir)
  text = ours.apply_chat_template(messages, tools=tools)
  assert "évalue <expr> & rend" in text  # tojson keeps non-ASCII and HTML characters as they are
  assert text == ref.apply_chat_template(
    messages, tools=tools, tokenize=False, add_generation_prompt=True
  )
  ours, ref = HFTokenizer(llama_dir), _hf(llama_dir)
  text = ours.apply_chat_template(messages, date_string="26 Jul 2024")
  assert "Today Date: 26 Jul 2024" in text
  assert text == ref.apply_chat_template(
    messages, date_string="26 Jul 2024", tokenize=False, add_generation_prompt=True
  )
  # The default date comes from strftime_now; an empty message is skipped with {% continue %}.
  skipped = [*messages, {"role": "assistant", "content": ""}]
  assert ours.apply_chat_template(skipped) == ref.apply_chat_template(
    skipped, tokenize=False, add_generation_prompt=True
  )


def test_chat_template_from_tokenizer_config(qwen_dir, tmp_path):
  expected = HFTokenizer(qwen_dir).apply_chat_template(CONVERSATIONS[2])
  as_string = _copy(qwen_dir, tmp_path / "str", chat_template=QWEN_TEMPLATE)
  os.remove(as_string / "chat_template.jinja")
  assert HFTokenizer(as_string).apply_chat_template(CONVERSATIONS[2]) == expected
  assert HFTokenizer(as_string).apply_chat_template(CONVERSATIONS[2]) == _hf(
    as_string
  ).apply_chat_template(CONVERSATIONS[2], tokenize=False, add_generation_prompt=True)

  named = [
    {"name": "default", "template": QWEN_TEMPLATE},
    {"name": "short", "template": "{% for m in messages %}{{ m.content }}|{% endfor %}"},
  ]
  as_list = _copy(qwen_dir, tmp_path / "list", chat_template=named)
  os.remove(as_list / "chat_template.jinja")
  tok = HFTokenizer(as_list)
  assert tok.apply_chat_template(CONVERSATIONS[2]) == expected
  assert tok.apply_chat_template(CONVERSATIONS[0], template_name="short") == "What is 12 + 30?|"
  with pytest.raises(
    ChatTemplateError, match=r"no chat template named 'long'.*\['default', 'short'\]"
  ):
    tok.apply_chat_template(CONVERSATIONS[0], template_name="long")


def test_added_token_dicts_and_multiple_eos(llama_dir, tmp_path):
  ref = _hf(llama_dir)
  eot, end = ref.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
  tok = HFTokenizer(llama_dir)
  assert tok.eos_id == eot and tok.eos_ids == (eot, end)  # generation_config order, deduplicated
  assert tok.pad_id == eot  # no pad token: pad with EOS
  eos_dict = {"__type": "AddedToken", "content": "<|end_of_text|>", "special": True}
  path = _copy(llama_dir, tmp_path / "tok", eos_token=eos_dict, pad_token="<|end_header_id|>")
  with open(path / "generation_config.json", "w") as f:
    json.dump({"eos_token_id": eot}, f)
  tok = HFTokenizer(path)
  assert tok.eos_ids == (end, eot)
  assert tok.pad_id == ref.convert_tokens_to_ids("<|end_header_id|>")


def test_load_tokenizer(qwen_dir, tmp_path):
  assert isinstance(load_tokenizer("byte"), ByteTokenizer)
  tok = load_tokenizer(str(qwen_dir))
  assert isinstance(tok, HFTokenizer) and tok.encode("hello") == HFTokenizer(qwen_dir).encode(
    "hello"
  )
  with pytest.raises(ValueError, match=r"expected 'byte' or a directory"):
    load_tokenizer(str(tmp_path / "missing"))
  with pytest.raises(ValueError, match=r"expected 'byte' or a directory"):
    load_tokenizer("bytes")


def test_missing_and_invalid_files(qwen_dir, tmp_path):
  with pytest.raises(TokenizerFileError, match="does not exist or is not a directory"):
    HFTokenizer(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(TokenizerFileError, match=r"empty/tokenizer.json does not exist"):
    HFTokenizer(tmp_path / "empty")
  bad = tmp_path / "bad_json"
  shutil.copytree(qwen_dir, bad)
  (bad / "tokenizer_config.json").write_text("{not json")
  with pytest.raises(TokenizerFileError, match=r"tokenizer_config.json is not valid JSON"):
    HFTokenizer(bad)
  (bad / "tokenizer_config.json").write_text("{}")
  (bad / "tokenizer.json").write_text('{"model": 3}')
  with pytest.raises(TokenizerFileError, match=r"tokenizer.json could not be loaded"):
    HFTokenizer(bad)


def test_invalid_fields(qwen_dir, tmp_path):
  path = _copy(qwen_dir, tmp_path / "unknown_eos", eos_token="<|nope|>")
  with pytest.raises(TokenizerFileError, match=r"field 'eos_token' is '<\|nope\|>', which is not"):
    HFTokenizer(path)
  path = _copy(qwen_dir, tmp_path / "bad_pad", pad_token={"text": "<|endoftext|>"})
  with pytest.raises(
    TokenizerFileError, match=r"field 'pad_token' must be a string, an AddedToken"
  ):
    HFTokenizer(path)
  path = _copy(qwen_dir, tmp_path / "no_eos", eos_token=None)
  with pytest.raises(TokenizerFileError, match=r"no end-of-sequence token.*generation_config.json"):
    HFTokenizer(path)
  (path / "generation_config.json").write_text('{"eos_token_id": "2"}')
  with pytest.raises(TokenizerFileError, match=r"'eos_token_id' must be an int or a list of ints"):
    HFTokenizer(path)
  (path / "generation_config.json").write_text('{"eos_token_id": [1, 99999]}')
  with pytest.raises(TokenizerFileError, match=r"'eos_token_id' holds 99999, outside"):
    HFTokenizer(path)
  path = _copy(qwen_dir, tmp_path / "bad_flag", add_bos_token="yes")
  with pytest.raises(TokenizerFileError, match=r"'add_bos_token' must be a bool"):
    HFTokenizer(path)
  path = _copy(qwen_dir, tmp_path / "bad_template", chat_template=7)
  os.remove(path / "chat_template.jinja")
  with pytest.raises(TokenizerFileError, match=r"field 'chat_template' must be a string or a list"):
    HFTokenizer(path)


def test_chat_template_errors(qwen_dir, llama_dir, tmp_path):
  with pytest.raises(
    ChatTemplateError, match=r"chat_template.jinja failed to render.*roles must be"
  ):
    HFTokenizer(llama_dir).apply_chat_template([{"role": "tool", "content": "42"}])
  with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with a 'role' key"):
    HFTokenizer(llama_dir).apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
  with pytest.raises(ChatTemplateError, match=r"failed to render: UndefinedError"):
    HFTokenizer(qwen_dir).apply_chat_template([])  # messages[0] of an empty list

  path = _copy(qwen_dir, tmp_path / "none", chat_template=None)
  os.remove(path / "chat_template.jinja")
  with pytest.raises(ChatTemplateError, match=r"has no chat template: expected .*'chat_template'"):
    HFTokenizer(path).apply_chat_template(CONVERSATIONS[0])
  (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
  with pytest.raises(ChatTemplateError, match=r"chat_template.jinja does not compile: line 1"):
    HFTokenizer(path).apply_chat_template(CONVERSATIONS[0])
  (path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
  with pytest.raises(ChatTemplateError, match=r"failed to render: SecurityError"):
    HFTokenizer(path).apply_chat_template(CONVERSATIONS[0])
