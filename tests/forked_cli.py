"""Run ``openlab`` commands as real child processes without paying Python's imports each time.

The suite runs the CLI several hundred times, and a command spent most of its time (1.3 s of CPU
on these two cores, where the whole suite is CPU-bound) importing SQLAlchemy, SQLModel, pydantic,
typer, rich, GitPython and the lineage models. :class:`ForkedCLI` keeps one Python (the
*template*) with those imported and, per command, forks it: the child takes the caller's pipes
as stdin/stdout/stderr, the caller's environment and working directory, and runs
``orchestrator.cli.main`` as ``python -m`` does (``runpy``), so the command is still a separate
process with its own exit status, output and environment. What is imported before the fork
(:data:`PRELOADED`) reads no environment and no settings when imported (openlab reads them when a
command asks); Prefect, which reads its settings when imported, is not among them.

The template answers on a Unix socket: the caller sends the command (JSON) with its three file
descriptors (``SCM_RIGHTS``); the template forks, sends back the child's pid, and later the
child's wait status. Used by the ``run_cli`` fixture; production code never knows.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

#: Imported once in the template: nothing that reads the environment or settings when imported.
PRELOADED = (
    "sqlalchemy",
    "sqlmodel",
    "pydantic",
    "typer",
    "rich.console",
    "rich.table",
    "yaml",
    "git",
    "orchestrator.lineage.models",
)

_TEMPLATE = r"""
import importlib, json, os, runpy, signal, socket, sys
for name in sys.argv[2:]:
    importlib.import_module(name)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters below are reaped by the kernel
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(64)
print("ready", flush=True)


def command(call, fds):
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(call["env"])
    os.chdir(call["cwd"])
    sys.argv = ["-m", *call["args"]]
    code = 0
    try:
        runpy.run_module("orchestrator.cli.main", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        import atexit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


import selectors
watch = selectors.DefaultSelector()
watch.register(server, selectors.EVENT_READ)
watch.register(sys.stdin, selectors.EVENT_READ)  # closed when the test process ends, however it ends
while True:
    ready = {key.fileobj for key, _ in watch.select()}
    if sys.stdin in ready:
        break
    conn, _ = server.accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if os.fork() == 0:  # a waiter per command, so commands run side by side as subprocesses do
        server.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        pid = os.fork()
        if pid == 0:
            conn.close()
            command(json.loads(message), fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"{status}\n".encode())
        os._exit(0)
    for fd in fds:
        os.close(fd)
    conn.close()
"""


class ForkedCLI:
    """A template Python; :meth:`run` is ``subprocess.run`` of ``python -m orchestrator.cli.main``."""

    def __init__(self) -> None:
        self.path = str(Path(tempfile.mkdtemp(prefix="openlab-cli-")) / "sock")
        self.process = subprocess.Popen(  # noqa: S603 - our interpreter, our script
            [sys.executable, "-c", _TEMPLATE, self.path, *PRELOADED],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the CLI template did not start")

    def run(
        self, args: list[str], *, env: dict[str, str], cwd: Path, timeout: float, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``openlab ARGS`` in a forked child; output captured as text, as ``subprocess.run``."""
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.path)
            payload = json.dumps({"args": list(args), "env": env, "cwd": str(cwd)}).encode()
            socket.send_fds(conn, [payload], [stdin_r, out_w, err_w])
            for fd in (stdin_r, out_w, err_w):
                os.close(fd)
            replies = conn.makefile("r")
            pid = int(replies.readline())
            if input:
                os.write(stdin_w, input.encode())
            os.close(stdin_w)
            out, err = _read_both(out_r, err_r, pid, timeout, [*args])
            status = int(replies.readline())
        return subprocess.CompletedProcess([*args], os.waitstatus_to_exitcode(status), out, err)

    def close(self) -> None:
        """End the template (commands still running go on, as subprocesses would)."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=10)
        Path(self.path).unlink(missing_ok=True)
        Path(self.path).parent.rmdir()


_shared: ForkedCLI | None = None


def run_cli(
    args: Sequence[str], *, env: dict[str, str], cwd: Path, timeout: float, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``openlab ARGS`` as ``subprocess.run`` runs it (captured, text), forked from this process's
    template (started at the first call). An environment that sets Python's own start-up variables
    (``PYTHON*``) differently gets a fresh interpreter: a fork would not read them."""
    global _shared
    if any(env.get(name) != os.environ.get(name) for name in {*env, *os.environ} if name.startswith("PYTHON")):
        return subprocess.run(  # noqa: S603 - our interpreter, the CLI's module
            [sys.executable, "-m", "orchestrator.cli.main", *args],
            input=input,
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=timeout,
        )
    if _shared is None or _shared.process.poll() is not None:
        _shared = ForkedCLI()
        atexit.register(_shared.close)
    return _shared.run(list(args), env=env, cwd=cwd, timeout=timeout, input=input)


def _read_both(out_r: int, err_r: int, pid: int, timeout: float, args: list[str]) -> tuple[str, str]:
    """Everything the child writes to stdout and stderr, until both close; killed past ``timeout``."""
    import selectors

    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                for fd in chunks:
                    os.close(fd)
                raise subprocess.TimeoutExpired(args, timeout)
            for key, _ in selector.select(left):
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
                    os.close(key.fd)
    return tuple(b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))  # type: ignore[return-value]
