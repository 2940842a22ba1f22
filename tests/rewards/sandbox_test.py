"""The sandbox contains hostile programs and leaves the host unharmed: an infinite loop, a fork
bomb, a memory hog, huge output, writes outside its directory, the parent's environment, a
network socket, a shell. Each is run with every fence ("full"), with the OS's fences alone
(namespaces, the audit hook off) and with the audit hook and resource limits alone ("limits",
what a host without namespaces gets)."""

import os
import socket
import tempfile
import time
import warnings

import pytest

from jaxrl.rewards import sandbox
from jaxrl.rewards.sandbox import Limits, SandboxPool, SandboxUnavailableError

LAYERS = ("full", "namespaces_only", "limits_only")
FAST = dict(cpu_s=2, wall_s=4.0)


def _run(layer: str, program: str, **limits) -> sandbox.Outcome:
  if layer == "limits_only":
    return sandbox.run(program, Limits(isolation="limits", **{**FAST, **limits}))
  if sandbox.isolation(Limits()) != "namespaces":
    pytest.skip("this host cannot make Linux namespaces (unshare missing or refused)")
  lim = Limits(isolation="namespaces", **{**FAST, **limits})
  return sandbox.run(program, lim, audit_hook=layer == "full")


def test_a_plain_program_runs_with_the_standard_library():
  out = sandbox.run("import math, fractions, json\nprint(math.gcd(12, 18), json.dumps([1]))")
  assert (out.status, out.exit_code, out.stdout, out.stderr) == ("ok", 0, "6 [1]\n", "")


@pytest.mark.parametrize("layer", LAYERS)
def test_an_infinite_loop_is_stopped(layer):
  start = time.monotonic()
  out = _run(layer, "while True:\n  pass", cpu_s=1, wall_s=3.0)
  assert out.status == "timeout"
  assert time.monotonic() - start < 3.0 + 5.0  # killed near its limit, not left running


def test_a_sleeping_program_is_stopped_at_the_wall_limit():
  out = sandbox.run("import time\nprint('up', flush=True)\ntime.sleep(60)", Limits(wall_s=1.0))
  assert out.status == "timeout" and out.stdout == "up\n" and out.exit_code is None


@pytest.mark.parametrize("layer", LAYERS)
def test_a_fork_bomb_is_contained(layer, monkeypatch):
  made, real = [], tempfile.TemporaryDirectory

  def spy(*args, **kwargs):  # the sandbox's directory names its processes' command lines
    made.append(real(*args, **kwargs))
    return made[-1]

  monkeypatch.setattr(sandbox.tempfile, "TemporaryDirectory", spy)
  program = (
    "import os, time\n"
    "n = 0\n"
    "try:\n"
    "  while True:\n"
    "    if os.fork() == 0:\n"
    "      time.sleep(30)\n"
    "    n += 1\n"
    "except OSError as e:\n"
    "  print('stopped after', n, type(e).__name__, e, flush=True)\n"
  )
  out = _run(layer, program, processes=4)
  if layer == "namespaces_only":  # the process limit stops it; the kill takes the sleepers too
    assert "stopped after" in out.stdout
    assert max(int(line.split()[2]) for line in out.stdout.splitlines()) < 4
  else:
    assert "PermissionError" in out.stdout and "os.fork" in out.stdout
  time.sleep(0.2)
  alive = [p for p in os.listdir("/proc") if p.isdigit() and made[0].name in _cmdline(p)]
  assert not alive  # nothing it started outlives it


def _cmdline(pid: str) -> str:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().decode(errors="replace")
  except OSError:
    return ""


@pytest.mark.parametrize("layer", LAYERS)
def test_a_memory_hog_is_stopped(layer):
  out = _run(layer, "x = []\nwhile True:\n  x.append(bytearray(10**7))", memory_mb=128)
  assert out.status == "memory", out


@pytest.mark.parametrize("layer", LAYERS)
def test_huge_output_is_capped(layer):
  out = _run(layer, "while True:\n  print('x' * 1000)", output_bytes=5000)
  assert out.status == "output_limit"
  assert len(out.stdout) <= 5000 and out.stdout.startswith("x" * 1000)


@pytest.mark.parametrize("layer", LAYERS)
def test_writes_outside_the_sandbox_do_not_reach_the_host(layer, tmp_path):
  targets = [tmp_path / "pwned", tmp_path.parent / "pwned_too"]
  program = "\n".join(
    f"try:\n  open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n  print(type(e).__name__)"
    for t in targets
  )
  program += "\nopen('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())"
  out = _run(layer, program)
  assert out.status == "ok" and out.stdout.endswith("ok\n")  # its own directory is writable
  assert not any(t.exists() for t in targets)


