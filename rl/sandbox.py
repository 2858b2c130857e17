"""Run model-written code with no network, no secrets, bounded resources and no way to write
outside its own temporary folder.

Layers (each is reported by isolation(); a missing one is reported, not faked):
    process   a fresh session/process group, an empty environment (PATH, LANG, HOME and TMPDIR
              only), `python -I` for Python code, a temporary working folder removed afterwards;
    limits    RLIMIT_CPU, _AS (memory), _FSIZE, _NOFILE, _NPROC and _CORE=0 in the child;
    wall      the parent kills the whole process group with SIGKILL at the wall-clock limit (no
              signal-based timeouts in the parent, so any thread may call run_*);
    netns     `unshare --net` (util-linux): the child's network namespace has only a loopback
              that is down, so every connect fails, 127.0.0.1 included;
    pidns     `unshare --pid --fork --mount-proc`: the sandbox sees only its own processes and
              everything in it dies with its first process (rl/_sandbox_init.py);
    uid       a fresh non-root uid per run (UID_BASE + random) so RLIMIT_NPROC, which root
              ignores, bounds fork bombs per run rather than per shared user;
    readonly  in a private mount namespace every mount is remounted read-only and nosuid, home
              directories are hidden under empty tmpfs, and only the working folder is writable.
We run as root on the training machines; unshare works there and bubblewrap is not installed,
so this uses unshare plus a small stdlib init process instead of bwrap.

A wrapper process (rl/_sandbox_init.py) applies the mounts, limits and uid inside the
namespaces and reports the target's exit status over a pipe, so a setup failure is an error
(SandboxError) rather than a "failed" sample.
"""
from __future__ import annotations

import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

OUTPUT_LIMIT = 64 * 1024              # bytes kept of stdout and of stderr each
UID_BASE, UID_RANGE = 1_700_000_000, 10_000_000   # far above any real user or container id map
HIDE = ("/root", "/home", "/run/secrets", "/var/run/secrets")
CHILD_PATH = "/usr/bin:/bin"
_INIT = Path(__file__).with_name("_sandbox_init.py")
_PROBE = ("--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc")


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
    returncode: int | None   # exit code, -signal when killed by a signal, None on wall timeout
    stdout: str
    stderr: str
    wall_s: float


def _world_runnable(path: str) -> bool:
    """Can a uid with no rights of its own run `path` (o+x on every folder, o+rx on the file)?"""
    p = Path(path)
    if not p.is_file():
        return False
    if (p.stat().st_mode & (stat.S_IROTH | stat.S_IXOTH)) != (stat.S_IROTH | stat.S_IXOTH):
        return False
    return all(q.stat().st_mode & stat.S_IXOTH for q in p.parents)


@functools.lru_cache(maxsize=1)
def isolation() -> dict[str, str | bool]:
    """Which isolation primitives this machine has, and which the sandbox uses."""
    root = os.geteuid() == 0
    unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
    namespaces = False
    if unshare and root:
        try:
            namespaces = subprocess.run([unshare, *_PROBE, "true"], capture_output=True, timeout=20,
                                        env={"PATH": CHILD_PATH}).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            pass
    host_python = os.path.realpath(sys.executable)
    candidates = ["/usr/bin/python3", host_python] if root else [host_python]
    python = next((c for c in candidates if _world_runnable(c) or not root), "")
    return {
        "root": root,
        "unshare": unshare or "",
        "bwrap": shutil.which("bwrap") or "",     # available but not used (see module doc)
        "network_namespace": namespaces,
        "pid_namespace": namespaces,
        "readonly_filesystem": namespaces,
        "private_uid": root,
        "nproc_limit": "per-run uid" if root else "shared with the user's processes",
        "rlimits": True,
        "empty_environment": True,
        "python": python,
    }


