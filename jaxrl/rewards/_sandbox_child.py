"""The first code a sandboxed program's process runs (see `jaxrl.rewards.sandbox`): trusted, it
reads the program, shuts the process in, then runs the program in its own namespace.

Run as `python -I -S -B _sandbox_child.py SPEC_JSON` (isolated mode: no PYTHON* variables, no
site-packages, no bytecode written) in an empty environment. In order (1-2 in the supervisor,
3-5 in the program's process, forked from it):
1. read the program from the file the parent wrote (before /tmp is replaced);
2. in a mount namespace: a private, size-capped tmpfs over /tmp, /var/tmp and /dev/shm (the
   world-writable places an unprivileged user could otherwise leave files in) and a working
   directory inside it;
3. resource limits: CPU seconds, address space, file size, open files, processes, no core dumps;
4. as real root (a namespace sandbox started by root): drop to the spec's unprivileged uid/gid
   with no supplementary groups, so nothing outside the tmpfs is writable and the process limit
   is enforced;
5. an audit hook (PEP 578) that refuses sockets, new processes (fork, exec, spawn, subprocess,
   os.system), ctypes and writes outside the working directory. This is the only fence where
   no namespace could be made, and a second one where it could; Python-level hooks alone are
   not a security boundary (see jaxrl.rewards.sandbox).

The supervisor forks the program and exits with its code: the program's own (0 when it runs to
the end), 1 for an uncaught exception (traceback on stderr), 128 + signo when a signal killed
it, `MEMORY_EXIT` for a MemoryError, `SETUP_EXIT` when the sandbox itself could not be set up.
"""

import json
import os
import resource
import sys
import traceback

MEMORY_EXIT = 86
SETUP_EXIT = 87