@pytest.mark.parametrize("layer", LAYERS)
def test_a_file_past_the_size_limit_fails(layer):
  out = _run(layer, "open('big', 'wb').write(b'x' * (3 << 20))", file_size_mb=1)
  assert out.status == "error" and "File too large" in out.stderr


@pytest.mark.parametrize("layer", LAYERS)
def test_the_parents_environment_is_not_visible(layer, monkeypatch):
  monkeypatch.setenv("JAXRL_TEST_SECRET", "hunter2")
  program = (
    "import os\n"
    "print(sorted(os.environ))\n"
    "try:\n"
    "  print(open(f'/proc/{os.getppid()}/environ', 'rb').read())\n"
    "except OSError as e:\n"
    "  print(type(e).__name__)\n"
  )
  out = _run(layer, program)
  assert out.status == "ok" and "hunter2" not in out.stdout and "JAXRL_TEST" not in out.stdout
  assert out.stdout.splitlines()[0] in ("[]", "['LC_CTYPE']")  # Python's own locale coercion


@pytest.mark.parametrize("layer", LAYERS)
def test_no_network(layer):
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    program = (
      "import socket\n"
      f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
      "print('connected')\n"
    )
    out = _run(layer, program)
    assert out.status == "error" and "connected" not in out.stdout
    with pytest.raises(BlockingIOError):
      server.accept()  # nothing reached the host's listener


@pytest.mark.parametrize("layer", LAYERS)
def test_a_shell_cannot_touch_the_host(layer, tmp_path):
  marker = tmp_path / "shell_ran"
  program = (
    "import subprocess\n"
    f"r = subprocess.run(['sh', '-c', 'touch {marker}; id -u'], capture_output=True)\n"
    "print(r.returncode, r.stdout, r.stderr)\n"
  )
  out = _run(layer, program)
  assert not marker.exists()
  if layer == "namespaces_only":  # the shell runs, as an unprivileged uid in a private /tmp
    assert out.status == "ok" and "b'0\\n'" not in out.stdout
  else:  # refused by the audit hook (or, root-started without namespaces, the module is not
    # importable at all: the dropped uid cannot read a standard library under /root)
    assert out.status == "error"
    assert "not allowed" in out.stderr or "No module named 'subprocess'" in out.stderr


def test_ctypes_is_refused_by_the_audit_hook():
  out = sandbox.run("import ctypes", Limits(isolation="limits"))
  assert out.status == "error" and "module 'ctypes' is not allowed" in out.stderr


def test_failures_are_told_apart():
  assert sandbox.run("raise SystemExit(3)").exit_code == 3
  syntax = sandbox.run("def f(:")
  assert syntax.status == "error" and "SyntaxError" in syntax.stderr
  boom = sandbox.run("assert 1 == 2, 'nope'")
  assert boom.status == "error" and "AssertionError: nope" in boom.stderr


def test_the_pool_runs_programs_concurrently_and_in_order():
  program = "import time\nt = time.monotonic()\ntime.sleep(0.5)\nprint(t, time.monotonic(), {})"
  pool = SandboxPool(Limits(), workers=3)
  try:
    outs = pool.run_many([program.format(i) for i in range(6)])
  finally:
    pool.close()
  spans = [tuple(float(v) for v in o.stdout.split()[:2]) for o in outs]
  assert [int(o.stdout.split()[2]) for o in outs] == list(range(6))
  # CLOCK_MONOTONIC is system-wide: some two programs were running at the same moment.
  overlapping = sum(a[0] < b[1] and b[0] < a[1] for a in spans for b in spans if a < b)
  assert overlapping >= 2


def test_auto_without_namespaces_warns_once(monkeypatch):
  monkeypatch.setattr(sandbox, "_namespace_prefix", lambda: None)
  sandbox._warn_degraded.cache_clear()
  with pytest.warns(RuntimeWarning, match=r"isolation='auto' runs on resource limits") as seen:
    for _ in range(3):
      assert sandbox.isolation(Limits(isolation="auto")) == "limits"
  assert len(seen) == 1
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert sandbox.isolation(Limits(isolation="limits")) == "limits"  # asked for: no warning


