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
5. an audit hook (PEP 578) that refuses, by class of Python's audit-event table, writes, links,
   renames, truncation and metadata changes outside the working directory, signals to other
   processes, new processes (fork, exec, spawn, subprocess, os.system), native code (ctypes,
   mmap, extension modules from outside the standard library) and sockets; functions with no
   audit event that reach other processes or make files are removed first. This is the only
   fence where no namespace could be made and no uid dropped; Python-level hooks alone are not
   a security boundary (see jaxrl.rewards.sandbox).

With a test harness in the spec (the code rewards: jaxrl.rewards._harness), the supervisor reads
the tests from its stdin only after forking the program, evaluates them itself against the
program's functions through a pair of pipes, and writes the verdicts on the report fd, which
the program's process closes before anything else.

The supervisor forks the program and exits with its code: the program's own (0 when it runs to
the end), 1 for an uncaught exception (traceback on stderr), 128 + signo when a signal killed
it, `MEMORY_EXIT` for a MemoryError, `SETUP_EXIT` when the sandbox itself could not be set up.
"""

import json
import os
import resource
import signal
import sys
import traceback

MEMORY_EXIT = 86
SETUP_EXIT = 87

# The audit events (Python's audit-event table, 3.10-3.13) the hook refuses outright, by class.
_PROCESS_EVENTS = {
  "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
  "subprocess.Popen", "pty.spawn",
}  # fmt: skip
_NATIVE_EVENTS = {"mmap.__new__", "os.add_dll_directory", "sys.remote_exec"}
# Network, and the clients built on sockets; "syslog." writes outside the sandbox.
_REFUSED_PREFIXES = (
  "socket.", "ctypes.", "ftplib.", "http.client.", "imaplib.", "nntplib.", "poplib.", "smtplib.",
  "telnetlib.", "urllib.", "webbrowser.", "syslog.", "ensurepip.", "winreg.", "msvcrt.",
)  # fmt: skip
_LINK_EVENTS = {"os.link", "os.symlink"}  # refused anywhere: a link is how a checked path escapes
_LOCK_EVENTS = {"fcntl.ioctl", "fcntl.flock", "fcntl.lockf", "os.lockf"}
# Events whose listed arguments are paths the program writes to or changes: each must lie inside
# the working directory (an fd is resolved to the file it is open on).
_PATH_ARGS = {
  "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.truncate": (0,),
  "os.rename": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.chflags": (0,),
  "os.lchflags": (0,), "os.utime": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
  "shutil.copyfile": (1,), "shutil.copymode": (1,), "shutil.copystat": (1,),
  "shutil.copytree": (1,), "shutil.move": (0, 1), "shutil.rmtree": (0,), "shutil.chown": (0,),
  "shutil.make_archive": (0,), "shutil.unpack_archive": (1,),
  "tempfile.mkstemp": (0,), "tempfile.mkdtemp": (0,),
}  # fmt: skip
# Modules a program may not import: native memory access, raw process creation. The
# standard-library modules whose dangerous functions the hook strips (`_STRIPPED`) may not be
# imported anew either, which would bring the functions back.
_BLOCKED_MODULES = {"ctypes", "_ctypes", "_posixsubprocess", "mmap", "posix", "_signal", "nt"}
# Functions with no audit event that make files (fifos, device nodes) or reach other processes
# (signals through a pidfd, another pid's scheduling): removed from their modules before the
# program runs.
_NO_EVENT = (
  "mkfifo", "mknod", "chroot", "pidfd_open", "sched_setaffinity", "sched_setparam",
  "sched_setscheduler", "setpriority", "setns", "unshare",
)  # fmt: skip
_STRIPPED = {"posix": _NO_EVENT, "os": _NO_EVENT, "_signal": ("pidfd_send_signal",)}
_STRIPPED["signal"] = _STRIPPED["_signal"]
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


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


def _resolve(path) -> str | None:
  """The real path an event's path argument names: a str/bytes path taken from the current
  directory, an fd through /proc/self/fd; None where it names no file (a pipe, a closed fd)."""
  if isinstance(path, int):
    try:
      target = os.readlink(f"/proc/self/fd/{path}")
    except OSError:
      return None
    return target if target.startswith(os.sep) else None
  if not isinstance(path, str | bytes | os.PathLike):
    return None
  return os.path.realpath(os.path.join(os.getcwd(), os.fsdecode(path)))


def _within(full: str | None, workdir: str) -> bool:
  return full is not None and (full == workdir or full.startswith(workdir + os.sep))


def _inside(path, workdir: str) -> bool:
  return _within(_resolve(path), workdir)


def _foreign_proc(full: str | None) -> bool:
  """Whether the resolved path `full` is a /proc entry of another process (its environ, its
  cmdline, its fds...)."""
  if full is None:
    return False
  parts = full.split(os.sep)
  return len(parts) > 2 and parts[1] == "proc" and parts[2] not in (str(os.getpid()), "self")


def _strip() -> None:
  """Removes the functions of `_STRIPPED` (no audit event covers them) from their modules."""
  for module_name, names in _STRIPPED.items():
    module = sys.modules.get(module_name)
    for name in names if module is not None else ():
      if hasattr(module, name):
        delattr(module, name)


def _install_hook(workdir: str) -> None:
  """Installs the audit hook: after this the process can write, link, rename, truncate and
  change the metadata of files inside `workdir` only, and cannot signal another process, start
  one, open a socket or load native code that is not the standard library's."""
  for name in list(sys.modules):  # the bootstrap's own ctypes: a program must import it anew
    if name.partition(".")[0] in _BLOCKED_MODULES - set(_STRIPPED):
      del sys.modules[name]
  _strip()
  # Native modules load from the interpreter's own directories only (not a .so the program
  # wrote, nor /proc/self/fd/N of a memfd).
  trusted = tuple(os.path.realpath(p) + os.sep for p in sys.path if p and os.path.isdir(p))
  pid = os.getpid()

  def refuse(what: str, arg=None) -> None:
    detail = "" if arg is None else f" ({arg!r})"
    raise PermissionError(f"sandbox: {what} is not allowed{detail}")

  def hook(event, args):
    if event in _PROCESS_EVENTS:
      refuse(f"starting processes ({event})")
    if event in _NATIVE_EVENTS or event.startswith(_REFUSED_PREFIXES):
      refuse(event)
    if event in _LINK_EVENTS:
      refuse(f"{event}: links", args[1])
    if event in _LOCK_EVENTS:
      refuse(f"{event}: locks and device controls")
    if event == "import":
      if args[0].partition(".")[0] in _BLOCKED_MODULES:
        raise ImportError(f"sandbox: module {args[0]!r} is not allowed")
      filename = args[1]
      if filename is not None and not os.path.realpath(filename).startswith(trusted):
        refuse(f"loading {args[0]!r} from outside the standard library", filename)
    elif event == "os.kill" and args[0] != pid:
      refuse("signalling another process", args[0])
    elif event == "os.killpg":
      refuse("signalling a process group", args[0])
    elif event == "resource.prlimit" and args[0] not in (0, pid):
      refuse("another process's limits", args[0])
    elif event == "open" and args[0] is not None and not isinstance(args[0], int):
      # (An int is an fd already open, checked when it was opened.)
      path, mode, flags = args
      full = _resolve(path)  # once: every read of the program's imports passes here
      writes = (mode is not None and any(c in mode for c in "wax+")) or (flags & _WRITE_FLAGS)
      if writes and not _within(full, workdir):
        refuse(f"writing outside {workdir}", path)
      if writes and ".." in os.fsdecode(path).split(os.sep):
        # The event carries no dir_fd: a relative path is checked from the current directory,
        # which `..` could leave from the directory an fd names.
        refuse("writing through '..'", path)
      if _foreign_proc(full):
        refuse("opening other processes' /proc entries", path)
      if full is not None and not _within(full, workdir) and os.path.isdir(full):
        # A directory fd outside would let os.open(..., dir_fd=fd) write where the event's
        # relative path says it does not (the event carries no dir_fd).
        refuse(f"opening a directory outside {workdir}", path)
    elif event in _PATH_ARGS:
      for i in _PATH_ARGS[event]:
        if i >= len(args) or args[i] is None:
          continue
        if not _inside(args[i], workdir) or (
          not isinstance(args[i], int) and ".." in os.fsdecode(args[i]).split(os.sep)
        ):
          refuse(f"{event} outside {workdir}", args[i])

  sys.addaudithook(hook)