_PROCESS_EVENTS = {
  "os.exec",
  "os.fork",
  "os.forkpty",
  "os.posix_spawn",
  "os.spawn",
  "os.system",
  "os.startfile",
  "subprocess.Popen",
  "pty.spawn",
}
_NETWORK_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo"}
_BLOCKED_MODULES = {"ctypes", "_ctypes", "_posixsubprocess", "mmap"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown"}


_MS_RDONLY, _MS_REMOUNT, _MS_BIND = 1, 32, 4096
# Imported before the uid drop where the standard library may be unreadable to that uid (an
# interpreter under /root) and no mount namespace can bind it elsewhere.
_PRELOADED = (
  "bisect", "collections", "copy", "dataclasses", "decimal", "fractions", "functools", "heapq",
  "itertools", "math", "operator", "random", "re", "statistics", "string", "typing",
)  # fmt: skip


def _mount_private(size_mb: int) -> None:
  """Private tmpfs over the world-writable directories, and the standard library bound
  read-only into it: the interpreter may live where the unprivileged uid cannot look (a
  pyenv under /root), and a program may import what the bootstrap did not."""
  import ctypes  # before the hook: the bootstrap's own use

  libc = ctypes.CDLL(None, use_errno=True)

  def mount(source, target, fstype, flags, options=b""):
    if libc.mount(source, target.encode(), fstype, flags, options) != 0:
      raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")

  for path in ("/tmp", "/var/tmp", "/dev/shm"):
    if os.path.isdir(path):
      mount(b"tmpfs", path, b"tmpfs", 0, f"size={size_mb}m,mode=1777".encode())
  stdlib = os.path.dirname(os.__file__)
  os.mkdir("/tmp/.stdlib", 0o755)
  mount(stdlib.encode(), "/tmp/.stdlib", None, _MS_BIND)
  mount(None, "/tmp/.stdlib", None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY)
  sys.path[:] = [
    "/tmp/.stdlib" + p[len(stdlib) :] if p == stdlib or p.startswith(stdlib + os.sep) else p
    for p in sys.path
  ]


def _limit(spec: dict) -> None:
  mb = 1 << 20
  limits = {
    resource.RLIMIT_CPU: (spec["cpu_s"], spec["cpu_s"] + 1),
    resource.RLIMIT_AS: (spec["memory_mb"] * mb,) * 2,
    resource.RLIMIT_FSIZE: (spec["file_size_mb"] * mb,) * 2,
    resource.RLIMIT_NOFILE: (spec["open_files"],) * 2,
    resource.RLIMIT_NPROC: (spec["processes"],) * 2,
    resource.RLIMIT_CORE: (0, 0),
  }
  for which, value in limits.items():
    resource.setrlimit(which, value)


def _inside(path, workdir: str) -> bool:
  if isinstance(path, int):  # an fd already open: was checked when opened
    return True
  full = os.path.realpath(os.path.join(workdir, os.fsdecode(path)))
  return full == workdir or full.startswith(workdir + os.sep)


def _foreign_proc(path) -> bool:
  """A /proc entry of another process (its environ, its cmdline...)."""
  if isinstance(path, int):
    return False
  parts = os.path.realpath(os.fsdecode(path)).split(os.sep)
  return len(parts) > 2 and parts[1] == "proc" and parts[2] != str(os.getpid())


def _install_hook(workdir: str) -> None:
  for name in list(sys.modules):  # the bootstrap's own ctypes: a program must import it anew
    if name.partition(".")[0] in _BLOCKED_MODULES:
      del sys.modules[name]

  def hook(event, args):
    if event in _PROCESS_EVENTS:
      raise PermissionError(f"sandbox: starting processes is not allowed ({event})")
    if event in _NETWORK_EVENTS:
      raise PermissionError(f"sandbox: network access is not allowed ({event})")
    if event == "import" and args[0].partition(".")[0] in _BLOCKED_MODULES:
      raise ImportError(f"sandbox: module {args[0]!r} is not allowed")
    if event == "open" and args[0] is not None:
      path, mode, flags = args
      writes = (mode is not None and any(c in mode for c in "wax+")) or (flags & _WRITE_FLAGS)
      if writes and not _inside(path, workdir):
        raise PermissionError(f"sandbox: writing outside {workdir} is not allowed ({path!r})")
      if _foreign_proc(path):
        raise PermissionError(f"sandbox: other processes' /proc entries are closed ({path!r})")
    if event in _PATH_EVENTS and not _inside(args[0], workdir):
      raise PermissionError(f"sandbox: {event} outside {workdir} is not allowed ({args[0]!r})")

  sys.addaudithook(hook)


def _setup() -> tuple[dict, str, str]:
  """(spec, program source, working directory), the mounts made; in the supervisor."""
  spec = json.loads(sys.argv[1])
  with open(spec["program"], encoding="utf-8") as f:
    source = f.read()
  if spec["mount"]:
    _mount_private(spec["tmpfs_mb"])
  workdir = os.path.realpath(spec["workdir"] if not spec["mount"] else "/tmp/work")
  os.makedirs(workdir, mode=0o700, exist_ok=True)
  if spec["uid"] is not None:
    os.chown(workdir, spec["uid"], spec["uid"])
    if not spec["mount"]:  # no bound copy of the standard library: import what programs use
      for name in _PRELOADED:
        __import__(name)
  return spec, source, workdir


def _confine(spec: dict, workdir: str) -> None:
  """In the program's process: its directory, its limits, its uid."""
  os.chdir(workdir)
  os.umask(0o077)
  _limit(spec)
  if spec["uid"] is not None:
    os.setgroups([])
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])


def _run_program(spec: dict, source: str, workdir: str) -> int:
  """The program's exit code; in the forked program process."""
  try:
    _confine(spec, workdir)
  except Exception as e:  # noqa: BLE001 - a sandbox that cannot be set up runs nothing
    print(f"sandbox set-up failed: {type(e).__name__}: {e}", file=sys.stderr)
    return SETUP_EXIT
  if spec["audit"]:
    _install_hook(workdir)
  try:
    code = compile(source, "program.py", "exec")
  except SyntaxError as e:
    print(f"SyntaxError: {e}", file=sys.stderr)
    return 1
  try:
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102 - the point
  except MemoryError:
    os.write(2, b"MemoryError\n")
    return MEMORY_EXIT
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
  except BaseException:  # noqa: BLE001 - the program's failure, reported as a traceback
    traceback.print_exc()
    return 1
  return 0


def main() -> None:
  """Supervisor: sets up, forks the program, and exits with its code (128 + signo if a signal
  ended it). In a PID namespace the supervisor is its init: signals from the program cannot
  reach it, and its exit takes every process the program started with it."""
  try:
    spec, source, workdir = _setup()
  except Exception as e:  # noqa: BLE001 - a sandbox that cannot be set up runs nothing
    print(f"sandbox set-up failed: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(SETUP_EXIT)
  sys.stdout.flush()
  pid = os.fork()
  if pid == 0:
    code = _run_program(spec, source, workdir)
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # noqa: BLE001, S110 - a full pipe or a closed stream: output is best-effort
        pass
    os._exit(code & 0xFF)
  _, status = os.waitpid(pid, 0)
  code = os.waitstatus_to_exitcode(status)
  os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
  main()