def test_namespaces_required_but_unavailable_is_refused(monkeypatch):
  monkeypatch.setattr(sandbox, "_namespace_prefix", lambda: None)
  with pytest.raises(SandboxUnavailableError, match=r"isolation='namespaces' needs Linux"):
    SandboxPool(Limits(isolation="namespaces"))


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"cpu_s": 0}, r"sandbox limit cpu_s must be an int >= 1, got 0"),
    ({"wall_s": -1}, r"sandbox limit wall_s must be > 0 seconds, got -1"),
    ({"memory_mb": 16}, r"memory_mb must be >= 64 \(the interpreter's own\), got 16"),
    ({"processes": True}, r"sandbox limit processes must be an int >= 1, got True"),
    ({"isolation": "docker"}, r"sandbox isolation must be one of \('auto', 'namespaces'"),
  ],
)
def test_bad_limits_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    Limits(**kwargs)


def test_bad_worker_count_is_named():
  with pytest.raises(ValueError, match=r"sandbox workers must be an int in 1\.\.64, got 0"):
    SandboxPool(workers=0)


# One probe per kind of thing the audit hook refuses (Python's audit-event table: writes, links,
# renames, truncation, metadata, signals, new processes, native code, sockets), each aimed at
# the host: OUT is a file outside the sandbox, DIR a directory outside it, TRAINER this process.
# Each imports what it uses itself: a refused import must refuse that probe only.
PROBES = {
  "write: open": "open(OUT, 'w').write('x')",
  "write: os.open": "os.close(os.open(OUT, os.O_WRONLY | os.O_TRUNC))",
  "write: truncate": "os.truncate(OUT, 0)",
  "write: truncate through /proc/self/fd": (
    "os.truncate(f'/proc/self/fd/{os.open(OUT, os.O_RDONLY)}', 0)"
  ),
  "write: copyfile": (
    "import shutil; open('src', 'w').write('x'); shutil.copyfile('src', DIR + '/copied')"
  ),
  "write: mkstemp": "import tempfile; tempfile.mkstemp(dir=DIR)",
  "write: mkdir": "os.mkdir(DIR + '/made')",
  "write: through a directory fd": (
    "os.close(os.open('via_fd', os.O_WRONLY | os.O_CREAT, dir_fd=os.open(DIR, os.O_RDONLY)))"
  ),
  "write: through '..' from a directory fd": (
    "os.makedirs('a/b'); fd = os.open('.', os.O_RDONLY); os.chdir('a/b')\n"
    "os.close(os.open('../../dotdot', os.O_WRONLY | os.O_CREAT, dir_fd=fd))"
  ),
  "link: symlink": "os.symlink(OUT, 'soft')",
  "link: hard link": "os.link(OUT, 'hard')",
  "rename: into the sandbox": "os.rename(OUT, 'stolen')",
  "rename: over a host file": "open('mine', 'w').write('x'); os.replace('mine', OUT)",
  "rename: shutil.move": "import shutil; shutil.move(OUT, 'moved')",
  "remove: file": "os.remove(OUT)",
  "remove: empty directory": "os.rmdir(DIR + '/empty')",
  "remove: rmtree": "import shutil; shutil.rmtree(DIR + '/empty')",
  "metadata: chmod": "os.chmod(OUT, 0o777)",
  "metadata: fchmod a read-only fd": "os.fchmod(os.open(OUT, os.O_RDONLY), 0o777)",
  "metadata: chown": "os.chown(OUT, 12345, 12345)",
  "metadata: utime": "os.utime(OUT, (0, 0))",
  "metadata: setxattr": "os.setxattr(OUT, 'user.jaxrl', b'1')",
  "signal: kill": "os.kill(TRAINER, 0)",
  "signal: killpg": "os.killpg(os.getpgid(0), 0)",
  "signal: pidfd": "import signal; signal.pidfd_send_signal(os.pidfd_open(TRAINER), 0)",
  "signal: another process's limits": (
    "import resource; resource.prlimit(TRAINER, resource.RLIMIT_NOFILE)"
  ),
  "execute: os.system": "os.system('true')",
  "execute: execv": "os.execv('/bin/true', ['true'])",
  "execute: posix_spawn": "os.posix_spawn('/bin/true', ['true'], {})",
  "execute: fork": "os.fork()",
  "execute: subprocess": "import subprocess; subprocess.run(['true'])",
  "native: ctypes": "import ctypes",
  "native: mmap": "import mmap",
  "native: a shared object it wrote": (
    "import _json, importlib.machinery as m\n"
    "open('own.so', 'wb').write(open(_json.__file__, 'rb').read())\n"
    "m.ExtensionFileLoader('_json', os.path.abspath('own.so')).create_module(\n"
    "  m.ModuleSpec('_json', None, origin=os.path.abspath('own.so')))"
  ),
  "native: a shared object in memory": (
    "import _json, importlib.machinery as m\n"
    "fd = os.memfd_create('x'); os.write(fd, open(_json.__file__, 'rb').read())\n"
    "p = f'/proc/self/fd/{fd}'\n"
    "m.ExtensionFileLoader('_json', p).create_module(m.ModuleSpec('_json', None, origin=p))"
  ),
  "socket: open": "import socket; socket.socket()",
  "socket: resolve": "import socket; socket.getaddrinfo('localhost', 80)",
  # Its own name again: harmless should the fence ever fail (the host's name is checked too).
  "socket: sethostname": "import socket; socket.sethostname(socket.gethostname())",
}
FENCED_MODES = ("namespaces", "limits", "limits_as_user")


