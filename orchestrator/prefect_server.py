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
  first and openlab stops the runner before the API it reports to.
"""

from __future__ import annotations

import contextlib
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


class PrefectServerError(OpenlabError):
    """The Prefect server could not be started or did not become healthy."""


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether something already accepts connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


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
    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _log_file: IO[bytes] | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_settings(
        cls, settings: Settings | None = None, *, host: str | None = None, port: int | None = None
    ) -> PrefectServer:
        """A server configured from ``[prefect]`` (host, port, database_url) and ``$OPENLAB_HOME``."""
        settings = settings or load_settings()
        section = settings.section("prefect")
        home = Path(section.get("home") or settings.home / "prefect").expanduser()
        raw = port or section.get("port") or DEFAULT_PORT
        where = "--port" if port else "[prefect] port"
        try:
            number = int(raw)
        except (TypeError, ValueError):
            number = -1
        if not 1 <= number <= 65535:  # a port the socket layer would refuse with a traceback
            raise ConfigError(f"{where} {raw!r}: a port is a whole number from 1 to 65535 (default {DEFAULT_PORT})")
        return cls(
            home=home,
            host=host or str(section.get("host") or DEFAULT_HOST),
            port=number,
            database_url=prefect_database_url(settings, home),
        )

    # -- addresses ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        shown = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host  # noqa: S104 - display only
        return f"http://{shown}:{self.port}"

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
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = self.database_url or sqlite
        # The server must not think it is a client of some other server.
        env.pop("PREFECT_API_URL", None)
        env.pop("PREFECT_API_KEY", None)
        if self.host in ("0.0.0.0", "::", "") and not env.get("PREFECT_UI_API_URL"):  # noqa: S104 - a check
            # Listening on every interface is for browsers on other machines; the UI would tell them
            # to ask http://0.0.0.0:PORT/api, which is their own machine. This one's name instead
            # (PREFECT_UI_API_URL set by hand wins: a proxy, a name the machine does not know).
            env["PREFECT_UI_API_URL"] = f"http://{socket.getfqdn()}:{self.port}/api"
        env.update(self.extra_env)
        return env

    def client_env(self) -> dict[str, str]:
        """What a client process needs to talk to this server, telemetry off."""
        return {"PREFECT_API_URL": self.api_url, "DO_NOT_TRACK": "1", "PREFECT_HOME": str(self.home)}

    # -- life cycle ----------------------------------------------------------------------
    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> PrefectServer:
        """Start the server and wait until ``/api/health`` answers; raise with the log tail if not."""
        if self.process is not None:
            return self
        if port_in_use(self.host if self.host not in ("0.0.0.0", "") else DEFAULT_HOST, self.port):  # noqa: S104
            raise PrefectServerError(
                f"port {self.port} is already in use: stop what listens there, or pick another with --port"
            )
        self.home.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path or self.home / "server.log"
        self.log_path = log_path
        self._log_file = log_path.open("ab")
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", self.host, "--port", str(self.port)]
        cmd.append("--analytics-off")
        self.process = subprocess.Popen(  # noqa: S603 - our own interpreter and fixed arguments
            cmd,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
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


@contextlib.contextmanager
def use_api(api_url: str) -> Iterator[None]:
    """Point this process's Prefect client at ``api_url`` (telemetry off) for the block.

    Prefect reads its settings once per context, so changing ``os.environ`` alone is not
    enough after ``import prefect``; both are set so child processes inherit the choice.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "DO_NOT_TRACK")}
    os.environ["PREFECT_API_URL"] = api_url
    os.environ["DO_NOT_TRACK"] = "1"
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
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
    "TELEMETRY_OFF",
    "free_port",
    "health_ok",
    "port_in_use",
    "prefect_database_url",
    "use_api",
]
