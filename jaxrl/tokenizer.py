"""Tokenizers behind one interface: a built-in byte tokenizer and HF `tokenizers` directories."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
  """What jaxrl needs from a tokenizer; `ByteTokenizer` and `HFTokenizer` implement it.

  `bos_id` is None for tokenizers without a BOS token (Qwen); `encode(add_bos=True)` then adds
  nothing. `eos_ids` holds every id that ends a generation (`eos_id` is the first of them).
  """

  pad_id: int
  bos_id: int | None
  eos_id: int
  eos_ids: tuple[int, ...]
  vocab_size: int

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes shifted past three specials: pad=0, bos=1, eos=2, byte b -> b + 3."""

  pad_id = 0
  bos_id = 1
  eos_id = 2
  eos_ids = (2,)
  num_special = 3
  vocab_size = 256 + num_special

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
    ids = [b + self.num_special for b in text.encode("utf-8")]
    return [self.bos_id, *ids] if add_bos else ids

  def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
    out = bytearray()
    for i in ids:
      i = int(i)
      if not 0 <= i < self.vocab_size:  # before the special check: negative ids are not specials
        raise ValueError(f"token {i} is outside the byte vocabulary [0, {self.vocab_size})")
      if i == self.eos_id and skip_special:
        break
      if i < self.num_special:
        if skip_special:
          continue
        raise ValueError(f"token {i} is a special token and has no byte form")
      out.append(i - self.num_special)
    return out.decode("utf-8", errors="replace")


class TokenizerFileError(ValueError):
  """A tokenizer directory with a missing or invalid file or field; the message names it."""


class ChatTemplateError(ValueError):
  """A chat template that is missing, does not compile, or fails to render."""


_SPECIAL_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read_json(path: str, *, required: bool) -> dict[str, Any] | None:
  if not os.path.exists(path):
    if required:
      raise TokenizerFileError(f"{path} does not exist")
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise TokenizerFileError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(data, dict):
    raise TokenizerFileError(f"{path} must hold a JSON object, got {type(data).__name__}")
  return data


def _token_content(value: Any, where: str) -> str | None:
  """A special token given as a string, an AddedToken dict ({"content": ...}) or null."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  raise TokenizerFileError(
    f"{where} must be a string, an AddedToken dict with a 'content' string, or null; got {value!r}"
  )


def _chat_env():
  """A sandboxed Jinja2 environment set up like transformers' `_compile_jinja_template`."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class _Generation(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for masks in transformers;
    # rendering it is the identity.
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env


