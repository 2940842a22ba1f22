"""Run untrusted Python (a model-written program and its tests) in a contained process.

Each program runs in a fresh interpreter (`python -I -S -B`, an empty environment: nothing of
the trainer's environment, so no inherited secrets) under limits that always apply: CPU
seconds, wall seconds (the parent kills the process group), address space, file size, open
files, processes, and captured output (beyond `output_bytes` the program is killed). What fences
it in besides depends on what the host allows (`isolation()`):

- "namespaces" (Linux `unshare`, util-linux): new network (no interface but a down loopback:
  no network at all), PID (the program sees only itself; killing the sandbox kills everything
  it started), mount (private tmpfs over /tmp, /var/tmp and /dev/shm; `/proc` of its own), IPC
  and UTS namespaces. Started by root, the program also drops to an unprivileged uid of its own
  (so the file system outside its tmpfs is read-only to it and the process limit holds); started
  by a normal user, a user namespace maps it to root inside, which can write what that user can.
- "limits": resource limits only, where `unshare` is missing or refused (some containers);
  started by root, the program still drops to an unprivileged uid of its own.

In both, an audit hook (PEP 578) in the interpreter, installed before the program's first line,
refuses by class of Python's audit-event table: writes, links, renames, truncation and metadata
changes outside the working directory, signals to other processes, new processes, native code
and sockets (the list, and what it cannot cover: docs/rewards.md). It is the only fence in
"limits" mode for a trainer that is not root, a second one otherwise. `auto` warns once when it
gets "limits". A Python-level hook is not a security boundary
on its own (a C extension can go around it), which is why `Limits.isolation="namespaces"`
refuses to run without namespaces; this is the layering of verl's and OpenAI's
human-eval-style code rewards (a subprocess with limits), with OS namespaces in the style of
bubblewrap where the kernel allows them.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import json
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from jaxrl.rewards import _harness, _sandbox_child

ISOLATIONS = ("auto", "namespaces", "limits")
_CHILD = Path(_sandbox_child.__file__)
_HARNESS = Path(_harness.__file__)
_REPORT_BYTES = 1 << 20
_NAMESPACES = (
  "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc", "--uts",
)  # fmt: skip
# Unprivileged uids for root-started sandboxes: one per concurrent slot (the process limit
# counts a uid's processes), spread by the trainer's pid so two trainers rarely share one.
_UID_BASE, _UIDS_PER_TRAINER = 200_000, 64


class SandboxUnavailableError(RuntimeError):
  """The isolation asked for cannot be had on this host."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one program may use. `processes` counts the program's own interpreter too."""

  cpu_s: int = 2
  wall_s: float = 5.0
  memory_mb: int = 512
  file_size_mb: int = 4
  processes: int = 4
  open_files: int = 64
  output_bytes: int = 1 << 16
  isolation: str = "auto"

  def __post_init__(self):
    for name in ("cpu_s", "memory_mb", "file_size_mb", "processes", "open_files", "output_bytes"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"sandbox limit {name} must be an int >= 1, got {v!r}")
    if not isinstance(self.wall_s, int | float) or not self.wall_s > 0:
      raise ValueError(f"sandbox limit wall_s must be > 0 seconds, got {self.wall_s!r}")
    if self.memory_mb < 64:
      raise ValueError(
        f"sandbox limit memory_mb must be >= 64 (the interpreter's own), got {self.memory_mb}"
      )
    if self.isolation not in ISOLATIONS:
      raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {self.isolation!r}")


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How a program ended.

  status: "ok" (exit 0), "error" (another exit code: an exception, a failed assert),
    "timeout" (past wall_s, or out of CPU seconds), "memory" (a MemoryError, or killed growing
    past memory_mb), "output_limit" (printed more than output_bytes), "killed" (another
    signal), "setup" (the sandbox itself could not start: not the program's fault).
  """

  status: str
  exit_code: int | None
  stdout: str
  stderr: str
  seconds: float
  passed: tuple[bool, ...] | None = None  # with `run(..., tests=)`: the harness's verdicts


@functools.cache
def _namespace_prefix() -> tuple[tuple[str, ...], bool] | None:
  """(the `unshare` command that works here, whether the child drops root), or None."""
  unshare = shutil.which("unshare")
  if unshare is None:
    return None
  tries = [((unshare, *_NAMESPACES), True)] if os.geteuid() == 0 else []
  tries.append(((unshare, "--map-root-user", *_NAMESPACES), False))
  for prefix, drops_root in tries:
    try:
      done = subprocess.run([*prefix, "true"], capture_output=True, timeout=30, env={})
    except (OSError, subprocess.TimeoutExpired):
      continue
    if done.returncode == 0:
      return prefix, drops_root
  return None


def _why_no_namespaces() -> str:
  return "missing" if shutil.which("unshare") is None else "refused by this host"


@functools.cache
def _warn_degraded() -> None:
  """Once per process: isolation='auto' runs without namespaces here."""
  warnings.warn(
    f"sandbox isolation='auto' runs on resource limits and the audit hook alone: `unshare` is "
    f"{_why_no_namespaces()}, so no network, PID or mount namespace fences the programs"
    + ("" if os.geteuid() == 0 else ", and without root they keep this user's uid")
    + "; set reward.sandbox.isolation='namespaces' to refuse to run this way",
    RuntimeWarning,
    stacklevel=3,
  )


def isolation(limits: Limits = Limits()) -> str:
  """ "namespaces" or "limits": what `limits.isolation` gets on this host. Raises
  SandboxUnavailableError for isolation="namespaces" where `unshare` cannot make them; warns
  once (a RuntimeWarning) when "auto" gets "limits"."""
  if limits.isolation == "limits":
    return "limits"
  if _namespace_prefix() is not None:
    return "namespaces"
  if limits.isolation == "namespaces":
    raise SandboxUnavailableError(
      f"sandbox isolation='namespaces' needs Linux namespaces, but `unshare` (util-linux) is "
      f"{_why_no_namespaces()}; use isolation='auto' or 'limits' to run on resource limits and "
      "the audit hook alone"
    )
  _warn_degraded()
  return "limits"


def _kill(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def _collect(
  proc: subprocess.Popen, limits: Limits, start: float, report_fd: int | None, stdin: bytes
) -> tuple[str | None, bytes, bytes, bytes]:
  """Feeds `stdin` and reads stdout, stderr and the report fd until they close; returns (a
  status if the parent ended it, out, err, report)."""
  bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
  if report_fd is not None:
    bufs[report_fd] = bytearray()
  out, err = proc.stdout.fileno(), proc.stderr.fileno()
  deadline = start + limits.wall_s
  pending = memoryview(stdin)

  def ended(status: str):
    _kill(proc)
    cap = limits.output_bytes
    return status, bytes(bufs[out][:cap]), bytes(bufs[err][:cap]), b""

  with selectors.DefaultSelector() as sel:
    for fd in bufs:
      sel.register(fd, selectors.EVENT_READ)
    if proc.stdin is not None:
      os.set_blocking(proc.stdin.fileno(), False)
      sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    while any(fd in bufs for fd in sel.get_map()):
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return ended("timeout")
      for key, _ in sel.select(remaining):
        if key.events & selectors.EVENT_WRITE:
          try:
            pending = pending[os.write(key.fd, pending) :]
          except BrokenPipeError:  # the sandbox ended without reading: its status says why
            pending = pending[:0]
          if not pending:
            sel.unregister(key.fd)
            proc.stdin.close()
          continue
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
          sel.unregister(key.fd)
          continue
        bufs[key.fd] += chunk
        if key.fd == report_fd:
          if len(bufs[key.fd]) > _REPORT_BYTES:
            return ended("error")
        elif len(bufs[out]) + len(bufs[err]) > limits.output_bytes:
          return ended("output_limit")
  try:
    proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
  except subprocess.TimeoutExpired:  # closed its pipes but kept running
    return ended("timeout")
  report = bytes(bufs[report_fd]) if report_fd is not None else b""
  return None, bytes(bufs[out]), bytes(bufs[err]), report


def _status(code: int) -> str:
  # `unshare --fork` passes its child's exit code on, and a signal as 128 + signo.
  signo = -code if code < 0 else code - 128 if code > 128 else 0
  if code == 0:
    return "ok"
  if code == _sandbox_child.MEMORY_EXIT:
    return "memory"
  if code == _sandbox_child.SETUP_EXIT:
    return "setup"
  if signo in (signal.SIGXCPU, signal.SIGKILL):
    return "timeout"  # SIGXCPU at cpu_s, SIGKILL at the hard limit a second later
  if signo in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS):
    return "memory"  # an allocation failing where Python cannot raise MemoryError
  return "killed" if signo else "error"


def run(
  program: str,
  limits: Limits = Limits(),
  *,
  slot: int = 0,
  audit_hook: bool = True,
  tests: Sequence[str] | None = None,
) -> Outcome:
  """Runs `program` (Python source) in a sandbox; never raises for anything the program does.

  With `tests` (Python expressions), the program is run and then tested by the harness
  (`jaxrl.rewards._harness`): the tests are evaluated in the sandbox's supervisor, outside the
  program's process, and `Outcome.passed` has one bool per test (None if the sandbox ended
  before its report: a timeout, or a program that flooded its output).

  `slot` picks the uid of a root-started sandbox (one per concurrent program); `audit_hook=False`
  leaves only the OS's fences (the tests' check that those hold on their own)."""
  mode = isolation(limits)
  prefix, drops_root = _namespace_prefix() if mode == "namespaces" else ((), False)
  start = time.monotonic()
  report_r = report_w = None
  with tempfile.TemporaryDirectory(prefix="jaxrl-sandbox-") as tmp:
    path = Path(tmp) / "program.py"
    path.write_text(program, encoding="utf-8")
    if tests is not None:
      report_r, report_w = os.pipe()
    spec = {
      "program": str(path),
      "harness": str(_HARNESS) if tests is not None else None,
      "report_fd": report_w,
      "mount": mode == "namespaces",
      "tmpfs_mb": max(4 * limits.file_size_mb, 16),
      "workdir": str(Path(tmp) / "work"),
      # Root drops to an unprivileged uid of the slot's in either mode; a normal user cannot.
      "uid": _UID_BASE + (os.getpid() % 512) * _UIDS_PER_TRAINER + slot
      if drops_root or (mode == "limits" and os.geteuid() == 0)
      else None,
      "cpu_s": limits.cpu_s,
      "memory_mb": limits.memory_mb,
      "file_size_mb": limits.file_size_mb,
      "open_files": limits.open_files,
      "processes": limits.processes,
      "audit": audit_hook,
    }
    cmd = [*prefix, sys.executable, "-I", "-S", "-B", str(_CHILD), json.dumps(spec)]
    try:
      proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL if tests is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={},
        cwd=tmp,
        start_new_session=True,
        pass_fds=() if report_w is None else (report_w,),
      )
    finally:
      if report_w is not None:
        os.close(report_w)  # the supervisor's now: the report pipe ends when it exits
    try:
      with proc:
        stdin = json.dumps(list(tests)).encode() if tests is not None else b""
        ended, out, err, report = _collect(proc, limits, start, report_r, stdin)
    finally:
      if report_r is not None:
        os.close(report_r)
  status = ended or _status(proc.returncode)
  return Outcome(
    status=status,
    exit_code=None if ended else proc.returncode,
    stdout=out.decode("utf-8", errors="replace"),
    stderr=err.decode("utf-8", errors="replace"),
    seconds=time.monotonic() - start,
    passed=_passed(report, len(tests)) if tests is not None and not ended else None,
  )


def _passed(report: bytes, n: int) -> tuple[bool, ...] | None:
  """The supervisor's report, if it covers every one of the `n` tests."""
  try:
    passed = json.loads(report)["passed"]
  except (ValueError, TypeError, KeyError):
    return None
  if type(passed) is not list or len(passed) != n or any(type(p) is not bool for p in passed):
    return None
  return tuple(passed)


