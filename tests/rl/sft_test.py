"""The warm-start's batches: a demonstration past rl.max_new_tokens that Run.build's up-front
check did not reach (it reads the first records of the stream) is still a config error naming
the field, not a traceback from the batch layout."""

import types

import numpy as np
import pytest

from jaxrl.config import ConfigError
from jaxrl.rl.sft import SFTPhase
from jaxrl.tokenizer import ByteTokenizer


def _phase(max_new_tokens: int) -> SFTPhase:
  tok = ByteTokenizer()
  run = types.SimpleNamespace(
    tokenizer=tok,
    cfg=types.SimpleNamespace(rl=types.SimpleNamespace(max_new_tokens=max_new_tokens)),
    prompts=lambda records: (np.zeros((len(records), 4), np.int32), np.ones((len(records), 4))),
  )
  phase = SFTPhase.__new__(SFTPhase)  # the batch layout alone: no optimizer, no model
  phase.run, phase.task = run, types.SimpleNamespace(sft_completion=lambda r: r["demo"])
  return phase


def test_a_demonstration_past_the_budget_is_a_config_error_naming_it():
  records = [{"demo": "12"}, {"demo": "1234"}]
  with pytest.raises(
    ConfigError,
    match=r"config\.rl\.max_new_tokens=3 is shorter than the "
    r"warm-start's demonstrations \(with their EOS\): '1234' is 5 tokens",
  ):
    _phase(3).batch(records)
  batch = _phase(5).batch(records)  # the same records fit a budget of 5
  assert np.asarray(batch.loss_mask).sum() == 3 + 5
