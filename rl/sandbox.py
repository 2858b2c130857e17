"""Run model-written code with no network, no secrets, bounded resources and no way to write
outside its own working folder.

bubblewrap (`bwrap`, Debian's bubblewrap package) builds the sandbox of each run:
    namespaces  new user, network, pid, mount, ipc, uts and cgroup namespaces, and no further user
                namespace inside (--disable-userns). The network namespace holds only its own
                loopback, so no socket reaches the host: TCP, UDP, abstract unix sockets and
                netlink all live per network namespace;
    sockets     a seccomp filter (--seccomp) refuses every socket family but unix, inet, inet6 and
                netlink: others, AF_VSOCK to a VM's host above all, are not per network namespace.
                io_uring, which can make sockets past that filter, is refused too, and so is any
                syscall of another ABI (i386, x32);
    filesystem  a new root holding only /usr read-only, /bin, /lib*, /sbin as the host has them
                (merged-/usr links), the few /etc entries programs read (ETC), a fresh /proc and a
                minimal read-only /dev. The working folder, at WORKDIR, is the one writable place.
                The host's /tmp, /run, /dev/shm, home folders, /work, the repo, the artifact store
                and the virtualenv are absent, so no unix socket of the host can even be named;
    uid         a fresh non-root uid per run (UID_BASE + random) when we are root: bwrap itself
                runs as that uid and needs no privilege. RLIMIT_NPROC counts a uid's processes
                and root ignores it, so only a private uid bounds a fork bomb per run;
    limits      RLIMIT_CPU, _AS (memory), _FSIZE, _NOFILE, _NPROC and _CORE=0, set by prlimit
                (util-linux) before bwrap starts and inherited by everything in the sandbox;
    process     an empty environment (PATH, LANG, HOME and TMPDIR = the working folder), a new
                session (--new-session: no TIOCSTI into the caller's terminal), `python -I` of the
                system /usr/bin/python3;
    lifetime    the parent kills bwrap at the wall-clock limit (no signal-based timeouts in the
                parent, so any thread may call run_*); bwrap's pid 1 dies with it
                (--die-with-parent), and the kernel ends every process of a pid namespace before
                its pid 1 exits, so run_* returns once that pid 1 is gone: nothing outlives it.
bwrap reports the program's exit code over --json-status-fd, so a sandbox that could not be set
up is an error (SandboxError) rather than a "failed" sample.

Without a working bwrap, run_* raise SandboxError unless weak isolation was allowed
(require_isolation(allow_weak=True), which the RL stages call with their
sandbox_allow_weak_isolation setting): the code then runs with the same limits, private uid and
environment (the uid when we are root), but sees the host's files and network, and only the uid
bounds what it leaves running.
"""
from __future__ import annotations

import functools
import glob
import json
import logging
import os
import platform
import secrets
import select
import selectors
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("glmforge")

OUTPUT_LIMIT = 64 * 1024              # bytes kept of stdout and of stderr each
UID_BASE, UID_RANGE = 1_700_000_000, 10_000_000   # far above any real user or container id map
CHILD_PATH = "/usr/bin:/bin"
TOOL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"     # bwrap and prlimit: never a venv's or ~/bin's
SYSTEM_PYTHON = "/usr/bin/python3"
WORKDIR = "/sandbox"                  # the working folder, as the sandboxed program sees it
# /etc entries programs read: the dynamic linker's cache, Debian's alternatives (awk, ...) and
# Python's sitecustomize (/usr/lib/python3.X/sitecustomize.py links into /etc/python3.X).
ETC = ("/etc/ld.so.cache", "/etc/alternatives", "/etc/python3*")
BWRAP_PROCESSES = 2                   # bwrap's own two processes count against RLIMIT_NPROC too
ALLOW_WEAK_ENV = "GLMFORGE_SANDBOX_ALLOW_WEAK_ISOLATION"   # set by require_isolation; workers inherit it
_REMEDY = ("install Debian's bubblewrap (apt-get install bubblewrap; `make setup` does as root), or set {setting}: "
           "true to run model-written code without isolation (limits, a private uid and an empty environment only)")