class HFTokenizer:
  """A Hugging Face tokenizer directory: tokenizer.json + tokenizer_config.json (+ chat template).

  Reads
    - `tokenizer.json` with the `tokenizers` library (padding / truncation settings in it are
      switched off: the RL loop pads and checks prompt lengths itself);
    - `tokenizer_config.json`: bos/eos/pad/unk tokens (strings or AddedToken dicts),
      `add_bos_token` (when present it decides BOS, as in transformers' Llama / Gemma
      tokenizers; when absent tokenizer.json's post-processor does), and `chat_template` (a
      string, or a list of {name, template});
    - `chat_template.jinja` (transformers >= 5 writes the template there; it wins over the
      config's);
    - `generation_config.json` `eos_token_id` (int or list) when present: generation stops on
      any of `eos_ids`, e.g. Llama 3 Instruct's <|eot_id|> and <|end_of_text|>.

  Wiring into the RL loop: render a chat prompt with `apply_chat_template(messages)` (the
  template writes BOS itself, so encode the result with `add_bos=False`, or pass
  `tokenize=True`); stop sampling on any of `eos_ids`; pad with `pad_id` (the tokenizer's pad
  token, else `eos_id`). `vocab_size` is the tokenizer's, which is often smaller than the
  checkpoint's embedding table (Qwen: 151665 vs 151936): size the model from its own config.
  """

  def __init__(self, path: str | os.PathLike):
    from tokenizers import Tokenizer as _Tokenizer

    path = os.fspath(path)
    if not os.path.isdir(path):
      raise TokenizerFileError(f"tokenizer directory {path!r} does not exist or is not a directory")
    self.path = path
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
      raise TokenizerFileError(f"{tok_file} does not exist (only tokenizer.json is supported)")
    try:
      self._tok = _Tokenizer.from_file(tok_file)
    except Exception as e:
      raise TokenizerFileError(f"{tok_file} could not be loaded by `tokenizers`: {e}") from e
    self._tok.no_padding()
    self._tok.no_truncation()

    cfg_file = os.path.join(path, "tokenizer_config.json")
    config = _read_json(cfg_file, required=False) or {}
    self.config = config
    self.special_tokens: dict[str, str | None] = {}
    ids: dict[str, int | None] = {}
    for field in _SPECIAL_FIELDS:
      content = _token_content(config.get(field), f"{cfg_file} field {field!r}")
      self.special_tokens[field] = content
      ids[field] = None if content is None else self._tok.token_to_id(content)
      if content is not None and ids[field] is None:
        raise TokenizerFileError(
          f"{cfg_file} field {field!r} is {content!r}, which is not in the vocabulary of {tok_file}"
        )

    gen_file = os.path.join(path, "generation_config.json")
    gen_config = _read_json(gen_file, required=False) or {}
    gen_eos = gen_config.get("eos_token_id")
    if gen_eos is None:
      gen_eos = []
    elif isinstance(gen_eos, int) and not isinstance(gen_eos, bool):
      gen_eos = [gen_eos]
    if not isinstance(gen_eos, list) or not all(
      isinstance(i, int) and not isinstance(i, bool) for i in gen_eos
    ):
      raise TokenizerFileError(
        f"{gen_file} field 'eos_token_id' must be an int or a list of ints, got {gen_eos!r}"
      )
    eos_ids = [ids["eos_token"]] if ids["eos_token"] is not None else []
    eos_ids += [i for i in gen_eos if i not in eos_ids]
    if not eos_ids:
      raise TokenizerFileError(
        f"no end-of-sequence token: set 'eos_token' in {cfg_file} or 'eos_token_id' in {gen_file}"
      )

    self.vocab_size = max(
      self._tok.get_vocab_size(with_added_tokens=True),
      1 + max(self._tok.get_added_tokens_decoder(), default=-1),
    )
    for i in eos_ids:
      if not 0 <= i < self.vocab_size:
        raise TokenizerFileError(
          f"{gen_file} field 'eos_token_id' holds {i}, outside the vocabulary "
          f"[0, {self.vocab_size})"
        )
    self.eos_ids = tuple(eos_ids)
    self.eos_id = eos_ids[0]
    self.bos_id = ids["bos_token"]
    # Llama 3 has no pad token; padded positions are masked, so any valid id serves.
    self.pad_id = ids["pad_token"] if ids["pad_token"] is not None else self.eos_id
    self.unk_id = ids["unk_token"]

    add_bos = config.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
      raise TokenizerFileError(f"{cfg_file} field 'add_bos_token' must be a bool, got {add_bos!r}")
    if add_bos is None:
      # As transformers does without the flag: BOS comes from tokenizer.json's post-processor.
      add_bos = self._tok.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]
    self.add_bos_token = bool(add_bos) and self.bos_id is not None

    self._templates, self._template_source = self._read_chat_templates(cfg_file, config)
    self._compiled: dict[str | None, Any] = {}

  # ----------------------------------------------------------------------------- text <-> ids

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
    """Token ids of `text`; `add_bos` prepends BOS when this tokenizer uses one.

    `encode(text, add_bos=True)` equals transformers' `tok(text)["input_ids"]` for tokenizers
    that add no EOS. Special-token strings inside `text` map to their ids, as in transformers.
    """
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return [self.bos_id, *ids] if add_bos and self.add_bos_token else ids

  def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
    """Text of `ids`. With `skip_special`, stops at the first of `eos_ids` (like ByteTokenizer)
    and drops the remaining special tokens; otherwise decodes every id, specials included.

    Ids at or above `vocab_size` have no text and are dropped, as transformers drops them: a
    checkpoint's embedding is often padded past its tokenizer (Qwen3: 151,936 rows for 151,669
    tokens), and a sampler can draw those rows. A negative id is an error."""
    ids = [int(i) for i in ids]
    for i in ids:
      if i < 0:
        raise ValueError(f"token {i} is outside the vocabulary [0, {self.vocab_size})")
    ids = [i for i in ids if i < self.vocab_size]
    if skip_special:
      stops = [n for n, i in enumerate(ids) if i in self.eos_ids]
      ids = ids[: stops[0]] if stops else ids
    return self._tok.decode(ids, skip_special_tokens=skip_special)

  # --------------------------------------------------------------------------- chat templates

  def _read_chat_templates(self, cfg_file: str, config: dict[str, Any]):
    jinja_file = os.path.join(self.path, "chat_template.jinja")
    if os.path.exists(jinja_file):
      with open(jinja_file, encoding="utf-8") as f:
        return {None: f.read()}, jinja_file
    where = f"{cfg_file} field 'chat_template'"
    template = config.get("chat_template")
    if template is None:
      return {}, where
    if isinstance(template, str):
      return {None: template}, where
    is_named = lambda t: (
      isinstance(t, Mapping) and all(isinstance(t.get(k), str) for k in ("name", "template"))
    )
    if isinstance(template, list) and all(is_named(t) for t in template):
      named = {t["name"]: t["template"] for t in template}
      if "default" in named:
        named[None] = named["default"]
      return named, where
    raise TokenizerFileError(
      f"{where} must be a string or a list of {{'name': str, 'template': str}}, got "
      f"{type(template).__name__}"
    )

  @property
  def chat_template(self) -> str | None:
    """The default chat template source, or None when the directory has none."""
    return self._templates.get(None)

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tokenize: bool = False,
    template_name: str | None = None,
    **kwargs,
  ) -> str | list[int]:
    """Renders `messages` ([{"role": ..., "content": ...}, ...]) with the chat template.

    Matches transformers' `apply_chat_template(messages, tokenize=False, ...)`: the template sees
    `messages`, `add_generation_prompt`, `tools`/`documents` (None unless given), the special
    token strings (`bos_token`, `eos_token`, ...) and `kwargs` (e.g. `enable_thinking=False`).
    With `tokenize=True` returns `encode(text, add_bos=False)`: the template writes BOS itself.
    `template_name` picks one of several named templates (default: "default").
    """
    env_template = self._compiled_template(template_name)
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
      raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for n, message in enumerate(messages):
      if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"messages[{n}] must be a dict with a 'role' key, got {message!r}")
    context = {k: v for k, v in self.special_tokens.items() if v is not None}
    context.update(tools=None, documents=None)
    context.update(kwargs)
    try:
      text = env_template.render(
        messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **context
      )
    except Exception as e:
      raise ChatTemplateError(
        f"chat template from {self._template_source} failed to render: {type(e).__name__}: {e}"
      ) from e
    return self.encode(text, add_bos=False) if tokenize else text

  def _compiled_template(self, name: str | None):
    if name not in self._compiled:
      if name not in self._templates:
        if not self._templates:
          raise ChatTemplateError(
            f"{self.path} has no chat template: expected {self._template_source} or "
            f"{os.path.join(self.path, 'chat_template.jinja')}"
          )
        named = sorted(k for k in self._templates if k is not None)
        raise ChatTemplateError(
          f"no chat template named {name!r} in {self._template_source}; named templates: {named}"
        )
      import jinja2

      try:
        self._compiled[name] = _chat_env().from_string(self._templates[name])
      except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
          f"chat template from {self._template_source} does not compile: line {e.lineno}: {e}"
        ) from e
    return self._compiled[name]


def load_tokenizer(spec: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
  """`"byte"` -> ByteTokenizer; a Hugging Face tokenizer directory -> HFTokenizer."""
  if spec == "byte":
    return ByteTokenizer()
  if isinstance(spec, str | os.PathLike) and os.path.isdir(spec):
    return HFTokenizer(spec)
  raise ValueError(
    f"tokenizer={spec!r}: expected 'byte' or a directory holding a Hugging Face tokenizer.json"
  )
