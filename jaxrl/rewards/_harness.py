"""The code rewards' test harness, in two halves joined by a pair of pipes.

A candidate program must not be able to score tests it does not pass, and anything that runs in
its interpreter is within its reach (builtins, `gc`, frames, `sys.modules`, the report). So the
tests never enter that interpreter:

- `serve` runs in the program's process, after the program: it answers requests for the
  program's names (`["get", name]`) and calls of its functions (`["call", name, args,
  kwargs]`), each answer converted to plain data (`encode`). The program may subvert this half;
  all it can gain is to choose what its functions return, which it could anyway.
- `Session` runs in the sandbox's supervisor, a separate process forked before the program ran,
  which reads the tests only after the fork. It evaluates each test itself, with the
  supervisor's own builtins, binding each name the test uses that is not a builtin to the
  program's value or to a proxy whose calls go down the pipe; what comes back is decoded into
  plain data by exact type (bool, int, float, str, None, and lists, tuples and dicts of them), so
  no object of the program's, and none of its methods (`__eq__`, `__bool__`...), ever reaches the
  comparison. A test passes iff it evaluates to `True` itself.

Expected values stay in the supervisor: the program sees the arguments it is called with, never
what the test compares its result to. A test may use builtins, `math`, and the program's
functions and plain-data globals; arguments and results must be plain data (a test that hands a
function, or an object, to the program cannot be expressed).
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import os

MAX_MESSAGE = 1 << 20  # bytes in one request or reply
_DEPTH = 64  # nesting of a plain value
_TAGS = ("t", "d")  # JSON objects encode a tuple ({"t": [...]}) or a dict ({"d": [[k, v]...]})


class ProgramError(Exception):
  """The program's function raised, or answered with something that is not plain data."""


class Ended(Exception):
  """The program stopped answering (it exited, crashed, or broke the protocol)."""


def encode(value, depth: int = 0):
  """`value` as JSON-able data, tuples and dicts tagged; TypeError if it is not plain data.
  Checks exact types: a subclass of int or list (which could carry its own `__eq__`) is not
  plain."""
  kind = type(value)
  if value is None or kind in (bool, int, float, str):
    return value
  if depth >= _DEPTH:
    raise ValueError(f"a value nested deeper than {_DEPTH}")
  if kind is list:
    return [encode(v, depth + 1) for v in value]
  if kind is tuple:
    return {"t": [encode(v, depth + 1) for v in value]}
  if kind is dict:
    return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
  raise TypeError(
    f"{kind.__name__} is not plain data (bool, int, float, str, None, list, tuple, dict)"
  )


def decode(data, depth: int = 0):
  """The plain value `data` (parsed JSON) encodes; ValueError for anything else."""
  kind = type(data)
  if data is None or kind in (bool, int, float, str):
    return data
  if depth >= _DEPTH:
    raise ValueError(f"a value nested deeper than {_DEPTH}")
  if kind is list:
    return [decode(v, depth + 1) for v in data]
  if kind is dict and len(data) == 1:
    ((tag, items),) = data.items()
    if tag in _TAGS and type(items) is list:
      if tag == "t":
        return tuple(decode(v, depth + 1) for v in items)
      if all(type(kv) is list and len(kv) == 2 for kv in items):
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in items}
  raise ValueError("not an encoded plain value")


def _message(obj) -> bytes:
  data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
  if len(data) > MAX_MESSAGE:
    raise ValueError(f"a message over {MAX_MESSAGE} bytes")
  return data


def _write(fd: int, data: bytes) -> None:
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view) :]


class _Lines:
  """Newline-terminated messages from `fd`, at most MAX_MESSAGE bytes each."""

  def __init__(self, fd: int):
    self.fd, self._buf = fd, b""

  def next(self) -> bytes | None:
    """The next line, None at the end of the stream; ValueError past MAX_MESSAGE."""
    while b"\n" not in self._buf:
      if len(self._buf) > MAX_MESSAGE:
        raise ValueError(f"a message over {MAX_MESSAGE} bytes")
      chunk = os.read(self.fd, 1 << 16)
      if not chunk:
        return None
      self._buf += chunk
    line, _, self._buf = self._buf.partition(b"\n")
    return line


