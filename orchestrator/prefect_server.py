"""Start, stop and find a local Prefect server for openlab.

``openlab server`` and the test suite both need the same thing: a real
``prefect server start`` process with openlab's choices applied, a way to know when
it answers, and a clean stop. Keeping that in one place means the tests exercise
exactly what users run.

openlab's choices:

- state lives under ``$OPENLAB_HOME/prefect`` (``PREFECT_HOME``), SQLite by default;
  ``[prefect] database_url`` / ``OPENLAB_PREFECT__DATABASE_URL`` switches to PostgreSQL
  (``postgresql://`` is rewritten to the ``postgresql+asyncpg://`` driver Prefect uses);
- telemetry is off on both sides: ``PREFECT_SERVER_ANALYTICS_ENABLED=false`` for the
  server, ``DO_NOT_TRACK=1`` for clients;
- the server runs in its own process group, so Ctrl-C in a terminal reaches openlab
  first and openlab stops the runner before the API it reports to;
- flow results a client persists go to ``<prefect home>/storage`` (:func:`use_api`), beside the
  server's database, not to ``~/.prefect/storage``, unless the user set Prefect's local storage path;
- a server bound to its owner (``stop_with_parent``: ``openlab server``) gets SIGTERM from Linux when
  the owner dies, even by SIGKILL, and records itself (:data:`RECORD_NAME`), so one that survived anyway
  is recognised by the next start for the same home and stopped (:meth:`PrefectServer.stop_leftover`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from orchestrator.errors import ConfigError, OpenlabError
from orchestrator.lineage.leases import start_ticks
from orchestrator.settings import Settings, load_settings

#: Environment that turns Prefect's telemetry off for servers and clients alike.
TELEMETRY_OFF: dict[str, str] = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
}

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4200
#: Seconds to wait for /api/health; a cold SQLite start takes about 10 s on 2 cores.
DEFAULT_START_TIMEOUT = 90.0
#: The file, in the server's home, that names a server bound to its owner: its pid and start time, and
#: its owner's. Not ``server.pid``: ``make demo`` writes that one for a server it leaves running on purpose.
RECORD_NAME = "openlab-server.json"

#: Run as ``python -c`` in front of ``prefect server start``: ask Linux for SIGTERM when the parent
#: dies (``PR_SET_PDEATHSIG``, kept across ``execv``), give up if the parent is already gone, then
#: become the server (same pid). A wrapper rather than ``preexec_fn``, which is unsafe in a parent
#: with threads (Prefect's client has some).
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
    prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
os.execv(sys.argv[2], sys.argv[2:])
"""


class PrefectServerError(OpenlabError):
    """The Prefect server could not be started or did not become healthy."""


#: The addresses that mean "every interface" (IPv4's, IPv6's, unset), and what this machine reaches
#: such a server at.
EVERY_INTERFACE = {"0.0.0.0": DEFAULT_HOST, "": DEFAULT_HOST, "::": "::1"}  # noqa: S104 - names, not a bind


def _family(host: str) -> socket.AddressFamily:
    """IPv6 for an IPv6 address (``::1``), else IPv4: an AF_INET socket given ``::1`` raised
    "Address family for hostname not supported" out of ``openlab server --host ::1``."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets (``http://[::1]:4200``)."""
    return f"[{host}]" if ":" in host else host


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether something already accepts connections on ``host:port``."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        try:
            return sock.connect_ex((host, port)) == 0
        except OSError:  # a name this machine cannot resolve: nothing of ours listens there
            return False