# seccomp's view of a syscall (struct seccomp_data) and the classic-BPF words that filter it
_NR, _ARCH, _ARG0 = 0, 4, 16          # offsets: syscall number, audit arch, low half of args[0]
_LD_W_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EAFNOSUPPORT, _ENOSYS = 97, 38
_SOCKET_FAMILIES = (1, 2, 10, 16)     # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
# machine -> (audit arch, socket, socketpair, io_uring_setup)
_SYSCALLS = {"x86_64": (0xC000003E, 41, 53, 425), "aarch64": (0xC00000B7, 198, 199, 425)}


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not the code under test failing)."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512
    file_size_mb: int = 16
    open_files: int = 64
    max_processes: int = 32

    def __post_init__(self):
        for name, v in asdict(self).items():
            if not v > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {v!r}")


@dataclass
class SandboxResult:
    status: str          # "ok" (exit 0) | "failed" (nonzero exit) | "timeout" | "memory" | "killed"
    returncode: int | None   # exit code, -signal when killed by a signal, None on wall timeout. bwrap
    # reports a death by signal n as exit code 128 + n, as shells do: such an exit reads as signal n.
    stdout: str
    stderr: str
    wall_s: float


@dataclass(frozen=True)
class _Host:
    root: bool
    bwrap: str
    prlimit: str
    python: str


@functools.lru_cache(maxsize=1)
def _host() -> _Host:
    return _Host(root=os.geteuid() == 0, bwrap=shutil.which("bwrap", path=TOOL_PATH) or "",
                 prlimit=shutil.which("prlimit", path=TOOL_PATH) or "",
                 python=SYSTEM_PYTHON if os.access(SYSTEM_PYTHON, os.X_OK) else "")


@functools.lru_cache(maxsize=1)
def _root() -> tuple[str, ...]:
    """bwrap arguments of the read-only root: /usr, the host's /bin, /lib*, /sbin (links on a
    merged-/usr system, folders otherwise) and the ETC entries that exist."""
    args = ["--ro-bind", "/usr", "/usr"]
    for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    for pattern in ETC:
        for p in sorted(glob.glob(pattern)):
            args += ["--ro-bind", p, p]
    return tuple(args)


@functools.lru_cache(maxsize=1)
def _socket_filter() -> bytes:
    """The seccomp program (struct sock_filter[]) of the sockets layer in the module doc; b"" on
    a machine whose syscall numbers are not in _SYSCALLS."""
    if platform.machine() not in _SYSCALLS:
        return b""
    arch, socket_nr, socketpair_nr, io_uring_nr = _SYSCALLS[platform.machine()]
    n = len(_SOCKET_FAMILIES)

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("<HBBI", code, jt, jf, k)

    return b"".join([
        op(_LD_W_ABS, _ARCH), op(_JEQ, arch, 1, 0), op(_RET, _KILL_PROCESS),
        op(_LD_W_ABS, _NR), op(_JGE, 0x40000000, 0, 1), op(_RET, _KILL_PROCESS),        # x32
        op(_JEQ, io_uring_nr, 0, 1), op(_RET, _ERRNO | _ENOSYS),
        op(_JEQ, socket_nr, 1, 0), op(_JEQ, socketpair_nr, 0, n + 2),
        op(_LD_W_ABS, _ARG0),
        *(op(_JEQ, family, n - i, 0) for i, family in enumerate(_SOCKET_FAMILIES)),
        op(_RET, _ERRNO | _EAFNOSUPPORT),
        op(_RET, _ALLOW)])


def _bwrap_argv(bwrap: str, workdir: Path, env: dict[str, str], status_fd: int, seccomp_fd: int | None,
                read_only: tuple[str, ...] = ()) -> list[str]:
    setenv = [a for k, v in env.items() for a in ("--setenv", k, v)]
    seccomp = [] if seccomp_fd is None else ["--seccomp", str(seccomp_fd)]
    mounts = [a for p in read_only for a in ("--ro-bind", p, p)]
    return [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--clearenv", *setenv, *_root(), *mounts, "--proc", "/proc", "--dev", "/dev",
            "--remount-ro", "/dev", "--bind", str(workdir), WORKDIR, "--chdir", WORKDIR, "--remount-ro", "/",
            *seccomp, "--json-status-fd", str(status_fd), "--",
            # bwrap sets PWD after --clearenv; env drops it so the environment is exactly `env`
            "/usr/bin/env", "-u", "PWD", "--"]