def _answer(namespace: dict, request) -> list:
  op, name = request[0], request[1]
  if name not in namespace:
    return ["m"]
  value = namespace[name]
  if op == "get":
    if callable(value):
      return ["c"]
    try:
      return ["v", encode(value)]
    except (TypeError, ValueError):
      return ["o"]
  try:
    result = value(*decode(request[2]), **decode(request[3]))
  except (Exception, MemoryError) as e:  # noqa: BLE001 - the program's failure, sent back
    return ["e", f"{type(e).__name__}: {e}"[:500]]
  try:
    return ["v", encode(result)]
  except (TypeError, ValueError) as e:
    return ["e", f"the result is not plain data: {e}"]


def serve(namespace: dict, requests: int, replies: int) -> None:
  """Answers the supervisor's requests about the program's `namespace` until it closes
  `requests`; in the program's process."""
  lines = _Lines(requests)
  while (line := lines.next()) is not None:
    try:
      reply = _message(_answer(namespace, json.loads(line)))
    except (Exception, MemoryError) as e:  # noqa: BLE001 - e.g. an int too long to print
      reply = _message(["e", f"{type(e).__name__}: {e}"[:500]])
    _write(replies, reply)


class _Opaque:
  """A name of the program's that is not plain data: equal only to itself."""


class Session:
  """Evaluates tests against a program that `serve`s on the other end of two pipes; in the
  supervisor."""

  def __init__(self, requests: int, replies: int):
    self._requests, self._replies = requests, _Lines(replies)
    self.ended: str | None = None  # why the program stopped answering, once it has
    self._env = {"__builtins__": dict(vars(builtins)), "math": math}

  def _ask(self, request: list) -> list:
    if self.ended is not None:
      raise Ended(self.ended)
    try:
      _write(self._requests, _message(request))
      line = self._replies.next()
    except (OSError, ValueError) as e:
      self.ended = f"the program broke the harness's pipe ({type(e).__name__}: {e})"
      raise Ended(self.ended) from e
    if line is None:
      self.ended = "the program ended before its tests did"
      raise Ended(self.ended)
    try:
      reply = json.loads(line)
      if type(reply) is not list or not reply or reply[0] not in ("v", "e", "c", "m", "o"):
        raise ValueError(reply)
    except (ValueError, RecursionError) as e:
      raise ProgramError("a malformed reply") from e
    return reply

  def _proxy(self, name: str):
    def call(*args, **kwargs):
      reply = self._ask(["call", name, encode(list(args)), encode(kwargs)])
      if reply[0] == "v" and len(reply) == 2:
        try:
          return decode(reply[1])
        except (TypeError, ValueError, RecursionError) as e:
          raise ProgramError(f"{name} answered with something that is not plain data") from e
      raise ProgramError(f"{name} raised or could not be called: {reply[1:]}"[:500])

    return call

  def check(self, test: str) -> bool:
    """Whether the expression `test` evaluates to True (the bool itself) against the program."""
    try:
      tree = ast.parse(test, mode="eval")
      env = dict(self._env)
      names = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)})
      for name in names:
        if name in env or name in env["__builtins__"]:
          continue  # the supervisor's own: a program's `sorted` or `abs` is never used
        reply = self._ask(["get", name])
        if reply[0] == "c":
          env[name] = self._proxy(name)
        elif reply[0] == "v":
          env[name] = decode(reply[1])
        elif reply[0] == "o":
          env[name] = _Opaque()
      result = eval(compile(tree, "<test>", "eval"), env)  # noqa: S307 - the record's own test
    except (Exception, MemoryError):  # noqa: BLE001 - whatever went wrong, the test failed
      return False
    return result is True
