"""Config validation: every bad value is an error that names the field and what is allowed."""

from pathlib import Path

import ml_collections
import pytest

import configs.grpo_arith as grpo_arith
from jaxrl.config import (
  Config,
  ConfigError,
  RLConfig,
  complete,
  config_module,
  field_paths,
  unknown_field_message,
  validate,
)

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.py"))


def test_defaults_and_the_shipped_config_validate():
  assert isinstance(validate({}), Config)
  c = validate(grpo_arith.get_config(None))
  assert c.rl.group_size == 8 and c.task.operand_dist == "uniform"
  # Estimators without a group accept one sample per prompt.
  assert validate({"rl": {"group_size": 1, "advantage": "gae"}}).rl.group_size == 1
  assert validate({"rl": {"group_size": 1, "advantage": "reinforce_pp"}}).rl.group_size == 1
  assert validate({"rl": {"kl": {"beta": 1}}}).rl.kl.beta == 1.0  # an int is a fine float


@pytest.mark.parametrize(
  "raw, message",
  [
    (
      {"rl": {"kl": {"betta": 0.1}}},
      r"unknown field\(s\) config\.rl\.kl\.betta; valid fields of config\.rl\.kl",
    ),
    ({"colour": 1}, r"unknown field\(s\) config\.colour"),
    ({"rl": {"kl": {"beta": "x"}}}, r"config\.rl\.kl\.beta must be float, got str"),
    ({"rl": {"steps": True}}, r"config\.rl\.steps must be int, got bool"),
    ({"rl": {"kl": {"beta": float("nan")}}}, r"config\.rl\.kl\.beta must be finite"),
    ({"rl": {"kl": {"beta": -0.1}}}, r"config\.rl\.kl\.beta=-0\.1 is out of range; must be >= 0"),
    (
      {"rl": {"group_size": 1}},
      r"config\.rl\.group_size=1 is invalid; allowed: >= 2 with the group estimator "
      r"rl\.advantage='grpo'.*works with \['gae', 'reinforce_pp'\]",
    ),
    (
      {"rl": {"group_size": 1, "advantage": "rloo"}},
      r"config\.rl\.group_size=1 is invalid; allowed: >= 2 with the group estimator",
    ),
    (
      {"rl": {"group_size": 1, "advantage": "gae", "dynamic_sampling": {"enabled": True}}},
      r"config\.rl\.group_size=1 is invalid; allowed: >= 2 with rl\.dynamic_sampling",
    ),
    ({"rl": {"group_size": 0}}, r"config\.rl\.group_size=0 is out of range; must be >= 1"),
    (
      {"rl": {"rollout": {"learner_fake_quant": True}}},
      r"config\.rl\.rollout\.learner_fake_quant=True is invalid; allowed: False with "
      r"rl\.rollout\.quantize='none'",
    ),
    (
      {"rl": {"rollout": {"quantize": "fp4", "learner_fake_quant_part": "weights"}}},
      r"config\.rl\.rollout\.learner_fake_quant_part='weights' is invalid; allowed: 'both' "
      r"without rl\.rollout\.learner_fake_quant",
    ),
    (
      {"rl": {"prompts_per_step": 16, "prompt_pool": 8}},
      r"config\.rl\.prompt_pool=8 is invalid; allowed: 0 \(an endless stream\) or >= "
      r"rl\.prompts_per_step = 16",
    ),
    ({"rl": {"critic": {"lam": 1.5}}}, r"config\.rl\.critic\.lam=1\.5 is out of range"),
    ({"rl": {"critic": {"gamma": -0.1}}}, r"config\.rl\.critic\.gamma=-0\.1 is out of range"),
    (
      {"distill": {"enabled": True}},
      r"config\.distill\.teacher\.path='' is invalid; allowed: an HF checkpoint directory",
    ),
    (
      {"distill": {"adaptive": True}},
      r"config\.distill\.window=0 is invalid; allowed: > 0 \(the starting window\)",
    ),
    (
      {"distill": {"loss": "jsd"}},
      r"config\.distill\.loss='jsd' is invalid; allowed: \['reverse_kl'",
    ),
    ({"sft": {"batch_size": 0}}, r"config\.sft\.batch_size=0 is out of range; must be >= 1"),
    (
      {"rl": {"sampling": {"temperature": 0.0}}},
      r"config\.rl\.sampling\.temperature=0\.0 is out of range; must be > 0",
    ),
    ({"rl": {"sampling": {"top_p": 1.5}}}, r"config\.rl\.sampling\.top_p=1\.5 is out of range"),
    ({"rl": {"advantage": "ppo"}}, r"config\.rl\.advantage='ppo' is invalid; allowed: \[.*'grpo'"),
    (
      {"rl": {"loss": {"name": "x"}}},
      r"config\.rl\.loss\.name='x' is invalid; allowed: \[.*ppo_clip",
    ),
    ({"reward": {"on_error": "skip"}}, r"config\.reward\.on_error='skip' is invalid"),
    (
      {"reward": {"name": "exact_mach"}},
      r"config\.reward\.name='exact_mach' is invalid; allowed: one of \[.*'exact_match'",
    ),
    ({"task": {"ops": "+/"}}, r"config\.task\.ops='\+/' is invalid"),
    ({"mesh": {"fsdp": 0}}, r"config\.mesh\.fsdp=0 is invalid"),
    (
      {"rl": {"num_microbatches": 3}},
      r"config\.rl\.num_microbatches=3 is invalid; allowed: a divisor",
    ),
    (
      {"rl": {"num_minibatches": 3}},
      r"config\.rl\.num_minibatches=3 is invalid; allowed: a divisor",
    ),
    ({"rl": 5}, r"config\.rl must be a section"),
    (
      {"rl": {"offpolicy": {"method": "ppo_ewma"}}},
      r"config\.rl\.offpolicy\.method='ppo_ewma' is invalid; allowed: \['decoupled', 'm2po', 'n",
    ),
    (
      {"rl": {"offpolicy": {"is_correction": "icepop"}}},
      r"config\.rl\.offpolicy\.is_correction='icepop' is invalid; allowed: \[.*'mis'.*'tis'",
    ),
    (
      {"rl": {"offpolicy": {"prox": "ewma"}}},
      r"config\.rl\.offpolicy\.prox='ewma' is invalid; allowed: \['recompute'",
    ),
    (
      {"rl": {"offpolicy": {"is_cap": 0.9}}},
      r"config\.rl\.offpolicy\.is_cap=0\.9 is out of range; must be >= 1",
    ),
    (
      {"rl": {"offpolicy": {"mis_low": 0.0}}},
      r"config\.rl\.offpolicy\.mis_low=0\.0 is out of range; must be > 0",
    ),
    (
      {"rl": {"offpolicy": {"mis_low": 1.5}}},
      r"config\.rl\.offpolicy\.mis_low=1\.5 is out of range; must be <= 1",
    ),
    (
      {"rl": {"offpolicy": {"mis_high": 0.8}}},
      r"config\.rl\.offpolicy\.mis_high=0\.8 is out of range; must be >= 1",
    ),
    (
      {"rl": {"offpolicy": {"mis_low": 1.0, "mis_high": 1.0}}},
      r"config\.rl\.offpolicy\.mis_high=1\.0 is invalid; allowed: > rl\.offpolicy\.mis_low = 1",
    ),
    (
      {"rl": {"offpolicy": {"m2po_tau": 0.0}}},
      r"config\.rl\.offpolicy\.m2po_tau=0\.0 is out of range; must be > 0",
    ),
    (
      {"rl": {"offpolicy": {"sat_tail": -1.0}}},
      r"config\.rl\.offpolicy\.sat_tail=-1\.0 is out of range; must be > 0",
    ),
    (
      {"rl": {"loss": {"entropy_coef": -0.01}}},
      r"config\.rl\.loss\.entropy_coef=-0\.01 is out of range; must be >= 0",
    ),
    (
      {"distill": {"enabled": True, "teacher": {"preset": "tiny"}}, "rl": {"kl": {"beta": 0.1}}},
      r"config\.rl\.kl\.beta=0\.1 is invalid; allowed: 0 with distill\.enabled",
    ),
    (
      {"rl": {"overlong": {"buffer": 9}}},
      r"config\.rl\.overlong\.buffer=9 is invalid; allowed: 0 \(off\) to rl\.max_new_tokens = 8",
    ),
    (
      {"rl": {"overlong": {"penalty": -1}}},
      r"config\.rl\.overlong\.penalty=-1\.0 is out of range; must be >= 0",
    ),
    (
      {"rl": {"dynamic_sampling": {"max_rounds": 0}}},
      r"config\.rl\.dynamic_sampling\.max_rounds=0 is out of range; must be >= 1",
    ),
    (
      {"rl": {"dynamic_sampling": {"rounds": 2}}},
      r"unknown field\(s\) config\.rl\.dynamic_sampling\.rounds",
    ),
    (
      {"rl": {"partial": {"enabled": True}, "dynamic_sampling": {"enabled": True}}},
      r"config\.rl\.partial\.enabled=True is invalid; allowed: False with "
      r"rl\.dynamic_sampling\.enabled",
    ),
    (
      {"rl": {"partial": {"over_provision": 0.5}}},
      r"config\.rl\.partial\.over_provision=0\.5 is out of range; must be >= 1",
    ),
    ({"rl": {"partial": {"max_age": -1}}}, r"config\.rl\.partial\.max_age=-1 is out of range"),
    (
      {"rl": {"prompt_filter": {"window_low": 0.6, "window_high": 0.4}}},
      r"config\.rl\.prompt_filter\.window_high=0\.4 is invalid; allowed: > "
      r"rl\.prompt_filter\.window_low = 0\.6",
    ),
    (
      {"rl": {"prompt_filter": {"method": "greso"}, "partial": {"enabled": True}}},
      r"config\.rl\.prompt_filter\.method='greso' is invalid; allowed: 'none' with "
      r"rl\.partial\.enabled",
    ),
    (
      {"rl": {"placement": {"kind": "mixed"}}},
      r"config\.rl\.placement\.kind='mixed' is invalid; allowed: \['colocated', 'split'\]",
    ),
    (
      {"rl": {"prompts_per_step": 4, "replay": {"ratio": 0.2}}},
      r"config\.rl\.replay\.ratio=0\.2 is invalid; allowed: 0 \(off\) or a share whose "
      r"floor\(ratio \* prompts_per_step=4\) is at least 1 group",
    ),
    (
      {"rl": {"replay": {"ratio": 0.5}, "dynamic_sampling": {"enabled": True}}},
      r"config\.rl\.dynamic_sampling\.enabled=True is invalid; allowed: off with "
      r"rl\.replay\.ratio > 0",
    ),
    (
      {"rl": {"replay": {"ratio": 0.5, "max_age": 2}, "placement": {"max_staleness": 2}}},
      r"config\.rl\.replay\.max_age=2 is invalid; allowed: > rl\.placement\.max_staleness = 2",
    ),
    (
      {"rl": {"group_size": 4, "allocation": {"method": "vigor", "initial": 6}}},
      r"config\.rl\.allocation\.initial=6 is invalid; allowed: 2 to rl\.group_size = 4",
    ),
    (
      {"rl": {"group_size": 4, "allocation": {"method": "vigor", "max_group": 3}}},
      r"config\.rl\.allocation\.max_group=3 is invalid; allowed: 0 \(2 \* group_size\) or "
      r">= rl\.group_size = 4",
    ),
    (
      {"rl": {"allocation": {"method": "pilot_commit"}, "partial": {"enabled": True}}},
      r"config\.rl\.partial\.enabled=True is invalid; allowed: off with "
      r"rl\.allocation\.method='pilot_commit'",
    ),
    (
      {"rl": {"allocation": {"method": "vigor", "initial": 1}}},
      r"config\.rl\.allocation\.initial=1 is out of range; must be >= 2",
    ),
    (
      {"task": {"name": "chain", "min_terms": 6, "max_terms": 4}},
      r"config\.task\.max_terms=4 is invalid; allowed: >= task\.min_terms = 6",
    ),
    ({"sft": {"careless_rate": 1.5}}, r"config\.sft\.careless_rate=1\.5 is out of range"),
    (
      {"sft": {"careless_rate": 0.5}, "task": {"name": "jsonl", "path": "x.jsonl"}},
      r"config\.sft\.careless_rate=0\.5 is invalid; allowed: 0 unless task\.name='arithmetic'",
    ),
    (
      {"rl": {"skip_zero_advantage": "on"}},
      r"config\.rl\.skip_zero_advantage='on' is invalid; allowed: \['auto', 'off'\]",
    ),
  ],
)
def test_bad_values_name_the_field(raw, message):
  with pytest.raises(ConfigError, match=message):
    validate(raw)