def _load_harness(path: str):
  """The harness module (jaxrl/rewards/_harness.py) by its path: `-I` puts no directory of
  jaxrl's on sys.path, and the package's directory must not be there (its `math` and `code`
  modules would shadow the standard library's)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("_jaxrl_harness", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _setup() -> tuple[dict, str, str, object]:
  """(spec, program source, working directory, the test harness or None), the mounts made; in
  the supervisor. Files are read before the mounts hide /tmp."""
  spec = json.loads(sys.argv[1])
  with open(spec["program"], encoding="utf-8") as f:
    source = f.read()
  harness = _load_harness(spec["harness"]) if spec.get("harness") else None
  if spec["mount"]:
    _mount_private(spec["tmpfs_mb"])
  workdir = os.path.realpath(spec["workdir"] if not spec["mount"] else "/tmp/work")
  os.makedirs(workdir, mode=0o700, exist_ok=True)
  if spec["uid"] is not None:
    os.chown(workdir, spec["uid"], spec["uid"])
    if not spec["mount"]:  # no bound copy of the standard library: import what programs use
      for name in _PRELOADED:
        __import__(name)
  return spec, source, workdir, harness


def _confine(spec: dict, workdir: str) -> None:
  """In the program's process: its directory, its limits, its uid."""
  os.chdir(workdir)
  os.umask(0o077)
  _limit(spec)
  if spec["uid"] is not None:
    os.setgroups([])
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])