def _probe(host: _Host) -> str:
    """Why bwrap isolation does not work here ("" when it does): a real sandboxed run of true."""
    if not host.bwrap:
        return f"bwrap not found on {TOOL_PATH}"
    if not host.prlimit:
        return f"prlimit (util-linux) not found on {TOOL_PATH}"
    try:
        r = _run(["/usr/bin/true"], SandboxLimits(wall_s=30), None, "", weak=False)
    except (SandboxError, OSError) as e:
        return f"bwrap does not work here: {e}"
    return "" if r.status == "ok" else f"bwrap does not work here: a sandboxed `true` ended {r.status}"


@functools.lru_cache(maxsize=1)
def isolation() -> dict[str, Any]:
    """What the sandbox enforces on this machine (probed once per process)."""
    host = _host()
    problem = _probe(host)
    ok = not problem
    version = ""
    if host.bwrap:
        try:
            version = subprocess.run([host.bwrap, "--version"], capture_output=True, text=True, timeout=20,
                                     env={"PATH": CHILD_PATH}).stdout.strip().rpartition(" ")[2]
        except (OSError, subprocess.TimeoutExpired):
            pass
    root = _root()
    visible = [root[i + 2] for i in range(len(root)) if root[i] in ("--ro-bind", "--symlink")]
    return {
        "tool": "bwrap" if ok else "none",
        "bwrap": host.bwrap,
        "bwrap_version": version,
        "problem": problem,                       # why there is no isolation; "" when bwrap works
        "network_namespace": ok,
        "pid_namespace": ok,
        "mount_namespace": ok,
        "readonly_filesystem": ok,                # only the working folder is writable
        "host_paths_visible": visible if ok else ["/ (everything the uid may read)"],
        "socket_families": ("unix, inet, inet6, netlink" if _socket_filter() else
                            f"all (no seccomp filter for {platform.machine()})") if ok else "all",
        "private_uid": host.root,
        "nproc_limit": "per-run uid" if host.root else "none (not root: no private uid to count)",
        "rlimits": bool(host.prlimit),
        "empty_environment": True,
        "python": host.python,
    }


def require_isolation(allow_weak: bool, setting: str = "sandbox_allow_weak_isolation") -> dict[str, Any]:
    """isolation() when bwrap works here. Otherwise SandboxError naming what is missing and the
    config `setting` that opts out, unless allow_weak: then this process, and the reward and
    rollout workers it starts after this call (they inherit the environment), run model-written
    code with weak isolation."""
    iso = isolation()
    if iso["tool"] == "bwrap":
        return iso
    if not allow_weak:
        raise SandboxError(f"{iso['problem']}: {_REMEDY.format(setting=setting)}")
    log.warning("sandbox: %s; %s is set: model-written code runs WITHOUT isolation", iso["problem"], setting)
    os.environ[ALLOW_WEAK_ENV] = "1"
    return iso


def _weak() -> bool:
    """Run without bwrap? Only when it does not work here and weak isolation was allowed."""
    iso = isolation()
    if iso["tool"] == "bwrap":
        return False
    if os.environ.get(ALLOW_WEAK_ENV) == "1":
        return True
    raise SandboxError(f"{iso['problem']}: {_REMEDY.format(setting='the RL stage sandbox_allow_weak_isolation')}")


def _write_files(workdir: Path, files: dict[str, str] | None, uid: int | None, tree: Path | None = None) -> None:
    if tree is not None:         # a folder's copy first (binary files too); `files` may overwrite its files
        shutil.copytree(tree, workdir, symlinks=True, dirs_exist_ok=True)
    for name, text in (files or {}).items():
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(f"sandbox file name {name!r} must be a relative path inside the folder")
        if not isinstance(text, str):
            raise ValueError(f"sandbox file {name!r}: content must be a str, got {type(text).__name__}")
        path = workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if uid is not None:
        for dirpath, dirnames, filenames in os.walk(workdir):
            for n in [dirpath, *(os.path.join(dirpath, x) for x in dirnames + filenames)]:
                os.chown(n, uid, uid)
        os.chmod(workdir, 0o700)