def _write_files(workdir: Path, files: dict[str, str] | None, uid: int | None) -> None:
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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL every process of the run's private uid and wait until none is left. After a
    wall-clock kill the pid namespace is torn down asynchronously; this makes the end of
    run_* the end of the run's processes."""
    end = time.monotonic() + timeout_s
    while True:
        left = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat(f"/proc/{name}").st_uid == uid:
                        left.append(int(name))
                except FileNotFoundError:
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


def run_command(argv: list[str], limits: SandboxLimits = SandboxLimits(), files: dict[str, str] | None = None,
                stdin: str = "") -> SandboxResult:
    """Run argv[0] (an absolute path, or a name found on /usr/bin:/bin) in the sandbox, in a fresh
    temporary folder holding `files` (relative name -> text)."""
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of str, got {argv!r}")
    exe = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0], path=CHILD_PATH)
    if not exe:
        raise ValueError(f"{argv[0]!r} is not on the sandbox PATH {CHILD_PATH}")
    iso = isolation()
    ns = bool(iso["network_namespace"])
    uid = UID_BASE + secrets.randbelow(UID_RANGE) if iso["private_uid"] else None
    workdir = Path(tempfile.mkdtemp(prefix="glmforge-sandbox-"))
    status_r, status_w = os.pipe()
    proc, status = None, ""
    try:
        _write_files(workdir, files, uid)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
        cfg = {"status_fd": status_w, "readonly": ns, "pid_namespace": ns, "workdir": str(workdir),
               "hide": [h for h in HIDE if not exe.startswith(h + "/")], "uid": uid, "gid": uid,
               "limits": asdict(limits), "wall_s": limits.wall_s, "argv": [exe, *argv[1:]],
               "env": {"PATH": CHILD_PATH, "LANG": "C.UTF-8", "HOME": str(workdir), "TMPDIR": str(workdir)}}
        init = [os.path.realpath(sys.executable), "-I", "-S", str(_INIT), json.dumps(cfg)]
        cmd = [iso["unshare"], *_PROBE, "--", *init] if ns else init
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={"PATH": CHILD_PATH}, start_new_session=True, pass_fds=(status_w,))
        os.close(status_w)
        status_w = -1
        out, timed_out = _collect(proc, t0 + limits.wall_s)
        wall = time.monotonic() - t0
        proc.wait()
        os.set_blocking(status_r, False)
        try:
            status = os.read(status_r, 4096).decode()
        except BlockingIOError:
            status = ""
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
        if uid is not None and (proc is None or proc.returncode != 0 or not status.startswith("exit")):
            _kill_uid(uid)      # a kill from outside: the namespace may still be dying
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)
        shutil.rmtree(workdir, ignore_errors=True)
    if status.startswith("error"):
        raise SandboxError(f"sandbox setup failed: {status[6:]}")
    stdout, stderr = _decode(*out[0]), _decode(*out[1])
    if timed_out or status == "timeout":
        return SandboxResult("timeout", None, stdout, stderr, wall)
    if status.startswith("signal"):
        sig = int(status.split()[1])
        # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one.
        kind = "timeout" if sig == signal.SIGXCPU else "killed"
        return SandboxResult(kind, -sig, stdout, stderr, wall)
    if status.startswith("exit"):
        code = int(status.split()[1])
    else:     # the init process itself died (killed from outside): no target status
        return SandboxResult("killed", proc.returncode, stdout, stderr, wall)
    if code == 0:
        return SandboxResult("ok", 0, stdout, stderr, wall)
    memory = "MemoryError" in stderr[-2000:]
    return SandboxResult("memory" if memory else "failed", code, stdout, stderr, wall)


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
                _kill_group(proc.pid)     # leftovers (the pid namespace, when used, has none)
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
    """Run Python source as main.py (isolated mode, `python -I`) in the sandbox."""
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if files and "main.py" in files:
        raise ValueError("files may not contain 'main.py': the code is written there")
    python = isolation()["python"]
    if not python:
        raise SandboxError("no Python interpreter the sandbox uid can run (install python3 under /usr/bin)")
    return run_command([python, "-I", "main.py"], limits, {**(files or {}), "main.py": code}, stdin)