def prefect_database_url(settings: Settings, prefect_home: Path) -> str:
    """The Prefect server's database: configured PostgreSQL, else SQLite under ``prefect_home``."""
    configured = settings.section("prefect").get("database_url")
    if not configured:
        return f"sqlite+aiosqlite:///{prefect_home / 'prefect.db'}"
    url = str(configured)
    for prefix in ("postgresql://", "postgres://", "postgresql+psycopg://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    return url


def prefect_home(settings: Settings) -> Path:
    """Where openlab keeps Prefect's state: ``[prefect] home``, else ``$OPENLAB_HOME/prefect``."""
    return Path(settings.section("prefect").get("home") or settings.home / "prefect").expanduser()


@dataclass(frozen=True)
class ServerRecord:
    """A running server bound to its owner (:data:`RECORD_NAME`): both named by pid and start time."""

    pid: int
    started: int
    owner: int
    owner_started: int
    port: int

    @classmethod
    def read(cls, home: Path) -> ServerRecord | None:
        try:
            data = json.loads((home / RECORD_NAME).read_text())
            return cls(**{name: int(data[name]) for name in ("pid", "started", "owner", "owner_started", "port")})
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, home: Path) -> None:
        (home / RECORD_NAME).write_text(json.dumps(self.__dict__) + "\n")

    def orphaned_server_of(self, home: Path) -> bool:
        """Whether the recorded server still runs, for ``home``, and its owner does not: left behind.

        Proven by the pid with its start time (not another process given the same pid) and its
        environment's ``PREFECT_HOME``; anything less and it is not ours to stop."""
        if start_ticks(self.pid) != self.started or start_ticks(self.owner) == self.owner_started:
            return False
        try:
            environ = Path(f"/proc/{self.pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False
        return f"PREFECT_HOME={home}".encode() in environ


def health_ok(api_url: str, timeout: float = 2.0) -> bool:
    """Whether ``<api_url>/health`` answers ``true``."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as resp:  # noqa: S310
            return resp.status == 200 and resp.read().strip() in (b"true", b'"true"')
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class PrefectServer:
    """One ``prefect server start`` subprocess with openlab's settings.

    Use it as a context manager, or call :meth:`start` and :meth:`stop`. ``ui_url`` is
    what people open; ``api_url`` is what clients put in ``PREFECT_API_URL``.
    """

    home: Path
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    database_url: str | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    #: Stop when the process that started it dies, even by SIGKILL (``openlab server``): Linux sends the
    #: server SIGTERM when the *thread* that started it ends, so start it from one that outlives it (the
    #: main thread). False (``make demo``, tests) leaves it to :meth:`stop`, or running on purpose.
    stop_with_parent: bool = False
    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _log_file: IO[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.host = self.host.strip("[]")  # `--host [::1]`, as a URL writes it: the address itself

    @classmethod
    def from_settings(
        cls,
        settings: Settings | None = None,
        *,
        host: str | None = None,
        port: int | None = None,
        stop_with_parent: bool = False,
    ) -> PrefectServer:
        """A server configured from ``[prefect]`` (host, port, database_url) and ``$OPENLAB_HOME``."""
        settings = settings or load_settings()
        section = settings.section("prefect")
        home = prefect_home(settings)
        # `--port 0` or `port = 0` was taken as unset (4200), `true` as port 1 and 4200.9 as 4200
        raw = port if port is not None else section.get("port", DEFAULT_PORT)
        where = "--port" if port is not None else "[prefect] port"
        number = -1
        if isinstance(raw, int) and not isinstance(raw, bool):
            number = raw
        elif isinstance(raw, str) and raw.strip().isdigit():
            number = int(raw.strip())
        if not 1 <= number <= 65535:  # a port the socket layer would refuse with a traceback
            raise ConfigError(f"{where} {raw!r}: a port is a whole number from 1 to 65535 (default {DEFAULT_PORT})")
        return cls(
            home=home,
            host=host or str(section.get("host") or DEFAULT_HOST),
            port=number,
            database_url=prefect_database_url(settings, home),
            stop_with_parent=stop_with_parent,
        )

    # -- addresses ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{url_host(EVERY_INTERFACE.get(self.host, self.host))}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    @property
    def ui_url(self) -> str:
        return self.url

    def env(self) -> dict[str, str]:
        """The server process's environment: ours plus Prefect's home, database and telemetry settings."""
        env = dict(os.environ)
        env.update(TELEMETRY_OFF)
        env["PREFECT_HOME"] = str(self.home)
        env["PREFECT_SERVER_API_HOST"] = self.host
        env["PREFECT_SERVER_API_PORT"] = str(self.port)
        sqlite = f"sqlite+aiosqlite:///{self.home / 'prefect.db'}"
        # The database is openlab's choice ([prefect] database_url, else a file in this home), under
        # Prefect 3's name and its older alias: a PREFECT_SERVER_DATABASE_CONNECTION_URL of the user's
        # shell (a team server's database) outranked the alias, and this server migrated and wrote it.
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = self.database_url or sqlite
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = self.database_url or sqlite
        # The server must not think it is a client of some other server.
        env.pop("PREFECT_API_URL", None)
        env.pop("PREFECT_API_KEY", None)
        if self.host in ("0.0.0.0", "::", "") and not env.get("PREFECT_UI_API_URL"):  # noqa: S104 - a check
            # Listening on every interface is for browsers on other machines; the UI would tell them
            # to ask http://0.0.0.0:PORT/api, which is their own machine. This one's name instead
            # (PREFECT_UI_API_URL set by hand wins: a proxy, a name the machine does not know).
            env["PREFECT_UI_API_URL"] = f"http://{socket.getfqdn()}:{self.port}/api"
        elif ":" in self.host and not env.get("PREFECT_UI_API_URL"):
            # an IPv6 address: Prefect writes http://::1:PORT/api for its UI, which no browser parses
            env["PREFECT_UI_API_URL"] = self.api_url
        env.update(self.extra_env)
        return env

    def client_env(self) -> dict[str, str]:
        """What a client process needs to talk to this server, telemetry off."""
        return {"PREFECT_API_URL": self.api_url, "DO_NOT_TRACK": "1", "PREFECT_HOME": str(self.home)}

    def command(self) -> list[str]:
        """The server's command line: ``prefect server start``, behind :data:`_DIE_WITH_PARENT` on Linux
        when ``stop_with_parent``."""
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", self.host, "--port", str(self.port)]
        cmd.append("--analytics-off")
        if self.stop_with_parent and sys.platform.startswith("linux"):
            return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]
        return cmd

    # -- life cycle ----------------------------------------------------------------------
    def stop_leftover(self, timeout: float = 20.0) -> ServerRecord | None:
        """Stop the server an earlier owner of this home left running when it died (SIGKILL, or a server
        that did not act on its parent-death signal), and return its record; ``None`` when there is none.

        Only a process proven to be that server (:meth:`ServerRecord.orphaned_server_of`) is signalled: a
        live owner's server, or a process that merely reuses the pid, is left alone."""
        record = ServerRecord.read(self.home)
        if record is None or not record.orphaned_server_of(self.home):
            return None
        # openlab started it in its own session, so its group is its pid: the group holds what it started
        try:
            group = os.getpgid(record.pid) == record.pid
        except ProcessLookupError:
            group = False
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                (os.killpg if group else os.kill)(record.pid, sig)
            deadline = time.monotonic() + wait
            while start_ticks(record.pid) == record.started and time.monotonic() < deadline:
                time.sleep(0.1)
            if start_ticks(record.pid) != record.started:
                break
        (self.home / RECORD_NAME).unlink(missing_ok=True)
        return record

    def check_port(self) -> None:
        """Raise :class:`PrefectServerError` when something already listens on this server's port."""
        if port_in_use(EVERY_INTERFACE.get(self.host, self.host), self.port):
            raise PrefectServerError(
                f"port {self.port} is already in use: stop what listens there, or pick another with --port"
            )

    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> PrefectServer:
        """Start the server and wait until ``/api/health`` answers; raise with the log tail if not."""
        if self.process is not None:
            return self
        self.check_port()
        self.home.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path or self.home / "server.log"
        self.log_path = log_path
        self._log_file = log_path.open("ab")
        self.process = subprocess.Popen(  # noqa: S603 - our own interpreter and fixed arguments
            self.command(),
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started, owner_started = start_ticks(self.process.pid), start_ticks(os.getpid())
        if self.stop_with_parent and started is not None and owner_started is not None:
            ServerRecord(self.process.pid, started, os.getpid(), owner_started, self.port).write(self.home)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self._close_log()
                self.process = None
                raise PrefectServerError(f"prefect server exited during start-up; last log lines:\n{tail}")
            if health_ok(self.api_url):
                return self
            time.sleep(0.25)
        tail = self.log_tail()
        self.stop()
        raise PrefectServerError(f"prefect server did not answer {self.api_url}/health within {timeout:g}s:\n{tail}")

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after ``timeout``."""
        proc, self.process = self.process, None
        if proc is not None:
            record = ServerRecord.read(self.home)
            if record is not None and record.pid == proc.pid:
                (self.home / RECORD_NAME).unlink(missing_ok=True)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self._close_log()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> PrefectServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


#: Local result storage paths :func:`use_api` chose, so a nested call knows them from the user's own.
_OUR_STORAGE: set[Path] = set()


@contextlib.contextmanager
def use_api(api_url: str, storage: Path | None = None) -> Iterator[None]:
    """Point this process's Prefect client at ``api_url`` (telemetry off) for the block, with flow
    results persisted under ``storage`` (default ``<prefect home>/storage``, :func:`prefect_home`).

    Prefect reads its settings once per context, so changing ``os.environ`` alone is not
    enough after ``import prefect``; both are set so child processes inherit the choice: the
    runner ``openlab server`` serves with and the flow-run processes it starts. Prefect's own
    default, ``$PREFECT_HOME/storage``, is ``~/.prefect/storage``: results of every run (a failed
    run's pickled exception) piled up there, outside ``$OPENLAB_HOME``, where openlab keeps the rest.
    A path the user set (``PREFECT_LOCAL_STORAGE_PATH``, a profile) is kept.
    """
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        get_current_settings,
        temporary_settings,
    )

    updates: dict[Any, Any] = {PREFECT_API_URL: api_url}
    names = ("PREFECT_API_URL", "DO_NOT_TRACK", "PREFECT_LOCAL_STORAGE_PATH")
    saved = {k: os.environ.get(k) for k in names}
    results = get_current_settings().results
    if "local_storage_path" not in results.model_fields_set or results.local_storage_path in _OUR_STORAGE:
        path = (storage or prefect_home(load_settings()) / "storage").resolve()
        _OUR_STORAGE.add(path)
        updates[PREFECT_RESULTS_LOCAL_STORAGE_PATH] = path
        os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(path)
    os.environ["PREFECT_API_URL"] = api_url
    os.environ["DO_NOT_TRACK"] = "1"
    try:
        with temporary_settings(updates=updates):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "PrefectServer",
    "PrefectServerError",
    "RECORD_NAME",
    "ServerRecord",
    "TELEMETRY_OFF",
    "free_port",
    "health_ok",
    "port_in_use",
    "prefect_database_url",
    "prefect_home",
    "use_api",
]