def _prlimit_argv(prlimit: str, limits: SandboxLimits, nproc: int | None) -> list[str]:
    mb = 1024 * 1024
    argv = [prlimit, "--core=0", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",    # soft: SIGXCPU, hard: SIGKILL
            f"--as={limits.memory_mb * mb}", f"--fsize={limits.file_size_mb * mb}", f"--nofile={limits.open_files}"]
    return argv + ([f"--nproc={nproc}"] if nproc is not None else []) + ["--"]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _await_sandbox_end(pid: int, pid_namespace: int, timeout_s: float = 5.0) -> None:
    """Wait until the sandbox's pid 1 (bwrap's init) has exited: the kernel kills and reaps every
    other process of a pid namespace before its pid 1 exits. It dies with bwrap; SIGKILL if not.
    The pidfd holds the process; its pid namespace, which bwrap reported, proves it is ours."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != f"pid:[{pid_namespace}]":
                return                    # gone, and its pid taken by another process since
        except OSError:
            return                        # gone (or, not root, not ours to inspect)
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        if not poll.poll(1000):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            poll.poll(timeout_s * 1000)
    finally:
        os.close(fd)


def _kill_uid(uid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL every process of the run's private uid and wait until none is left but zombies
    (whoever adopted them reaps them in its own time): without a pid namespace (weak isolation)
    this is what ends a process that left the process group."""
    end = time.monotonic() + timeout_s
    while True:
        left = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat(f"/proc/{name}").st_uid == uid and \
                            Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                        left.append(int(name))
                except (FileNotFoundError, ProcessLookupError, IndexError):
                    continue
        if not left or time.monotonic() > end:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _decode(buf: bytearray, dropped: int) -> str:
    text = buf.decode("utf-8", errors="replace")
    return text + (f"\n[... {dropped} more bytes truncated]" if dropped else "")


def _bwrap_status(raw: bytes) -> dict[str, int]:
    """bwrap's --json-status-fd, one JSON object a line, merged: "child-pid" (our pid of the
    sandbox's pid 1), "pid-namespace", and "exit-code", written only once the program started."""
    status: dict[str, int] = {}
    for line in raw.decode(errors="replace").splitlines():
        try:
            status.update(json.loads(line))
        except (ValueError, TypeError):
            continue
    return status


def run_command(argv: list[str], limits: SandboxLimits = SandboxLimits(), files: dict[str, str] | None = None,
                stdin: str = "", tree: Path | None = None, read_only: tuple[str, ...] = ()) -> SandboxResult:
    """Run argv[0] (an absolute path under /usr or /bin, or a name found on /usr/bin:/bin; or a
    link to one inside a `read_only` folder, as a virtualenv's python is) in the sandbox, in a
    fresh working folder holding a copy of `tree` and then `files` (relative name -> text).
    read_only: host folders the sandbox sees read-only at the same path (a prepared virtualenv;
    never a folder holding credentials). bwrap runs as the sandbox's uid, so each must be
    reachable by others (every folder above it searchable)."""
    read_only = tuple(str(Path(p).resolve()) for p in read_only)
    for p in read_only:
        if not Path(p).is_dir() or p in ("/", str(Path.home())) or p.startswith(("/proc", "/sys", "/dev", "/etc")):
            raise ValueError(f"read_only {p!r}: only a prepared folder (not /, a home, /proc, /sys, /dev, /etc)")
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of str, got {argv!r}")
    exe = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0], path=CHILD_PATH)
    if not exe:
        raise ValueError(f"{argv[0]!r} is not on the sandbox PATH {CHILD_PATH}")
    if not os.path.realpath(exe).startswith(("/usr/", "/bin/", "/sbin/")):
        raise ValueError(f"{exe} is outside /usr, /bin and /sbin: the sandbox sees only the system's programs")
    if not exe.startswith(("/usr/", "/bin/", "/sbin/")) and not any(exe.startswith(p + "/") for p in read_only):
        raise ValueError(f"{exe} is not inside a read_only folder: the sandbox would not see it")
    return _run([exe, *argv[1:]], limits, files, stdin, _weak(), tree, read_only)