def _run_program(spec: dict, source: str, workdir: str, serve=None) -> int:
  """The program's exit code; in the forked program process. `serve(namespace)`, if given,
  runs after the program, on its module's namespace (the test harness's half)."""
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
  namespace = {"__name__": "__main__", "__builtins__": __builtins__}
  try:
    exec(code, namespace)  # noqa: S102 - the point
    if serve is not None:
      serve(namespace)
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


def _exit_code(status: int) -> int:
  code = os.waitstatus_to_exitcode(status)
  return code if code >= 0 else 128 - code


def _flushed_exit(code: int) -> None:
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001, S110 - a full pipe or a closed stream: output is best-effort
      pass
  os._exit(code & 0xFF)


def _read_all(fd: int) -> bytes:
  chunks = []
  while chunk := os.read(fd, 1 << 16):
    chunks.append(chunk)
  return b"".join(chunks)


def _test_session(spec: dict, source: str, workdir: str, harness) -> None:
  """Forks the program, then (only then: the tests are never in the program's memory) reads
  the tests from stdin, evaluates each against the program through the harness, kills the
  program and writes the report, one bool per test, on the report fd that only this process
  holds. Exits 0 if the program was still answering at the end, else with the program's code."""
  report_fd = spec["report_fd"]
  req_r, req_w = os.pipe()
  rep_r, rep_w = os.pipe()
  pid = os.fork()
  if pid == 0:
    for fd in (report_fd, req_w, rep_r, 0):
      os.close(fd)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again: the tests' pipe is gone from this process
    _flushed_exit(_run_program(spec, source, workdir, lambda ns: harness.serve(ns, req_r, rep_w)))
  os.close(req_r)
  os.close(rep_w)
  tests = json.loads(_read_all(0))
  session = harness.Session(req_w, rep_r)
  passed = [session.check(test) for test in tests]
  os.close(req_w)
  if session.ended is None:
    os.kill(pid, signal.SIGKILL)
  _, status = os.waitpid(pid, 0)
  report = {"passed": passed, "ended": session.ended}
  with os.fdopen(report_fd, "w") as f:
    f.write(json.dumps(report))
  os._exit(0 if session.ended is None else _exit_code(status))


def main() -> None:
  """Supervisor: sets up, forks the program, and exits with its code (128 + signo if a signal
  ended it); with a test harness in the spec, runs the program's tests (`_test_session`). In a
  PID namespace the supervisor is its init: signals from the program cannot reach it, and its
  exit takes every process the program started with it."""
  try:
    spec, source, workdir, harness = _setup()
  except Exception as e:  # noqa: BLE001 - a sandbox that cannot be set up runs nothing
    print(f"sandbox set-up failed: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(SETUP_EXIT)
  sys.stdout.flush()
  if harness is not None:
    _test_session(spec, source, workdir, harness)
  pid = os.fork()
  if pid == 0:
    _flushed_exit(_run_program(spec, source, workdir))
  _, status = os.waitpid(pid, 0)
  os._exit(_exit_code(status))


if __name__ == "__main__":
  main()
