"""The sandbox's inside: a judge and a runner, each program in a fresh `python -I -S` that data/sandbox.py starts.

redumix never imports this module: the sandbox's interpreter does (`BOOT` in data/sandbox.py puts this folder on its
path for the import alone, so the judge's bytecode is cached and the model's code cannot import from here). It and
its two siblings, sandbox_isolation.py and sandbox_values.py, use the standard library only.

**Two processes, one secret.** The judge reads the program's code (stdin), isolates itself (below), then forks the
runner. Only then does it read the tests and the pass nonce from a second pipe, so the runner's memory never held
either: the runner closes that pipe and the result pipe before it runs any model code. The runner executes the model's
code and then serves calls: the judge runs each test itself, and every name the model's code defines is, in the test,
a proxy that asks the runner to call it. What comes back is a *plain value* (None, bool, int, float, complex, str,
bytes, list, tuple, dict, set, range, or an iterator's items; any other object stays in the runner, and the judge
holds an opaque handle to it that equals only itself) in a tagged JSON that the judge decodes without running
anything, so the comparison `==` of every assert runs in the judge, on plain values: an object whose `__eq__` says
True, a patched builtin or an early `sys.exit(0)` in the runner cannot make an assert pass. The judge writes
`{"event": "pass", "nonce": ...}` to the result pipe after the last test, and a pass is that line alone. The runner
cannot write it: it holds no copy of the pipe, and it cannot reach the judge's (no /proc in its Landlock domain, no
ptrace of a process outside its domain, the judge is not dumpable, and it lives outside the runner's pid namespace).
Nor can it know the nonce. Exiting early, with any status, only ends the runner: the judge reports it as a failure.
What the runner can still do is what any program does: answer each call with a value of its choosing. It sees each
call's arguments, never the values the test expects, which stay in the judge.

**Isolation**, each layer reported in the first event (`isolation`), so a host that lacks one says so:
- user, network and pid namespaces (`unshare`): no network but loopback; the runner is pid 1 of its own namespace,
  so when it dies every process it started dies, and it cannot see or signal a process outside;
- Landlock: the runner reads only the interpreter's files and system libraries and writes only in its temporary
  folder, makes no TCP connection (ABI 4+) and sends no signal outside its domain (ABI 6+);
- no capabilities, no new privileges, the judge not dumpable;
- seccomp: the runner starts no process (threads still start), so a fork bomb ends at its first fork;
- rlimits on CPU seconds, address space, file size, open files and processes;
- the parent adds: a scrubbed environment, the temporary folder as cwd and HOME, an unprivileged uid when it is root,
  and a wall-clock deadline that kills the whole process group.
"""

from __future__ import annotations

import builtins
import os
import select
import sys
import time

from sandbox_isolation import (
    die_with_parent,
    drop_privileges,
    landlock,
    no_new_processes,
    seccomp_support,
    set_limits,
    unshare_namespaces,
)
from sandbox_values import Handle, NotPlain, decode, dumps, encode, loads

MAX_MESSAGE = 16 << 20  # bytes of one message between judge and runner
CUT = 2000  # characters of a message or traceback kept


class Timeout(BaseException):
    """The judge's deadline passed (a BaseException, so no `except Exception` in a test catches it)."""


class RunnerGone(BaseException):
    """The runner closed its end: it exited or was killed."""


# --- messages --------------------------------------------------------------------------------------------------------


class Channel:
    """Newline-framed JSON over a pair of pipes, one each way."""

    def __init__(self, read_fd, write_fd):
        self.fd, self.write_fd, self.buffer = read_fd, write_fd, b""

    def send(self, message):
        data = (dumps(message) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.write_fd, data):]
        except BrokenPipeError:
            raise RunnerGone() from None

    def receive(self, deadline=None):
        while b"\n" not in self.buffer:
            if deadline is not None and not select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise Timeout()
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise RunnerGone()
            self.buffer += chunk
            if len(self.buffer) > MAX_MESSAGE:
                raise ValueError(f"a message of more than {MAX_MESSAGE} bytes")
        line, _, self.buffer = self.buffer.partition(b"\n")
        return loads(line.decode())