def _run(argv: list[str], limits: SandboxLimits, files: dict[str, str] | None, stdin: str,
         weak: bool, tree: Path | None = None, read_only: tuple[str, ...] = ()) -> SandboxResult:
    host = _host()
    if not host.prlimit:
        raise SandboxError(f"prlimit (util-linux) not found on {TOOL_PATH}: the sandbox cannot set its limits")
    uid = UID_BASE + secrets.randbelow(UID_RANGE) if host.root else None
    nproc = None if uid is None else limits.max_processes + (0 if weak else BWRAP_PROCESSES)
    workdir = Path(tempfile.mkdtemp(prefix="glmforge-sandbox-"))
    status_r, status_w = os.pipe()        # bwrap's --json-status-fd
    seccomp_r = None                      # bwrap reads the filter from a pipe to its end
    if not weak and _socket_filter():
        seccomp_r, seccomp_w = os.pipe()
        os.write(seccomp_w, _socket_filter())
        os.close(seccomp_w)
    proc, status = None, b""
    try:
        _write_files(workdir, files, uid, tree)
        home = str(workdir) if weak else WORKDIR
        env = {"PATH": CHILD_PATH, "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home}
        cmd = _prlimit_argv(host.prlimit, limits, nproc)
        if weak:
            cmd, fds = cmd + argv, ()
        else:
            cmd += _bwrap_argv(host.bwrap, workdir, env, status_w, seccomp_r, read_only) + argv
            fds = (status_w,) if seccomp_r is None else (status_w, seccomp_r)
            env = {"PATH": CHILD_PATH}
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                    cwd=workdir, start_new_session=True, pass_fds=fds, user=uid, group=uid,
                                    extra_groups=None if uid is None else [])
        os.close(status_w)
        status_w = -1
        out, timed_out = _collect(proc, t0 + limits.wall_s)
        wall = time.monotonic() - t0
        proc.wait()
        os.set_blocking(status_r, False)
        try:
            while chunk := os.read(status_r, 4096):
                status += chunk
        except BlockingIOError:
            pass
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)
        if seccomp_r is not None:
            os.close(seccomp_r)
        reported = _bwrap_status(status)
        if "child-pid" in reported and "pid-namespace" in reported:
            _await_sandbox_end(reported["child-pid"], reported["pid-namespace"])
        if weak and uid is not None:
            _kill_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)
    stdout, stderr = _decode(*out[0]), _decode(*out[1])
    if timed_out:
        return SandboxResult("timeout", None, stdout, stderr, wall)
    exit_code = proc.returncode if weak else reported.get("exit-code")
    if exit_code is None:
        if proc.returncode < 0:          # bwrap itself was killed from outside
            return SandboxResult("killed", proc.returncode, stdout, stderr, wall)
        raise SandboxError(f"sandbox setup failed: {(stderr.strip().splitlines() or ['no message'])[-1]}")
    elif not weak and 128 < exit_code < 128 + signal.NSIG:
        exit_code = -(exit_code - 128)   # bwrap reports death by signal n as 128 + n, as shells do
    if exit_code < 0:
        # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one.
        kind = "timeout" if -exit_code == signal.SIGXCPU else "killed"
        return SandboxResult(kind, exit_code, stdout, stderr, wall)
    if exit_code == 0:
        return SandboxResult("ok", 0, stdout, stderr, wall)
    memory = "MemoryError" in stderr[-2000:]
    return SandboxResult("memory" if memory else "failed", exit_code, stdout, stderr, wall)


def _collect(proc: subprocess.Popen, deadline: float) -> tuple[list[tuple[bytearray, int]], bool]:
    """Read stdout/stderr (first OUTPUT_LIMIT bytes kept, the rest counted) until both close or
    the deadline passes; at the deadline, or once the main process is gone, SIGKILL the group."""
    bufs = {proc.stdout: [bytearray(), 0], proc.stderr: [bytearray(), 0]}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    timed_out, gone_at = False, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                _kill_group(proc.pid)
                break
            if gone_at is not None and now - gone_at > 1.0:
                break          # something outside the group still holds the pipes
            for key, _ in sel.select(min(deadline - now, 0.2)):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]
                room = OUTPUT_LIMIT - len(buf[0])
                buf[0] += chunk[:room]
                buf[1] += max(0, len(chunk) - room)
            if gone_at is None and _exited(proc.pid):
                gone_at = time.monotonic()
                _kill_group(proc.pid)     # leftovers (under bwrap the pid namespace ends them)
    finally:
        sel.close()
        for f in bufs:
            f.close()
    return [tuple(bufs[proc.stdout]), tuple(bufs[proc.stderr])], timed_out


def _exited(pid: int) -> bool:
    """Has pid exited? Not reaped (WNOWAIT), so its pid, which is the group id, is not reused
    before we kill the group."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), files: dict[str, str] | None = None,
               stdin: str = "") -> SandboxResult:
    """Run Python source as main.py with the system's /usr/bin/python3 in isolated mode (`-I`)."""
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if files and "main.py" in files:
        raise ValueError("files may not contain 'main.py': the code is written there")
    python = _host().python
    if not python:
        raise SandboxError(f"no {SYSTEM_PYTHON} for the sandbox: install Debian's python3")
    return run_command([python, "-I", "main.py"], limits, {**(files or {}), "main.py": code}, stdin)