def _probe(name: str, code: str, out: str, directory: str) -> str:
  return (
    f"OUT, DIR, TRAINER = {out!r}, {directory!r}, {os.getpid()}\n"
    "import os\n"
    "try:\n" + "".join(f"  {line}\n" for line in code.splitlines()) + f"  print('DONE', {name!r})\n"
    "except BaseException as e:\n"
    "  print('REFUSED', type(e).__name__, e)\n"
  )


def _aim_probes(host) -> list[str]:
  """The probes as programs, each aimed at a directory of its own under `host`."""
  programs = []
  for i, (name, code) in enumerate(PROBES.items()):
    directory = host / str(i)
    (directory / "empty").mkdir(parents=True)
    out = directory / "file"
    out.write_text("host")
    out.chmod(0o644)
    programs.append(_probe(name, code, str(out), str(directory)))
  return programs


def _run_probes(programs: list[str], isolation: str, audit_hook: bool = True):
  if audit_hook:
    pool = SandboxPool(Limits(isolation=isolation, **FAST), workers=2)
    try:
      return pool.run_many(programs)
    finally:
      pool.close()
  return [sandbox.run(p, Limits(isolation=isolation, **FAST), audit_hook=False) for p in programs]


@pytest.mark.parametrize("mode", FENCED_MODES)
def test_every_event_class_is_refused_and_the_host_is_unharmed(mode, tmp_path, monkeypatch):
  if mode == "namespaces" and sandbox.isolation(Limits()) != "namespaces":
    pytest.skip("this host cannot make Linux namespaces (unshare missing or refused)")
  if mode == "limits_as_user":  # a trainer not started as root: the audit hook alone
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
  host, hostname = tmp_path / "host", socket.gethostname()
  programs = _aim_probes(host)
  before = {p: (p.stat().st_mode, p.stat().st_mtime_ns) for p in host.rglob("*")}
  outs = _run_probes(programs, "namespaces" if mode == "namespaces" else "limits")
  for name, out in zip(PROBES, outs, strict=True):
    assert out.stdout.startswith("REFUSED"), (name, out)
    if mode == "limits_as_user":  # nothing else stands in the way: the hook refused it
      why = out.stdout
      assert "sandbox:" in why or "has no attribute 'pidfd" in why, (name, why)
  assert {p: (p.stat().st_mode, p.stat().st_mtime_ns) for p in host.rglob("*")} == before
  assert all((host / str(i) / "file").read_text() == "host" for i in range(len(PROBES)))
  assert socket.gethostname() == hostname


def test_without_the_audit_hook_every_probe_gets_through(tmp_path, monkeypatch):
  """The probes are real: run as the trainer's own user with the hook off, each one acts
  (execv replaces the program, so it prints nothing)."""
  monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
  outs = _run_probes(_aim_probes(tmp_path), "limits", audit_hook=False)
  for name, out in zip(PROBES, outs, strict=True):
    assert not out.stdout.startswith("REFUSED"), (name, out)
    assert name == "execute: execv" or f"DONE {name}" in out.stdout, (name, out)


def test_the_namespaces_claimed_are_the_namespaces_made():
  if sandbox.isolation(Limits()) != "namespaces":
    pytest.skip("this host cannot make Linux namespaces (unshare missing or refused)")
  kinds = ("net", "pid", "mnt", "ipc", "uts")
  program = "import os\n" + "".join(f"print(os.readlink('/proc/self/ns/{k}'))\n" for k in kinds)
  out = sandbox.run(program, Limits(isolation="namespaces"))
  host = [os.readlink(f"/proc/self/ns/{k}") for k in kinds]
  assert out.status == "ok", out
  inside = out.stdout.split()
  assert all(a != b for a, b in zip(inside, host, strict=True)), (inside, host)
  for k in kinds:
    assert f"--{'mount' if k == 'mnt' else k}" in sandbox._NAMESPACES