def describe(exc, source):
    """An exception as the feedback shows it: its type, message and the traceback through the model's code only."""
    import linecache
    import traceback

    try:
        message = str(exc)
    except BaseException:  # the model's own exception class may refuse to print
        message = "(its message could not be printed)"
    linecache.cache["<solution>"] = (len(source), None, source.splitlines(True), "<solution>")
    try:
        summary = traceback.TracebackException(type(exc), exc, exc.__traceback__, limit=20)
        frames = [f for f in summary.stack if f.filename == "<solution>"]
        text = "".join(traceback.StackSummary.from_list(frames).format()) + "".join(summary.format_exception_only())
    except BaseException:
        text = f"{type(exc).__name__}: {message}\n"
    return {"type": type(exc).__name__[:100], "message": message[:CUT],
            "traceback": ("Traceback (most recent call last):\n" + text)[-CUT:]}


# --- the runner: the model's code, in its own domain -----------------------------------------------------------------


def runner(read_fd, write_fd, code, work, limits):
    """Runs the model's code, then answers calls until the judge hangs up. Every line before `exec` is ours."""
    die_with_parent()
    low, high = sorted((read_fd, write_fd))
    for first, last in ((3, low), (low + 1, high), (high + 1, 1 << 16)):
        os.closerange(first, last)
    null = os.open("/dev/null", os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    os.close(null)
    landlock(work)  # a domain nested in the judge's: the judge is outside it, so no ptrace and no signal reaches it
    no_new_processes()
    set_limits(limits)
    channel, scope = Channel(read_fd, write_fd), {"__name__": "__solution__", "__builtins__": builtins}
    kept = {}  # the objects the judge holds handles to, by key: "#n" (a value returned) or a global's name

    def keep(value):
        kept[f"#{len(kept)}"] = value
        return f"#{len(kept) - 1}"

    def find(key, label):
        return kept[key] if key.startswith("#") else scope[key]

    try:
        exec(compile(code, "<solution>", "exec"), scope)
        names = {k: "call" if callable(v) else type(v).__name__[:100] for k, v in list(scope.items())[:10_000]
                 if k[:2] != "__"}
        channel.send({"names": names})
    except BaseException as exc:
        channel.send({"load_error": _describe_or_name(exc, code)})
        os._exit(0)
    while True:
        try:
            request = channel.receive()
        except BaseException:
            os._exit(0)
        try:
            args = [decode(a, find) for a in request["args"]]
            kwargs = {k: decode(v, find) for k, v in request["kwargs"]}
            reply = {"value": encode(scope[request["call"]](*args, **kwargs), keep)}
        except NotPlain as exc:
            reply = {"unplain": str(exc)}
        except BaseException as exc:
            reply = {"raised": _describe_or_name(exc, code)}
        try:
            channel.send(reply)
        except BaseException:
            os._exit(1)


def _describe_or_name(exc, code):
    """`describe`, or the type's name alone when describing fails too (a MemoryError that left no memory)."""
    try:
        return describe(exc, code)
    except BaseException:
        return {"type": type(exc).__name__[:100], "message": "", "traceback": ""}


# --- the judge: the tests, on plain values ---------------------------------------------------------------------------


class RemoteError(Exception):
    """An exception the model's code raised in the runner."""


class Proxy:
    """A callable of the model's code: the call runs in the runner, and only its plain value comes back."""

    def __init__(self, judge, name):
        self.judge, self.key = judge, name

    def __call__(self, *args, **kwargs):
        return self.judge.call(self.key, args, kwargs)

    def __repr__(self):
        return self.key


class Judge:
    def __init__(self, channel, deadline):
        self.channel, self.deadline, self.last = channel, deadline, {}

    def call(self, name, args, kwargs):
        shown = ", ".join([_show(a) for a in args] + [f"{k}={_show(v)}" for k, v in kwargs.items()])
        self.last = {"call": f"{name}({shown})"[:200]}
        self.channel.send({"call": name, "args": [encode(a, _key) for a in args],
                           "kwargs": [[k, encode(v, _key)] for k, v in kwargs.items()]})
        reply = self.channel.receive(self.deadline)
        if "value" in reply:
            value = decode(reply["value"], Handle)
            self.last["returned"] = _show(value)
            return value
        if "unplain" in reply:
            self.last["unplain"] = str(reply["unplain"])[:200]
            raise RemoteError(reply["unplain"])
        info = reply["raised"]
        self.last["raised"] = {k: str(info[k])[:CUT] for k in ("type", "message", "traceback")}
        error_type = getattr(builtins, str(info["type"]), None)
        if isinstance(error_type, type) and issubclass(error_type, Exception):
            raise error_type(info["message"])  # a test that expects a ValueError sees one
        raise RemoteError(info["message"])



def _key(value):
    """What stands for an object of the runner in an argument: the handle's key, a proxy's name."""
    if isinstance(value, (Handle, Proxy)):
        return value.key
    raise NotPlain(f"the test passes a {type(value).__name__} object, which cannot be sent")


def _show(value):
    try:
        return repr(value)[:200]
    except ValueError:  # an int too long for repr's digit limit
        return f"<an int of {value.bit_length()} bits>"


def failing_line(exc, tests, index):
    """The line of the test at which `exc` left it: the failing assert of a HumanEval `check`."""
    import traceback

    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<test>"]
    source = tests[index].splitlines()
    return source[lines[-1] - 1].strip() if lines and 0 < lines[-1] <= len(source) else tests[index].strip()


def run_tests(judge, names, tests, emit):
    """Each test in turn against proxies of the model's names; the first failure is reported and ends the run."""
    scope = {"__name__": "__test__", "__builtins__": builtins}
    scope.update({n: Proxy(judge, n) if kind == "call" else Handle(n, str(kind)) for n, kind in names.items()})
    for index, test in enumerate(tests):
        emit({"event": "start", "test": index})
        judge.last = {}
        try:
            exec(compile(test, "<test>", "exec"), scope)
        except Timeout:
            return emit({"event": "fail", "kind": "timeout", "test": index, **judge.last})
        except RunnerGone:
            return emit({"event": "fail", "kind": "exit", "test": index, **judge.last})
        except BaseException as exc:
            kind = "unplain" if "unplain" in judge.last else "raised" if "raised" in judge.last else (
                "wrong" if type(exc) is AssertionError else "error")
            error = "" if kind != "error" else f"{type(exc).__name__}: {exc}"[:CUT]
            return emit({"event": "fail", "kind": kind, "test": index, "line": failing_line(exc, tests, index),
                         "error": error, **judge.last})
    return True


def main():
    began = time.monotonic()
    die_with_parent()
    config = loads(sys.argv[1])
    program = loads(sys.stdin.read())
    null = os.open("/dev/null", os.O_RDONLY)  # stdin stays open, so no pipe below takes descriptor 0
    os.dup2(null, 0)
    os.close(null)
    result = config["result_fd"]

    def emit(event):
        data = (dumps(event) + "\n").encode()
        while data:
            data = data[os.write(result, data):]

    work = os.getcwd()
    namespaces = unshare_namespaces()
    drop_privileges()
    isolation = {"uid": os.geteuid(), "namespaces": namespaces, "landlock": landlock(work),
                 "seccomp": seccomp_support()}
    set_limits({k: v for k, v in config["limits"].items() if k != "cpu"})
    emit({"event": "isolation", **isolation})
    to_runner, to_judge = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            runner(to_runner[0], to_judge[1], program["code"], work, config["limits"])
        finally:
            os._exit(1)
    os.close(to_runner[0])
    os.close(to_judge[1])
    with os.fdopen(config["secret_fd"], "rb") as f:
        secret = loads(f.read().decode())
    deadline = began + config["timeout_s"]
    channel = Channel(to_judge[0], to_runner[1])
    try:
        hello = channel.receive(deadline)
        if "load_error" in hello:
            emit({"event": "fail", "kind": "load", "raised": hello["load_error"]})
        elif run_tests(Judge(channel, deadline), hello["names"], secret["tests"], emit) is True:
            emit({"event": "pass", "nonce": secret["nonce"]})
    except Timeout:
        emit({"event": "fail", "kind": "timeout", "test": None})
    except RunnerGone:
        emit({"event": "fail", "kind": "exit", "test": None})
    except Exception as exc:  # a message that is not the protocol's: the runner's code wrote to the channel
        emit({"event": "fail", "kind": "protocol", "error": f"{type(exc).__name__}: {exc}"[:CUT]})
    finally:
        os.kill(pid, 9)  # SIGKILL to pid 1 of its namespace: every process the model started goes with it
        _, status = os.waitpid(pid, 0)
        emit({"event": "runner", "status": status})