class SandboxPool:
  """Runs many programs concurrently, `workers` sandboxes at a time, each with its own slot
  (its own uid where root-started). `isolation` is resolved at construction, so a config that
  asks for namespaces on a host without them fails before any work."""

  def __init__(self, limits: Limits = Limits(), *, workers: int = 4):
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
      raise ValueError(f"sandbox workers must be an int in 1..64, got {workers!r}")
    self.limits, self.workers = limits, workers
    self.isolation = isolation(limits)
    self._slots: queue.Queue[int] = queue.Queue()
    for slot in range(workers):
      self._slots.put(slot)
    self._executor = cf.ThreadPoolExecutor(workers, thread_name_prefix="sandbox")

  def _run(self, program: str, tests: Sequence[str] | None) -> Outcome:
    slot = self._slots.get()
    try:
      return run(program, self.limits, slot=slot, tests=tests)
    finally:
      self._slots.put(slot)

  def run_many(
    self, programs: Sequence[str], tests: Sequence[Sequence[str] | None] | None = None
  ) -> list[Outcome]:
    """One Outcome per program, in order; `tests[i]`, if given, are program i's (see `run`)."""
    tests = [None] * len(programs) if tests is None else list(tests)
    if len(tests) != len(programs):
      raise ValueError(f"{len(programs)} programs but {len(tests)} test lists")
    return list(self._executor.map(self._run, programs, tests))

  def close(self) -> None:
    self._executor.shutdown(wait=True)