# ------------------------------------------------------- complete: every field in a config file


def _leaf_paths(node, prefix=""):
  out = {}
  for key, value in node.items():
    if hasattr(value, "items"):
      out[f"{prefix}{key}"] = True
      out.update(_leaf_paths(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = False
  return out


@pytest.mark.parametrize("variant", [None, "smoke"])
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_file_holds_every_field(path, variant):
  """What a config flag can override is what the ConfigDict holds: all of `Config`, no more."""
  assert _leaf_paths(config_module(path).get_config(variant)) == field_paths()


def test_complete_keeps_what_is_set_and_changes_nothing_validate_sees():
  raw = ml_collections.ConfigDict({"rl": {"kl": {"beta": 0.5}, "rollout": {"slots": 3}}, "seed": 7})
  before = validate(raw)
  done = complete(raw)
  assert done is raw
  assert raw.rl.kl.beta == 0.5 and raw.rl.rollout.slots == 3 and raw.seed == 7
  assert raw.rl.group_size == RLConfig().group_size and raw.model.lora_rank == 0
  assert validate(raw) == before
  assert complete(raw).to_dict() == raw.to_dict()  # idempotent


def test_complete_leaves_a_section_given_as_a_value_for_validate_to_report():
  raw = ml_collections.ConfigDict({"rl": {"rollout": 3}})
  complete(raw)
  with pytest.raises(ConfigError, match=r"config\.rl\.rollout must be a section"):
    validate(raw)


@pytest.mark.parametrize(
  "path, message",
  [
    ("rl.kl.beta", None),
    ("rl.rollout", None),
    ("rl.kl.betta", "unknown field config.rl.kl.betta; did you mean config.rl.kl.beta?"),
    ("rl.beta", "unknown field config.rl.beta; did you mean config.rl.kl.beta?"),
    ("sft.carelessrate", "did you mean config.sft.careless_rate?"),
    ("rl.lora_rank", "unknown field config.rl.lora_rank; did you mean config.model.lora_rank?"),
    ("lora_rank", "did you mean config.model.lora_rank?"),
    (
      "rl.rollout.zzz",
      "unknown field config.rl.rollout.zzz; valid fields of config.rl.rollout: batching, env, "
      "kv_dtype, kv_fraction, learner_fake_quant, learner_fake_quant_part, max_turns, num_pages, "
      "overlap_rewards, page_size, prefill_batch_prompts, quantize, routes, slots, "
      "steps_per_call, turn_tokens",
    ),
    ("nope.x", "unknown field config.nope.x; valid fields of config: checkpoint, distill,"),
  ],
)
def test_unknown_field_message_names_the_path_and_the_closest_fields(path, message):
  got = unknown_field_message(path)
  if message is None:
    assert got is None
  else:
    assert got is not None and message in got, got


def test_docs_configs_md_is_the_generated_reference_of_every_field():
  """docs/configs.md cannot drift from the dataclasses: its reference block is regenerated
  from them here, and every field path has a row in it."""
  from jaxrl.config_reference import REFERENCE_BEGIN, REFERENCE_END, reference_markdown

  text = (Path(__file__).parent.parent / "docs" / "configs.md").read_text()
  block = text.split(REFERENCE_BEGIN)[1].split(REFERENCE_END)[0]
  assert block.strip() == reference_markdown().strip(), (
    "docs/configs.md is stale: run python -c 'from jaxrl.config_reference import write_reference; "
    "write_reference()'"
  )
  for path in field_paths():
    section, _, name = path.rpartition(".")
    heading = f"### `config.{section}`" if section else "### `config` (top level)"
    assert heading in block, path
    assert f"| `{name}` |" in block.split(heading)[1].split("### ")[0], path
