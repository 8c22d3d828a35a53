"""Python children forked from a warm interpreter instead of started from scratch, for the test suite.

Why: a broker's start costs ~0.7 CPU-s, of which ~0.45 is importing its modules and loading its compiled
kernels, and the tests start ~460 brokers. A zygote (Android's word; Python's multiprocessing calls it a
fork server) is a process that has done that once and forks a child per request; the child then runs the
module as ``python -m`` would (``runpy``, ``__main__``), with the requested arguments, environment, working
directory and log file. It is a real process with its own pid: signals, SIGSTOP, kill -9 and its exit
reach it as they reach a process started with ``subprocess``. The module may define ``preload()``, which
the zygote calls before serving (``metaq_broker.server.main`` imports the broker and loads its kernels).

What differs from an exec: the interpreter's start-up state is the zygote's. Variables read while
importing (``GRPC_VERBOSITY``, numba's and Arrow's) take the zygote's values, so one zygote serves the
requests whose such variables are equal (``IMPORT_PREFIXES``) and a child started with others gets its
own zygote. Before forking the zygote must have one thread only: it starts with OpenBLAS and pyarrow's
jemalloc without helper threads (``_SINGLE_THREADED``; a broker uses neither) and refuses to serve
otherwise, as it does when the module does not import; ``spawn`` then returns None and the caller execs.

Protocol (one Unix connection per child): the request as one JSON line; the answer the child's pid, then,
when it ends, its exit code as ``subprocess`` gives it (negative: the signal). A connection that closes
while its child runs kills the child; the zygote's stdin closing (its parent gone) kills them all, and a
child dies with its zygote (``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import logging
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger(__name__)

IMPORT_PREFIXES = ("PYTHON", "GRPC_", "NUMBA_", "ARROW_", "JE_ARROW", "OPENBLAS", "OMP_", "MIMALLOC", "LD_")
_SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}
CLONE_NEWNET = 0x40000000
_enabled = False
_lock = threading.Lock()
_zygotes: dict = {}  # (module, import-time environment) -> _Zygote (None: it could not start)


def enable() -> None:
    """Let ``spawn`` fork children in this process (the test suite's conftest calls it)."""
    global _enabled
    _enabled = True


def spawn(module: str, args: Sequence[str], env: dict, log_path: Path, cwd=None,
          own_session: bool = False, netns: Optional[str] = None) -> Optional["ForkedProcess"]:
    """``python -m module *args`` forked from a zygote, stdout and stderr appended to ``log_path``, in the
    named network namespace ``netns`` if one is given (``ip netns``; the child joins it before it runs
    anything); None where zygotes are not enabled or none can serve (the caller then starts the process
    itself)."""
    if not _enabled:
        return None
    key = (module, tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_PREFIXES))))
    with _lock:
        if key not in _zygotes:
            _zygotes[key] = _Zygote.start(module, env)
        zygote = _zygotes[key]
        if zygote is None:
            return None
    try:
        return zygote.spawn(list(args), env, log_path, cwd, own_session, netns)
    except OSError as e:  # the zygote died: later requests exec too
        log.warning("the %s zygote cannot fork (%s); starting processes without it", module, e)
        with _lock:
            _zygotes[key] = None
        return None


@atexit.register
def shutdown() -> None:
    """Stop every zygote (their children with them)."""
    with _lock:
        zygotes = [z for z in _zygotes.values() if z is not None]
        _zygotes.clear()
    for z in zygotes:
        z.stop()


class _Zygote:
    def __init__(self, proc: subprocess.Popen, path: str):
        self.proc, self.path = proc, path

    @classmethod
    def start(cls, module: str, env: dict, timeout: float = 60.0) -> Optional["_Zygote"]:
        directory = Path(tempfile.mkdtemp(prefix="metaq-zygote-"))
        with open(directory / "zygote.log", "wb") as err:  # a file: a pipe nobody reads could fill up
            proc = subprocess.Popen([sys.executable, "-m", __name__, module, str(directory / "socket")],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                    env={**env, **_SINGLE_THREADED, "PYTHONUNBUFFERED": "1"})
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            line = proc.stdout.readline() if sel.select(timeout) else b""
        if line.strip() == b"ready":
            return cls(proc, str(directory / "socket"))
        proc.kill()
        proc.wait()
        log.warning("no zygote for %s (starting processes without it): %s", module,
                    (directory / "zygote.log").read_text(errors="replace")[-2000:] or f"not ready in {timeout:g}s")
        shutil.rmtree(directory, ignore_errors=True)
        return None

    def spawn(self, args: list, env: dict, log_path: Path, cwd, own_session: bool,
              netns: Optional[str] = None) -> "ForkedProcess":
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            conn.sendall(json.dumps({"args": args, "env": env, "log": str(log_path),
                                     "cwd": None if cwd is None else str(cwd),
                                     "own_session": own_session, "netns": netns}).encode() + b"\n")
            line, rest = _read_line(conn)
            if line is None:
                raise ConnectionError("the zygote closed the connection")
            return ForkedProcess(int(line), args, conn, rest)  # rest: the exit code may follow at once
        except BaseException:
            conn.close()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the zygote kills its children and exits
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        shutil.rmtree(Path(self.path).parent, ignore_errors=True)


