"""The reward section: which function scores completions, how its failures count, and the
sandbox that code-execution rewards run programs in."""

import dataclasses

from jaxrl.config_fields import option as _field


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits for each program a code reward runs (jaxrl.rewards.sandbox)."""

  isolation: str = _field(
    "auto",
    choices=("auto", "namespaces", "limits"),
    help="namespaces: Linux network/PID/mount/IPC/UTS namespaces via unshare (refuse to run "
    "without them); limits: resource limits and the audit hook only; auto: namespaces where "
    "available, else limits with a warning (summary.json records which ran)",
  )
  cpu_s: int = _field(2, lo=1, help="CPU seconds per program")
  wall_s: float = _field(5.0, lo=0.0, lo_open=True, help="wall-clock seconds per program")
  memory_mb: int = _field(512, lo=64, help="address space per program (MiB)")
  file_size_mb: int = _field(4, lo=1, help="the largest file a program may write (MiB)")
  processes: int = _field(4, lo=1, help="processes per program, its interpreter included")
  output_kb: int = _field(
    64, lo=1, help="stdout + stderr captured (KiB); beyond it the program is killed"
  )
  workers: int = _field(2, lo=1, hi=64, help="programs run at once")
  dedupe: bool = _field(
    True,
    help="identical programs in one batch run once and share the outcome (programs are "
    "taken to be deterministic); off: every copy runs",
  )


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  name: str = _field("exact_match", help="a reward function registered in jaxrl.rewards")
  on_error: str = _field(
    "raise",
    choices=("raise", "zero"),
    help="a reward function that raises or returns a non-number, a non-finite value or one "
    "beyond max_abs: stop the run, or score 0 and count it",
  )
  max_abs: float = _field(
    1e6,
    lo=0.0,
    lo_open=True,
    help="the largest |reward| accepted; beyond it a reward is an error (per on_error) before "
    "float32 advantages can overflow",
  )
  timeout_s: float = _field(
    0.0,
    lo=0.0,
    help="0: score in the training process; > 0: in reward.workers worker processes, each "
    "sample stopped after this many seconds (a timeout is an error, per on_error)",
  )
  workers: int = _field(2, lo=1, help="reward.timeout_s > 0: the worker processes")
  sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
