"""Tokenizers behind one interface: a built-in byte tokenizer (HF `tokenizers` comes later)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
  """What jaxrl needs from a tokenizer; HF `tokenizers` wrappers implement the same."""

  pad_id: int
  bos_id: int
  eos_id: int
  vocab_size: int

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes shifted past three specials: pad=0, bos=1, eos=2, byte b -> b + 3."""

  pad_id = 0
  bos_id = 1
  eos_id = 2
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