class ForkedProcess:
    """A zygote's child, with the part of ``subprocess.Popen``'s interface that callers use: ``pid``,
    ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, pid: int, args: list, conn: socket.socket, received: bytes = b""):
        self.pid, self.args, self.returncode = pid, args, None
        self._conn, self._received = conn, received  # what came after the pid's line
        self._lock = threading.Lock()  # one reader of the exit code at a time (``poll`` does not wait for it)

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                self._read_exit(0)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            try:
                if not self._read_exit(timeout):
                    raise subprocess.TimeoutExpired(self.args, timeout)
            finally:
                self._lock.release()
        return self.returncode

    def _read_exit(self, timeout: Optional[float]) -> bool:
        """(Under ``_lock``.) Wait up to ``timeout`` for the exit code; False: still running."""
        if self.returncode is not None:
            return True
        self._conn.settimeout(timeout)
        try:
            while not self._received.endswith(b"\n"):  # the exit code is the last line sent
                chunk = self._conn.recv(64)
                if not chunk:  # the zygote is gone (it killed its children as it went)
                    break
                self._received += chunk
        except (TimeoutError, BlockingIOError):
            return False
        self.returncode = int(self._received) if self._received.strip() else -signal.SIGKILL
        self._conn.close()
        return True

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# -- the zygote itself ----------------------------------------------------------------------------------

def _serve(module: str, path: str):
    """Serve fork requests until stdin closes; returns (in a child only) what the child is to run."""
    target = importlib.import_module(module)
    if hasattr(target, "preload"):
        target.preload()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        sys.stderr.write(f"{threads} threads after importing {module}: forking would copy a process whose other "
                         f"threads hold locks\n")
        sys.exit(2)
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.buffer, selectors.EVENT_READ, "parent")
    children: dict = {}  # pid -> its connection
    zygote = os.getpid()
    sys.stdout.write("ready\n")
    sys.stdout.flush()

    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "request":
                conn = key.fileobj
                sel.unregister(conn)
                request, _ = _read_line(conn)
                if request is None:
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:  # the child keeps none of the zygote's sockets
                    for s in {conn, wake_w, *children.values(), *(k.fileobj for k in sel.get_map().values()
                                                                  if k.fileobj is not sys.stdin.buffer)}:
                        s.close()
                    sel.close()
                    return _become(module, json.loads(request), zygote)
                children[pid] = conn
                conn.sendall(b"%d\n" % pid)
                sel.register(conn, selectors.EVENT_READ, ("running", pid))
            elif key.data == "child":
                try:
                    wake_r.recv(4096)
                except BlockingIOError:
                    pass
                _reap(children, sel)
            elif key.data == "parent":
                if not sys.stdin.buffer.read1(4096):
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    for pid in list(children):
                        os.waitpid(pid, 0)
                    sys.exit(0)
            else:  # a caller's connection readable while its child runs: the caller went away
                _, pid = key.data
                sel.unregister(key.fileobj)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _read_line(conn: socket.socket) -> tuple:
    """(the first line, without its newline, or None if the connection closed first; what came after it)."""
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None, data
        data += chunk
    line, rest = data.split(b"\n", 1)
    return line, rest


def _reap(children: dict, sel) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                sel.unregister(conn)
            except KeyError:
                pass
            try:
                conn.sendall(b"%d\n" % os.waitstatus_to_exitcode(status))
            except OSError:
                pass
            conn.close()


def _become(module: str, request: dict, zygote: int):
    """In the child: the process ``python -m module`` would be, but for the interpreter's start."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it dies with the zygote
    if os.getppid() != zygote:  # it died before the line above
        os._exit(1)
    if request["own_session"]:
        os.setsid()
    out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    if request.get("netns"):  # as ``ip netns exec`` does for the network (the one namespace a broker needs)
        try:
            fd = os.open(f"/run/netns/{request['netns']}", os.O_RDONLY)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            os.close(fd)
        except OSError as e:  # in its log, as ``ip netns exec`` would say it
            os.write(2, f"cannot enter network namespace {request['netns']!r}: {e}\n".encode())
            os._exit(1)
    if request["cwd"]:
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    return module, request["args"]


def _run(module: str, args: list) -> None:
    """Run ``module`` as ``__main__``, then end as the interpreter would, but without tearing down its
    modules: the zygote's are many (numba's, Arrow's), and their teardown took ~0.3 s of every stop."""
    sys.argv = [module, *args]
    sys.modules.pop(module, None)  # runpy warns when the module it runs as ``__main__`` is imported already
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            sys.stderr.write(f"{e.code}\n")
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():  # the interpreter waits for non-daemon threads, then runs atexit
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code < 0:  # killed by the signal, as an uncaught KeyboardInterrupt ends CPython
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def main() -> None:
    _run(*_serve(sys.argv[1], sys.argv[2]))


if __name__ == "__main__":
    main()
