"""Run a program the model wrote, with its tests, where it can neither escape nor fool the grade.

The parent (this module) never imports, compiles or executes model code. For each program it makes a temporary folder
(the program's cwd, HOME and TMPDIR; removed afterwards), a random nonce and two pipes, and starts a fresh
`python -I -S` running data/sandbox_judge.py (`BOOT`) in a new session, with a scrubbed environment, as uid 65534 when
it is root and that uid can run the interpreter. The judge isolates itself (namespaces, Landlock, seccomp, no
capabilities, rlimits), forks the runner that executes the model's code, and runs the tests against it: the design, and
why the runner cannot forge a pass, are in sandbox_judge.py's docstring. A program passes when the judge's last line on
the result pipe is the pass event carrying this run's nonce; an exit status never counts. At its deadline (the timeout
plus a grace for start-up) the parent kills the whole process group; the pid namespace takes every process the program
started with it.

`run_batch` grades many programs on parallel workers (threads that each wait on one subprocess), as many as the
cores; each program has its own deadline, so one slow program holds only its own worker. `isolation()` reports what
this host allows, measured once by a probe program: each layer it lacks is named there (and in docs/code.md).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JUDGE = Path(__file__).with_name("sandbox_judge.py")
# The judge's module imported (so its bytecode is cached, not compiled for every program), its folder then taken off
# the path before any model code runs.
BOOT = (f"import sys; sys.path.insert(0, {str(JUDGE.parent)!r}); import sandbox_judge; del sys.path[0]; "
        "sandbox_judge.main()")
NOBODY = 65534  # the uid and gid a root parent runs programs as
GRACE_S = 2.0  # the parent's deadline is the timeout plus this: the judge reports its own timeout first
MAX_EVENTS = 1 << 20  # bytes of the judge's events read


@dataclass(frozen=True)
class Limits:
    """What one program may use. The CPU limit is the timeout rounded up; processes count per pid namespace."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    file_mb: int = 16
    open_files: int = 64
    processes: int = 16

    def rlimits(self) -> dict[str, int]:
        return {"cpu": max(1, int(-(-self.timeout_s // 1))), "as": self.memory_mb << 20, "fsize": self.file_mb << 20,
                "nofile": self.open_files, "nproc": self.processes, "core": 0}


@dataclass(frozen=True)
class Program:
    """`code` is what the runner executes (the model's code, with any prompt or setup code it needs); each of
    `tests` is Python source the judge runs in turn, in which the names `code` defines call into the runner."""

    code: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    """A program's grade. `kind`: pass; wrong (an assert was false); raised (the model's code raised); unplain (it
    returned something that is not a plain value); error (the test raised on what it returned); load (the code raised
    before any test); timeout; exit (the runner ended during a test); protocol (the runner wrote to the judge's
    channel); crash (the judge ended without a verdict)."""

    passed: bool
    kind: str
    test: int | None = None  # index into Program.tests of the test that failed or was running
    line: str = ""  # the failing line of that test (the assert)
    call: str = ""  # the last call into the model's code, e.g. "f(1, 2)"
    returned: str = ""  # the repr of what it returned, cut to 200 characters
    error: str = ""  # "ValueError: bad input"
    traceback: str = ""  # through the model's code only
    status: str = ""  # how the runner ended, when that is the news
    seconds: float = 0.0
    isolation: dict[str, Any] = field(default_factory=dict)


def run_batch(programs: list[Program], limits: Limits = Limits(), workers: int = 0) -> list[Outcome]:
    """Grade every program, `workers` at a time (0: as many as the cores), in order."""
    drop = _drop_uid()
    workers = max(1, min(workers or os.cpu_count() or 1, len(programs)))
    if workers == 1:
        return [_run(p, limits, drop) for p in programs]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda p: _run(p, limits, drop), programs))


def run_one(program: Program, limits: Limits = Limits()) -> Outcome:
    return _run(program, limits, _drop_uid())


@functools.cache
def isolation() -> dict[str, Any]:
    """The layers this host gives a program, from a probe: uid, namespaces, Landlock (with why one is missing)."""
    outcome = _run(Program("def f():\n    return 1\n", ("assert f() == 1",)), Limits(), _drop_uid())
    if not outcome.passed:
        raise RuntimeError(f"the sandbox cannot run a trivial program on this host: {outcome}")
    return outcome.isolation


@functools.cache
def _drop_uid() -> bool:
    """Whether programs run as NOBODY: when the parent is root and the interpreter starts as that uid."""
    if os.geteuid() != 0:
        return False
    try:
        probe = subprocess.run([sys.executable, "-I", "-S", "-c", "import json, ctypes, socket"], user=NOBODY,
                               group=NOBODY, extra_groups=[], cwd="/", env=_environment("/"), capture_output=True,
                               timeout=60)
    except OSError:  # the interpreter is not readable by that uid (a pyenv under /root, say)
        return False
    return probe.returncode == 0


def _environment(work: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _run(program: Program, limits: Limits, drop: bool) -> Outcome:
    began = time.monotonic()
    work = tempfile.mkdtemp(prefix="redumix-sandbox-")
    nonce = secrets.token_hex(16)
    secret_r, secret_w = os.pipe()
    result_r, result_w = os.pipe()
    try:
        if drop:
            os.chown(work, NOBODY, NOBODY)
        config = {"result_fd": result_w, "secret_fd": secret_r, "timeout_s": limits.timeout_s,
                  "limits": limits.rlimits()}
        user: dict[str, Any] = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if drop else {}
        process = subprocess.Popen([sys.executable, "-I", "-S", "-c", BOOT, json.dumps(config)], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work,
                                   env=_environment(work), pass_fds=(secret_r, result_w), start_new_session=True,
                                   **user)
        os.close(secret_r)
        os.close(result_w)
        secret_r = result_w = -1
        _feed(process, secret_w, {"code": program.code}, {"nonce": nonce, "tests": list(program.tests)})
        secret_w = -1
        raw, timed_out = _read_events(result_r, began + limits.timeout_s + GRACE_S)
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the group leader is not reaped yet, so its id is still ours
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
        return _outcome(raw, nonce, timed_out, time.monotonic() - began)
    finally:
        for fd in (secret_r, secret_w, result_r, result_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(work, ignore_errors=True)


def _feed(process: subprocess.Popen, secret_w: int, program: dict, secret: dict) -> None:
    """The code on stdin, then the tests and nonce on the secret pipe (the judge reads them after forking the
    runner). A judge that died early leaves a broken pipe: its missing verdict is the failure."""
    try:
        assert process.stdin is not None
        process.stdin.write(json.dumps(program).encode())
        process.stdin.close()
        with os.fdopen(secret_w, "wb") as f:
            f.write(json.dumps(secret).encode())
    except BrokenPipeError:
        pass


def _read_events(fd: int, deadline: float) -> tuple[bytes, bool]:
    raw = b""
    while len(raw) < MAX_EVENTS:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return raw, True
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return raw, False
        raw += chunk
    return raw, False


def _outcome(raw: bytes, nonce: str, timed_out: bool, seconds: float) -> Outcome:
    events: list[dict[str, Any]] = []
    for line in raw.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    isolation = next(({k: v for k, v in e.items() if k != "event"} for e in events if e.get("event") == "isolation"),
                     {})
    verdicts = [e for e in events if e.get("event") in ("pass", "fail")]
    common: dict[str, Any] = {"seconds": round(seconds, 4), "isolation": isolation}
    if verdicts and verdicts[-1] == {"event": "pass", "nonce": nonce}:
        return Outcome(True, "pass", **common)
    status = next((_status(e.get("status")) for e in events if e.get("event") == "runner"), "")
    if not verdicts:
        started = [e.get("test") for e in events if e.get("event") == "start"]
        if timed_out:
            return Outcome(False, "timeout", started[-1] if started else None, status=status, **common)
        return Outcome(False, "crash", status="the judge ended without a verdict", **common)
    fail = verdicts[-1]
    raised: dict[str, Any] = fail["raised"] if isinstance(fail.get("raised"), dict) else {}
    kind = str(fail.get("kind", "crash"))
    if kind == "exit" and status.startswith("killed by SIGXCPU"):
        kind = "timeout"  # the CPU limit, the timeout rounded up, ended it
    error = (": ".join(str(raised[k]) for k in ("type", "message") if raised.get(k)) if raised
             else str(fail.get("unplain", "")) or str(fail.get("error", "")))
    status = status if kind in ("exit", "timeout") else ""
    test = fail.get("test") if isinstance(fail.get("test"), int) else None
    return Outcome(False, kind, test, str(fail.get("line", "")), str(fail.get("call", "")),
                   str(fail.get("returned", "")), error, str(raised.get("traceback", "")), status, **common)


def _status(status: Any) -> str:
    if not isinstance(status, int):
        return ""
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.WEXITSTATUS(status)}"
