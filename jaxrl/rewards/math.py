"""Math final-answer rewards: GSM8K-style extraction and number matching, and math-verify."""

import fractions
import importlib.util
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from jaxrl.registry import REWARDS
from jaxrl.rewards import registry

# ASCII digits only: a look-alike (Arabic-Indic, fullwidth, mathematical bold) is not the digit.
_NUMBER_RE = re.compile(
  r"[-+]?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-+]?\$?\.\d+", re.ASCII
)
# A number longer than this is compared as text: turning a megabyte of digits into a fraction
# takes minutes, and printing one past 4300 digits raises.
_MAX_NUMBER_CHARS = 400
_HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?\s*([^\n]*)", re.IGNORECASE)
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$", re.ASCII)
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{[^{}]*\}")


def _last_boxed(text: str) -> str | None:
  """Contents of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
  start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
  if start < 0:
    return None
  i = text.index("{", start) + 1
  depth = 1
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i:j]
  return None  # unbalanced: the completion was cut off inside the box


def extract_answer(completion: str) -> str | None:
  """The final answer a completion commits to, or None.

  In order of precedence: the text after the last `#### `, the last `\\boxed{...}`, the text
  after the last "the answer is", and otherwise the last number anywhere in the completion.
  """
  for pattern in (_HASHES_RE, None, _ANSWER_IS_RE):
    if pattern is None:
      boxed = _last_boxed(completion)
      if boxed is not None and boxed.strip():
        return boxed.strip()
      continue
    matches = pattern.findall(completion)
    if matches and matches[-1].strip():
      found = matches[-1].strip()
      # "#### 72 clips." / "The answer is $1,200 in total.": keep the first number.
      number = _NUMBER_RE.search(found)
      return number.group(0) if number else found
  numbers = _NUMBER_RE.findall(completion)
  return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
  """A canonical form: numbers as reduced fractions ("1,000.0" -> "1000", "0.50" -> "1/2",
  "\\frac{1}{2}" -> "1/2", "$-3" -> "-3"); anything else stripped, lower-cased, spaces removed."""
  text = _TEXT_RE.sub("", answer)
  for junk in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\ ", "\\left", "\\right"):
    text = text.replace(junk, "")
  text = text.strip().rstrip(".").strip()
  if (frac := _FRAC_RE.match(text)) is not None:
    num, den = _to_fraction(frac.group(2)), _to_fraction(frac.group(3))
    if num is not None and den:
      value = num / den
      return str(-value if frac.group(1) else value)
  value = _to_fraction(text)
  if value is not None:
    return str(value)
  return "".join(text.split()).lower()


def _to_fraction(text: str) -> fractions.Fraction | None:
  text = text.strip()
  if len(text) > _MAX_NUMBER_CHARS:
    return None
  if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text, re.ASCII):
    text = text.replace(",", "")
  if re.fullmatch(r"[-+]?\d+/\d+", text, re.ASCII):
    num, den = text.split("/")
    return fractions.Fraction(int(num), int(den)) if int(den) else None
  if not re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", text, re.ASCII):
    return None
  try:
    return fractions.Fraction(Decimal(text))
  except (InvalidOperation, ValueError):
    return None


def _reference(record: dict[str, Any]) -> str:
  answer = record.get("answer") if isinstance(record, dict) else None
  if not isinstance(answer, str | int | float) or isinstance(answer, bool):
    raise ValueError(f"record needs an 'answer' (the final answer as a str), got {answer!r}")
  return str(answer)


@registry.register("gsm8k")
def gsm8k(completion: str, record: dict[str, Any]) -> float:
  """1.0 iff the completion's final answer (`extract_answer`) equals `record["answer"]`,
  both normalised by `normalize_answer` (so "$1,000.00" matches "1000"), else 0.0."""
  reference = normalize_answer(_reference(record))
  predicted = extract_answer(completion)
  return 1.0 if predicted is not None and normalize_answer(predicted) == reference else 0.0


# The same reward under a task-neutral name, for MATH-style data with \boxed answers.
registry.register("math_answer")(gsm8k)


# Registered only when math-verify is installed; imported on first use, since it pulls in sympy
# (about a second) and most runs never call it.
if importlib.util.find_spec("math_verify") is not None:

  @REWARDS.register("math_verify", unbounded=True)
  def math_verify_reward(completion: str, record: dict[str, Any]) -> float:
    """1.0 iff math-verify finds the completion's answer equivalent to `record["answer"]`.

    Timeouts are off (`parsing_timeout=None`, `timeout_seconds=None`): math-verify enforces
    them with signals, which only work in the main thread, and rewards may run in a pool.
    Registered `unbounded`: sympy can work without end on a pathological answer, so a config
    must score it in worker processes under reward.timeout_s (checked by config validation).
    """
    import math_verify

    reference = _reference(record)
    gold = math_verify.parse(reference, parsing_timeout=None)
    if not gold and "$" not in reference:
      # Bare LaTeX ("\\sqrt{8}") has no anchor for math-verify's extractor; math delimiters do.
      gold = math_verify.parse(f"${reference}$", parsing_timeout=None)
    if not gold:
      raise ValueError(f"math-verify cannot parse the record's answer {reference!r}")
    predicted = math_verify.parse(completion, parsing_timeout=None)
    return 1.0 if math_verify.verify(gold, predicted, timeout_seconds=None) else 0.0
