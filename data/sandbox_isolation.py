"""The sandbox's isolation layers, each a system call made through ctypes before the model's code runs.

Imported by data/sandbox_judge.py inside the sandbox (standard library only). Each function either applies its layer
or says why the host has none; none of them can be undone by the process that applied it.

- `unshare_namespaces`: user, network and pid namespaces. No network but a loopback that is down; the runner, forked
  next, is pid 1 of its own namespace, so when it dies every process in it dies, and nothing outside it is visible.
- `drop_privileges`: no capabilities (a new user namespace grants them all inside it), no new privileges (no setuid
  binary can raise them), and the judge is not dumpable (no ptrace, no /proc/PID/mem by a process of its uid).
- `landlock`: reads of the interpreter's prefixes, its import path and the system libraries only; writes only beneath
  the temporary folder; no TCP bind or connect (ABI 4+); no signal and no abstract socket outside the domain (ABI 6+).
  Each call nests a domain in the caller's: the runner's domain is inside the judge's, so the runner cannot ptrace
  or signal the judge, while the judge can still kill the runner.
- `no_new_processes`: a seccomp filter that refuses fork, vfork, clone without CLONE_THREAD and clone3 (threads still
  start, through clone). RLIMIT_NPROC cannot bound a fork bomb of uid 0, which is what a root host runs as when the
  interpreter is not readable by another uid; this can.
- `die_with_parent`: the process is killed when its parent ends, so a grader that dies leaves no judge behind, and
  a judge that dies no runner.
- `set_limits`: rlimits (CPU seconds, address space, file size, open files, processes, no core files).
"""

from __future__ import annotations

import ctypes
import os
import resource
import struct
import sys

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long



def unshare_namespaces():
    """New user, network and pid namespaces, the current uid and gid mapped to themselves. Children only enter the pid
    namespace: the runner, forked next, is its pid 1."""
    uid, gid = os.geteuid(), os.getegid()
    if LIBC.unshare(0x10000000 | 0x40000000 | 0x20000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID
        return f"none (unshare: {os.strerror(ctypes.get_errno())})"
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return "user+net+pid"


def die_with_parent():
    """SIGKILL when the parent ends (PR_SET_PDEATHSIG): a judge whose grader died, a runner whose judge died."""
    if LIBC.prctl(1, 9, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def drop_privileges():
    """No capabilities (a new user namespace grants them all inside it), no new privileges, not dumpable."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    data = (ctypes.c_uint32 * 6)()
    if LIBC.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    for option in ((38, 1), (4, 0)):  # PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE
        if LIBC.prctl(option[0], option[1], 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")


def landlock(work):
    """Read and execute the interpreter and system files, write only beneath `work`, no TCP, no signal out. Returns
    the ABI version, or why there is none. Each call adds a domain nested in the caller's."""
    abi = LIBC.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        return f"unavailable ({os.strerror(ctypes.get_errno())})"
    every = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    read_dir, file_rights = 1 | 4 | 8, 1 | 2 | 4 | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    attr = (ctypes.c_uint64 * 3)(every, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)  # fs, tcp bind|connect, scopes
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = LIBC.syscall(444, attr, size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    rules = {work: every, "/dev/null": 2 | 4 | (1 << 14 if abi >= 3 else 0)}
    for path in ("/dev/urandom", "/dev/random", "/dev/zero"):
        rules[path] = 4
    for path in _read_paths():
        rules.setdefault(path, read_dir)
    for path, rights in rules.items():
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rights &= every if os.path.isdir(path) else file_rights
        rule = (ctypes.c_uint64 * 2)(rights, fd & 0xFFFFFFFF)  # landlock_path_beneath_attr: u64 access, s32 fd
        if LIBC.syscall(445, ruleset, 1, ctypes.cast(rule, ctypes.c_void_p), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
        os.close(fd)
    if LIBC.prctl(38, 1, 0, 0, 0) != 0 or LIBC.syscall(446, ruleset, 0) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)
    return f"abi {abi}"


def _read_paths():
    """The interpreter's prefixes, its import path and the system's libraries: what Python and its modules read."""
    here = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path,
            os.path.dirname(os.path.realpath(sys.executable))]
    found = {os.path.realpath(p) for p in here if p and os.path.isdir(p)}
    return sorted(found) + ["/usr", "/lib", "/lib64", "/bin", "/etc"]


def set_limits(limits):
    for name, value in limits.items():
        kind = getattr(resource, f"RLIMIT_{name.upper()}")
        hard = value + 1 if name == "cpu" else value  # SIGXCPU at the soft limit, SIGKILL a second later
        resource.setrlimit(kind, (value, hard))


# (audit arch, fork, vfork, clone, clone3) by machine; aarch64 has no fork or vfork system call.
_SYSCALLS = {"x86_64": (0xC000003E, 57, 58, 56, 435), "aarch64": (0xC00000B7, -1, -1, 220, 435)}


def seccomp_support():
    machine = os.uname().machine
    return "no new processes" if machine in _SYSCALLS else f"unavailable (no syscall table for {machine})"


def no_new_processes():
    """The seccomp filter that refuses every new process (EPERM) and lets threads start, where `seccomp_support`
    says there is one."""
    machine = os.uname().machine
    if machine not in _SYSCALLS:
        return
    arch, fork, vfork, clone, clone3 = _SYSCALLS[machine]
    allow, deny, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_ALLOW, ERRNO(EPERM), ERRNO(ENOSYS)
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    program = [
        (load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny),  # another ABI's system calls (i386 on x86_64): none
        (load, 0, 0, 0), (jge, 10, 0, 0x40000000),  # x32 system calls: deny
        (jeq, 9, 0, fork & 0xFFFFFFFF), (jeq, 8, 0, vfork & 0xFFFFFFFF),
        (jeq, 6, 0, clone3), (jeq, 1, 0, clone), (ret, 0, 0, allow),
        (load, 0, 0, 16), (jset, 1, 0, 0x00010000),  # clone's flags: CLONE_THREAD starts a thread
        (ret, 0, 0, deny), (ret, 0, 0, allow),
        (ret, 0, 0, enosys),  # clone3: glibc then falls back to clone, which the flags decide
        (ret, 0, 0, deny),
    ]
    code = b"".join(struct.pack("HBBI", *op) for op in program)
    buffer = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxP", len(program), ctypes.addressof(buffer))
    if LIBC.prctl(38, 1, 0, 0, 0) != 0 or LIBC.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp")  # PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP with a filter
