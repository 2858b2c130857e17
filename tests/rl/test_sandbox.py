"""Each escape is tried INSIDE the sandbox and must fail there, with the host left intact.
The escapes need bubblewrap: where bwrap is not installed they skip and say so; where it is
installed it must work (test_installed_bwrap_works), so a broken sandbox fails rather than skips."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from rl import sandbox
from rl.sandbox import (
    ALLOW_WEAK_ENV,
    OUTPUT_LIMIT,
    TOOL_PATH,
    UID_BASE,
    UID_RANGE,
    SandboxError,
    SandboxLimits,
    isolation,
    require_isolation,
    run_command,
    run_python,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _needs_bwrap(request):
    """Every test but those that simulate a machine without bubblewrap (fixture no_bwrap)."""
    if "no_bwrap" not in request.fixturenames and not shutil.which("bwrap", path=TOOL_PATH):
        pytest.skip("bwrap (Debian's bubblewrap) is not installed: `make setup` as root and .ci/run install it")


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line holds `marker` (other sandboxes may run at the
    same time on a shared machine: a unique marker tells ours apart)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if marker.encode() in (p / "cmdline").read_bytes():
                out.append(int(p.name))
        except OSError:
            continue
    return out


def run_ok(code: str, **kw) -> str:
    r = run_python(code, **kw)
    assert r.status == "ok", r
    return r.stdout


def test_happy_path_prints_exit_code_files_and_stdin():
    r = run_python("import sys, os\nprint(open('data/in.txt').read(), sys.stdin.read())\n"
                   "print(sorted(os.environ))\nopen('out.txt', 'w').write('x')\nsys.exit(3)",
                   files={"data/in.txt": "hello"}, stdin="from stdin")
    assert r.status == "failed" and r.returncode == 3, r
    assert r.stdout.splitlines()[0] == "hello from stdin"
    assert r.stdout.splitlines()[1] == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    ok = run_python("print(6 * 7)")
    assert (ok.status, ok.returncode, ok.stdout, ok.stderr) == ("ok", 0, "42\n", "")
    assert 0 < ok.wall_s < 10
    cmd = run_command(["cat", "f.txt"], files={"f.txt": "via run_command"})
    assert (cmd.status, cmd.stdout) == ("ok", "via run_command")


# ---------------------------------------------------------------- sockets
_CONNECT = ("import socket, sys\ns = socket.socket({family}, socket.SOCK_STREAM)\ns.settimeout(3)\n"
            "try:\n    s.connect({address!r}); print('CONNECTED')\n"
            "except OSError as e:\n    print('blocked', e.errno)\n")


@pytest.fixture(params=["tcp-loopback", "unix-path-in-tmp", "unix-abstract"])
def listening(request):
    """A listening stream socket of the host, reachable by anyone on the host: (family, address)."""
    kind = request.param
    if kind == "tcp-loopback":
        server, family = socket.socket(socket.AF_INET), "socket.AF_INET"
        server.bind(("127.0.0.1", 0))
    elif kind == "unix-path-in-tmp":                 # world-writable, as the attacker found one
        server, family = socket.socket(socket.AF_UNIX), "socket.AF_UNIX"
        server.bind(f"/tmp/glmforge-sandbox-test-{uuid.uuid4().hex}.sock")
        os.chmod(server.getsockname(), 0o777)
    else:                                            # abstract: per network namespace, no file at all
        server, family = socket.socket(socket.AF_UNIX), "socket.AF_UNIX"
        server.bind(f"\0glmforge-sandbox-test-{uuid.uuid4().hex}")
    server.listen(8)
    server.setblocking(False)
    address = server.getsockname()
    try:
        yield server, family
    finally:
        server.close()
        if kind == "unix-path-in-tmp":
            os.unlink(address)


def test_no_stream_socket_reaches_the_host(listening):
    server, family = listening
    address = server.getsockname()
    out = run_ok(_CONNECT.format(family=family, address=address))
    assert "blocked" in out and "CONNECTED" not in out, out
    with pytest.raises(BlockingIOError):
        server.accept()                              # nothing reached the server
    with socket.socket(server.family) as client:     # the host itself can: the server works
        client.connect(address)
        time.sleep(0.05)
        server.accept()[0].close()


def test_no_udp_datagram_reaches_the_host():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        server.setblocking(False)
        out = run_ok("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                     "for _ in range(5):\n    try:\n"
                     f"        s.sendto(b'escaped', {server.getsockname()!r}); print('sent')\n"
                     "    except OSError as e:\n        print('blocked', e.errno)\n")
        # bwrap brings the sandbox's own loopback up: a datagram may leave the socket, but only to it
        assert out.count("sent") + out.count("blocked") == 5, out
        time.sleep(0.05)
        with pytest.raises(BlockingIOError):
            server.recv(100)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:   # the host itself can
            client.sendto(b"host", server.getsockname())
            time.sleep(0.05)
            assert server.recv(100) == b"host"


def test_netlink_sees_no_host_interface():
    host = {name for _, name in socket.if_nameindex()}
    if host == {"lo"}:
        pytest.skip("this host has no interface besides lo: nothing the sandbox could see")
    # if_nameindex() asks the kernel over an AF_NETLINK route socket
    out = run_ok("import socket\nprint(sorted(n for _, n in socket.if_nameindex()))\n"
                 "print(open('/proc/net/dev').read())")
    names = eval(out.splitlines()[0])
    assert names in ([], ["lo"]), out
    for name in host - {"lo"}:
        assert name not in out


def test_only_unix_inet_and_netlink_sockets_can_be_made():
    """AF_VSOCK (a VM's host) and the other families are not per network namespace: seccomp
    refuses them, and io_uring, which could make a socket past that filter."""
    out = run_ok("import ctypes, errno, socket\nmade = set()\nfor family in range(64):\n"
                 "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET, socket.SOCK_RAW):\n"
                 "        try:\n            socket.socket(family, kind).close(); made.add(family)\n"
                 "        except OSError:\n            pass\nprint(sorted(made))\n"
                 "try:\n    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM); print('VSOCK')\n"
                 "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
                 "libc = ctypes.CDLL(None, use_errno=True)\n"
                 "print(libc.syscall(425, 8, ctypes.create_string_buffer(120)), errno.errorcode[ctypes.get_errno()])\n")
    made, vsock, io_uring = out.splitlines()
    assert set(eval(made)) <= {socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK}, out
    assert (vsock, io_uring) == ("EAFNOSUPPORT", "-1 ENOSYS"), out


# ---------------------------------------------------------------- host files
def test_host_tmp_run_and_shm_are_not_visible():
    name = f"glmforge-sandbox-marker-{uuid.uuid4().hex}"
    markers = [Path(d) / name for d in ("/tmp", "/dev/shm", "/run", "/var/tmp") if os.path.isdir(d)]
    for m in markers:
        m.write_text("host secret")
    try:
        code = ("import os\nfor d in ['/tmp', '/dev/shm', '/run', '/var/run', '/var/tmp']:\n"
                "    try: print(d, sorted(os.listdir(d)))\n    except OSError as e: print(d, 'absent', e.errno)\n"
                f"for p in {[str(m) for m in markers]!r}:\n"
                "    try: print('READ', p, open(p).read())\n    except OSError as e: print('refused', p, e.errno)\n")
        out = run_ok(code)
        assert "READ" not in out and "host secret" not in out, out
        listings = [line for line in out.splitlines() if line.startswith("/")]
        assert len(listings) == 5 and not any(name in line for line in listings), out
    finally:
        for m in markers:
            m.unlink()


def test_repo_venv_and_host_folders_are_not_visible():
    secret_paths = [REPO / "samples/mbpp/mbpp.jsonl", REPO, Path(sys.executable), Path(sys.prefix),
                    Path(os.path.realpath(sys.executable)), Path.home(), "/work", "/root", "/home", "/opt",
                    "/srv", "/mnt"]
    code = (f"import os\nfor p in {[str(p) for p in secret_paths]!r}:\n"
            "    print('VISIBLE' if os.path.lexists(p) else 'absent', p)\n"
            f"try:\n    print('READ', open({str(REPO / 'samples/mbpp/mbpp.jsonl')!r}).read(80))\n"
            "except OSError as e:\n    print('refused', e.errno)\n")
    out = run_ok(code)
    assert "VISIBLE" not in out and "READ" not in out, out
    assert out.count("absent") == len(secret_paths)


def test_parent_secret_never_reaches_the_child():
    secret = uuid.uuid4().hex
    os.environ["GLMFORGE_TEST_SECRET"] = secret
    try:
        code = ("import os, glob\nprint(dict(os.environ))\n"
                "for f in glob.glob('/proc/*/environ'):\n"
                "    try: print(f, open(f, 'rb').read())\n"
                "    except OSError as e: print(f, e)\n")
        r = run_python(code)
        assert r.status == "ok", r
        assert "/proc/" in r.stdout        # it really looked
        assert secret not in r.stdout + r.stderr
        assert "GLMFORGE_TEST_SECRET" not in r.stdout
    finally:
        del os.environ["GLMFORGE_TEST_SECRET"]


def test_writing_outside_the_folder_fails():
    targets = [f"/tmp/{uuid.uuid4().hex}", str(REPO / f"sandbox-escape-{uuid.uuid4().hex}"),
               f"/dev/shm/{uuid.uuid4().hex}", f"/var/tmp/{uuid.uuid4().hex}", f"/{uuid.uuid4().hex}",
               f"/usr/{uuid.uuid4().hex}", f"/etc/{uuid.uuid4().hex}"]
    code = "\n".join(f"try:\n    open({t!r}, 'w').write('x'); print('WROTE')\nexcept OSError as e:\n"
                     f"    print('refused', e.errno)" for t in targets)
    r = run_python(code + "\nopen('inside.txt', 'w').write('ok'); print(open('inside.txt').read())")
    assert r.status == "ok", r
    assert r.stdout.count("refused") == len(targets) and "WROTE" not in r.stdout
    assert r.stdout.rstrip().endswith("ok")
    for t in targets:
        assert not os.path.exists(t), t


# ---------------------------------------------------------------- processes and limits
def test_fork_bomb_is_bounded_and_leaves_nothing():
    if not isolation()["private_uid"]:
        pytest.skip("not root: no private uid per run, so RLIMIT_NPROC cannot bound a fork bomb")
    marker = f"fork-bomb-{uuid.uuid4().hex}"
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            n = 0\n            continue\n        n += 1\n"
            "except OSError as e:\n    print('refused', e.errno, flush=True)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    r = run_command([isolation()["python"], "-I", "main.py", marker], SandboxLimits(wall_s=3, max_processes=16),
                    files={"main.py": code})
    assert time.monotonic() - t0 < 10
    assert r.status == "timeout", r
    assert "refused" in r.stdout
    assert r.stdout.count("refused") <= 16         # at most max_processes processes ever ran
    assert processes_with(marker) == []


# Double fork + setsid + ignored SIGTERM/SIGHUP, stdio closed so the run's pipes do not wait for it.
_DAEMON = ("import os, signal, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
           "        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT): signal.signal(s, signal.SIG_IGN)\n"
           "        null = os.open(os.devnull, os.O_RDWR)\n        for fd in (0, 1, 2): os.dup2(null, fd)\n"
           "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
           "    os._exit(0)\nos.wait()\nprint('parent done', flush=True)\n")


@pytest.mark.parametrize("wait", [False, True])
def test_a_detached_process_does_not_outlive_the_run(wait):
    """`wait`: the run lasts until its wall limit instead of returning once its main process exits."""
    marker = f"daemon-{uuid.uuid4().hex}"
    code = _DAEMON.format(marker=marker) + ("time.sleep(60)\n" if wait else "")
    t0 = time.monotonic()
    r = run_python(code, SandboxLimits(wall_s=2))
    assert r.stdout == "parent done\n", r
    assert r.status == ("timeout" if wait else "ok"), r
    assert processes_with(marker) == [], "a sandboxed process outlived run_python"
    assert time.monotonic() - t0 < 8


def test_wall_clock_limit_kills_quickly():
    t0 = time.monotonic()
    r = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", SandboxLimits(wall_s=1.0))
    assert time.monotonic() - t0 < 5
    assert r.status == "timeout" and r.returncode is None
    assert r.stdout == "start\n"            # output up to the kill is kept
    assert 1.0 <= r.wall_s < 4


def test_cpu_limit():
    r = run_python("while True: pass", SandboxLimits(wall_s=20, cpu_s=1))
    assert r.status == "timeout" and r.returncode == -signal.SIGXCPU, r
    assert r.wall_s < 15


def test_memory_cap():
    small = run_python("x = bytearray(50 * 2**20); print(len(x))", SandboxLimits(memory_mb=256))
    assert small.status == "ok", small                 # the cap, not the code, stops the big one
    r = run_python("x = bytearray(2 * 2**30)", SandboxLimits(memory_mb=256))
    assert r.status == "memory" and "MemoryError" in r.stderr, r


def test_output_is_truncated():
    r = run_python("import sys\nsys.stdout.write('x' * 1_000_000)\nsys.stderr.write('y' * 300_000)")
    assert r.status == "ok"
    assert r.stdout.startswith("x" * OUTPUT_LIMIT) and len(r.stdout) < OUTPUT_LIMIT + 100
    assert f"{1_000_000 - OUTPUT_LIMIT} more bytes truncated" in r.stdout
    assert r.stderr.startswith("y" * OUTPUT_LIMIT) and f"{300_000 - OUTPUT_LIMIT} more bytes" in r.stderr


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="relative path"):
        run_python("print(1)", files={"../escape.txt": "x"})
    with pytest.raises(ValueError, match="main.py"):
        run_python("print(1)", files={"main.py": "x"})
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="sandbox PATH"):
        run_command(["no-such-program-xyz"])
    with pytest.raises(ValueError, match="outside /usr"):
        run_command([sys.executable, "-c", "pass"])          # the venv's python is not in the sandbox


def test_installed_bwrap_works():
    iso = isolation()
    assert iso["tool"] == "bwrap" and not iso["problem"], iso
    assert iso["bwrap_version"] and iso["python"] == "/usr/bin/python3"
    assert all(iso[k] for k in ("network_namespace", "pid_namespace", "mount_namespace", "readonly_filesystem"))
    assert not any(p in ("/work", "/root", "/home", "/tmp", "/run", "/opt") for p in iso["host_paths_visible"])
    assert require_isolation(allow_weak=False) is iso


def test_no_descriptor_of_the_parent_is_inherited():
    r = run_python("import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')))")
    assert r.stdout.strip() in ("[0, 1, 2]", "[0, 1, 2, 3]"), r      # 3: listdir's own


# ---------------------------------------------------------------- without bwrap
@pytest.fixture
def no_bwrap(monkeypatch):
    """This machine as one without bubblewrap: isolation() says so, weak isolation not yet allowed."""
    report = {**isolation(), "tool": "none", "problem": "bwrap not found on " + TOOL_PATH}
    monkeypatch.setattr(sandbox, "isolation", lambda: report)
    monkeypatch.setenv(ALLOW_WEAK_ENV, "0")         # restored (unset) after the test
    return report


def test_without_bwrap_run_refuses_unless_weak_isolation_is_allowed(no_bwrap):
    setting = "rl_reasoning.sandbox_allow_weak_isolation"
    with pytest.raises(SandboxError, match=f"^bwrap not found on .*install Debian's bubblewrap.*{setting}: true"):
        require_isolation(allow_weak=False, setting=setting)
    with pytest.raises(SandboxError, match="bwrap not found"):
        run_python("print(1)")
    with pytest.raises(SandboxError, match="bwrap not found"):
        run_command(["true"])
    require_isolation(allow_weak=True, setting=setting)
    assert os.environ[ALLOW_WEAK_ENV] == "1"         # the reward and rollout workers inherit it
    r = run_python("import os\nprint(sorted(os.environ))\nprint(os.getuid())")
    assert r.status == "ok", r
    env, uid = r.stdout.splitlines()
    assert env == "['HOME', 'LANG', 'PATH', 'TMPDIR']", r
    if isolation()["private_uid"]:
        assert UID_BASE <= int(uid) < UID_BASE + UID_RANGE
    assert run_python("x = bytearray(2 * 2**30)", SandboxLimits(memory_mb=256)).status == "memory"


def test_weak_isolation_still_ends_a_detached_process(no_bwrap):
    if not isolation()["private_uid"]:
        pytest.skip("not root: without bwrap nothing but the process group bounds a run")
    require_isolation(allow_weak=True)
    marker = f"weak-daemon-{uuid.uuid4().hex}"
    r = run_python(_DAEMON.format(marker=marker), SandboxLimits(wall_s=2))
    assert r.stdout == "parent done\n", r
    assert processes_with(marker) == []


def test_read_only_folders_are_seen_but_not_written_and_a_tree_is_copied(tmp_path):
    """A prepared folder (a virtualenv) mounted with read_only: readable at its path, not
    writable, nothing outside it added; `tree` is copied into the working folder, whose changes
    never reach the original; and folders that must not be mounted are refused."""
    shared = Path("/tmp") / f"glmforge-ro-{uuid.uuid4().hex}"
    shared.mkdir(mode=0o755)
    try:
        (shared / "data.txt").write_text("mounted\n")
        os.chmod(shared / "data.txt", 0o644)
        tree = tmp_path / "tree"
        tree.mkdir()
        (tree / "f.txt").write_text("copied\n")
        code = ("import os\n"
                f"print(open({str(shared / 'data.txt')!r}).read().strip(), open('f.txt').read().strip())\n"
                "open('f.txt', 'w').write('changed')\n"
                "try:\n"
                f"    open({str(shared / 'new.txt')!r}, 'w').write('x')\n"
                "    print('wrote')\n"
                "except OSError as e:\n"
                "    print('refused', e.errno)\n")
        r = sandbox.run_command([sandbox.SYSTEM_PYTHON, "-I", "-c", code], SandboxLimits(wall_s=10), tree=tree,
                                read_only=(str(shared),))
        assert r.status == "ok", r.stderr
        assert r.stdout.split() == ["mounted", "copied", "refused", "30"]          # EROFS
        assert not (shared / "new.txt").exists() and (tree / "f.txt").read_text() == "copied\n"
    finally:
        shutil.rmtree(shared)
    for bad in ("/", "/etc", str(Path.home())):
        with pytest.raises(ValueError, match="read_only"):
            sandbox.run_command(["true"], read_only=(bad,))
