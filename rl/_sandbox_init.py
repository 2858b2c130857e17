"""The sandbox's first process (see rl/sandbox.py): set up, drop privileges, run the target.

Started as root inside the new network/mount/pid namespaces (or, where those are missing, as a
plain child with only the rlimits). Stdlib only; run with `python -I -S`. It:
  1. makes every mount read-only and nosuid, hides home directories under empty tmpfs and
     binds the working folder back read-write (mount namespace: invisible to the host);
  2. sets the rlimits, drops to the sandbox uid/gid (no supplementary groups), sets
     no_new_privs (setuid binaries gain nothing) and is not ptrace-able by the target;
  3. forks the target, reaps every orphan (it is pid 1 of the namespace) and writes the
     target's wait status to the status pipe; exiting then kills whatever is left.
A wall-clock alarm is the backstop for a parent that died before it could kill us.
"""
import ctypes
import json
import os
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
_KEEP = {"nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME,
         "relatime": MS_RELATIME}

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _unescape(path: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \ooo octal escapes
    return path.encode().decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape")


def _readonly_everything(workdir: str, hide: list[str]) -> None:
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target, opts = _unescape(fields[4]), fields[5].split(",")
        if not os.path.exists(target):      # shadowed by a later mount
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for o in opts:
            flags |= _KEEP.get(o, 0)
        try:
            _mount(None, target, None, flags)
        except OSError:
            if target == "/":
                raise
            # A mount that refuses a bind remount (rare kernel-internal ones) stays as it is;
            # the sandbox uid still cannot write there without permission.
    for d in hide:
        if os.path.isdir(d):
            _mount("tmpfs", d, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0755")
    _mount(workdir, workdir, None, MS_BIND)
    _mount(None, workdir, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)


def _limits(cfg: dict) -> None:
    lim = cfg["limits"]
    mb = 1024 * 1024
    for res, soft, hard in (
            (resource.RLIMIT_CORE, 0, 0),
            (resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1),   # soft: SIGXCPU, hard: SIGKILL
            (resource.RLIMIT_AS, lim["memory_mb"] * mb, lim["memory_mb"] * mb),
            (resource.RLIMIT_FSIZE, lim["file_size_mb"] * mb, lim["file_size_mb"] * mb),
            (resource.RLIMIT_NOFILE, lim["open_files"], lim["open_files"]),
            (resource.RLIMIT_NPROC, lim["max_processes"], lim["max_processes"])):
        resource.setrlimit(res, (soft, hard))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)        # the target never sees it

    def report(msg: str) -> None:
        os.write(status_fd, msg.encode())

    try:
        if cfg["readonly"]:
            _readonly_everything(cfg["workdir"], cfg["hide"])
        _limits(cfg)
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
        # The uid change cleared unshare's --kill-child death signal: set it again.
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    except OSError as e:
        report(f"error {e}")
        os._exit(125)

    def backstop(*_):
        report("timeout")
        if not cfg["pid_namespace"]:
            os.killpg(0, signal.SIGKILL)
        os._exit(124)

    signal.signal(signal.SIGALRM, backstop)
    signal.alarm(int(cfg["wall_s"]) + 2)
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            os.chdir(cfg["workdir"])
            os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
        except OSError as e:
            os.write(2, f"sandbox: cannot run {cfg['argv'][0]}: {e}\n".encode())
        os._exit(127)
    while True:
        p, st = os.waitpid(-1, 0)
        if p == pid:
            break
    report(f"signal {os.WTERMSIG(st)}" if os.WIFSIGNALED(st) else f"exit {os.WEXITSTATUS(st)}")
    os._exit(0)


if __name__ == "__main__":
    main()
