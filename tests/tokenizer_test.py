"""ByteTokenizer tests: UTF-8 round trips, specials, EOS handling, out-of-range ids."""

import numpy as np
import pytest

from jaxrl.tokenizer import ByteTokenizer

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
