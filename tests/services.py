"""Which real services the tests may use: Docker, Slurm, PostgreSQL, Chromium.

``infra/services.sh up`` starts them and records the outcome in
``$OPENLAB_INFRA_STATE/services.env`` (default ``/var/tmp/openlab-infra/services.env``)::

    OPENLAB_TEST_DOCKER=1                    # or 0, with OPENLAB_TEST_DOCKER_REASON=...
    OPENLAB_TEST_DOCKER_BASE_IMAGE=openlab/python-base:bookworm
    OPENLAB_TEST_DOCKER_JOB_IMAGE=openlab/job:latest
    OPENLAB_TEST_SLURM=1
    SLURM_CONF=/var/tmp/openlab-infra/slurm/etc/slurm.conf
    OPENLAB_TEST_POSTGRES=1
    OPENLAB_TEST_POSTGRES_URL=postgresql+psycopg://openlab:openlab@127.0.0.1:5432/openlab_test
    OPENLAB_TEST_CHROMIUM=/usr/bin/chromium

Environment variables of the same names override the file. When neither says anything about a
service, the helpers probe it live (a developer may have started it by hand).

Rule: a service that is not available makes the test SKIP with the reason, except under ``CI=true``
where it FAILS (a CI run must not go green by skipping everything).

API (each ``require_*`` returns something useful or skips/fails):
    require_docker() -> docker.DockerClient      docker_image(kind="base"|"job") -> str
    python3_only_image() -> str (a lab's image with python3 and no plain python, made from the base)
    require_slurm() -> str (SLURM_CONF path; also put into os.environ)
    require_slurm_accounting() -> str (the same, and sacct answers: slurmdbd is up)
    postgres_url() -> str (SQLAlchemy URL, role may CREATE DATABASE)
    require_postgres() -> str (same as postgres_url)
    require_chromium() -> str (browser executable path)
    unavailable(reason) -> NoReturn; in_ci() -> bool; setting(key) -> str | None; services_env() -> dict
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, NoReturn

import pytest

DEFAULT_STATE = "/var/tmp/openlab-infra"

#: The test now running (tests/conftest.py sets it), so a helper can check the test's marks.
current_test: pytest.Item | None = None


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip with ``reason`` locally; fail under CI=true."""
    if in_ci():
        pytest.fail(f"CI=true but a required service is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


def state_dir() -> Path:
    return Path(os.environ.get("OPENLAB_INFRA_STATE") or DEFAULT_STATE)


def env_file() -> Path:
    return state_dir() / "services.env"


def parse_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (optionally ``export``-prefixed, optionally quoted); comments ignored."""
    values: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return values
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        if line.startswith("export "):
            line = line[len("export ") :]
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def services_env() -> dict[str, str]:
    """The contents of services.env (empty when infra/services.sh has not run)."""
    return parse_env_file(env_file())


def setting(key: str) -> str | None:
    """The environment's value for ``key``, else services.env's, else None."""
    if key in os.environ:
        return os.environ[key]
    return services_env().get(key)


def _declared(name: str) -> tuple[bool | None, str]:
    """(up?, reason) as recorded for OPENLAB_TEST_<NAME>; up is None when nothing is recorded."""
    value = setting(f"OPENLAB_TEST_{name}")
    reason = setting(f"OPENLAB_TEST_{name}_REASON") or ""
    if value is None or value == "":
        return None, reason
    return value not in ("0", "false", "no"), reason


def _down_reason(service: str, reason: str) -> str:
    where = f" (recorded in {env_file()})" if env_file().exists() else ""
    return f"{service} is not up: {reason or 'marked unavailable'}{where}; start it with: sudo infra/services.sh up"


# --- docker -------------------------------------------------------------------------------------


@functools.cache
def _docker_probe() -> tuple[Any, str]:
    try:
        import docker
    except ImportError as exc:
        return None, f"the docker SDK is not installed ({exc})"
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        return None, f"docker engine not reachable: {exc}"
    return client, ""


def require_docker() -> Any:
    """A pinged ``docker.DockerClient``; skips/fails when the engine is not up."""
    up, reason = _declared("DOCKER")
    if up is False:
        unavailable(_down_reason("docker", reason))
    client, problem = _docker_probe()
    if client is None:
        unavailable(problem + ("" if up is None else " (services.env says it is up: was it stopped?)"))
    return client


def docker_image(kind: str = "base") -> str:
    """The locally built test image: ``kind="base"`` (openlab/python-base:bookworm, small, python only)
    or ``kind="job"`` (openlab/job:latest, the project installed). Skips/fails when it is missing."""
    key = {"base": "OPENLAB_TEST_DOCKER_BASE_IMAGE", "job": "OPENLAB_TEST_DOCKER_JOB_IMAGE"}[kind]
    default = {"base": "openlab/python-base:bookworm", "job": "openlab/job:latest"}[kind]
    client = require_docker()
    image = setting(key)
    if image == "" and setting(f"{key}_REASON"):
        unavailable(f"docker {kind} image was not built: {setting(f'{key}_REASON')}")
    image = image or default
    try:
        client.images.get(image)
    except Exception:  # noqa: BLE001
        script = "build-base-image.sh" if kind == "base" else "build-job-image.sh"
        unavailable(f"docker image {image} does not exist; build it with: sudo infra/docker/{script}")
    return image


def python3_only_image() -> str:
    """An image as a lab builds on Debian's or Ubuntu's ``python3`` package: ``python3`` and no plain
    ``python`` (the base image less the ``python-is-python3`` link), made from the base image once."""
    import io

    import docker.errors

    base, client = docker_image("base"), require_docker()
    tag = "openlab/python3-only:test"
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        dockerfile = f"FROM {base}\nRUN rm /usr/bin/python && python3 -c 'print(1)'\n"
        client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True, network_mode="none")
    return tag


# --- slurm --------------------------------------------------------------------------------------


def require_slurm() -> str:
    """SLURM_CONF of the running test cluster (also exported into os.environ for the CLI tools and
    subprocesses); skips/fails when slurmctld does not answer. A test must carry the ``slurm`` mark
    to use the cluster: the mark makes xdist workers take turns on it (tests/conftest.py)."""
    up, reason = _declared("SLURM")
    if up is False:
        unavailable(_down_reason("slurm", reason))
    if current_test is not None and current_test.get_closest_marker("slurm") is None:
        pytest.fail(
            f"{current_test.nodeid} uses the Slurm cluster without @pytest.mark.slurm: mark it, so that it "
            "never shares the cluster with another worker's test",
            pytrace=False,
        )
    conf = setting("SLURM_CONF")
    if not conf:
        default = state_dir() / "slurm" / "etc" / "slurm.conf"
        conf = str(default) if default.exists() else ""
    if conf:
        os.environ["SLURM_CONF"] = conf
    os.environ.pop("SLURM_JWT", None)  # the CLI switches to JWT auth when it is set
    if not shutil.which("scontrol"):
        unavailable("slurm is not installed (scontrol not found); run: sudo infra/services.sh up")
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15, check=False)
    except subprocess.TimeoutExpired:
        unavailable("slurm: `scontrol ping` timed out")
    if "UP" not in out.stdout:
        unavailable(f"slurmctld not reachable (SLURM_CONF={conf or 'default'}): {(out.stdout + out.stderr).strip()}")
    return conf


def require_slurm_accounting() -> str:
    """:func:`require_slurm`, plus slurmdbd accounting (sacct), which ``infra/services.sh up`` starts
    unless ``OPENLAB_SLURM_ACCOUNTING=0``."""
    conf = require_slurm()
    up, reason = _declared("SLURM_ACCOUNTING")
    if up is False:
        unavailable(f"slurm accounting is not running: {reason or 'infra/services.sh up started none'}")
    out = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True, timeout=30, check=False)
    if out.returncode != 0:
        unavailable(f"slurm accounting: sacct fails: {(out.stderr or out.stdout).strip()}")
    return conf


# --- postgres -----------------------------------------------------------------------------------


@functools.cache
def _postgres_probe(url: str) -> str:
    """'' when a connection works, else the reason."""
    try:
        import psycopg
    except ImportError as exc:
        return f"psycopg is not installed ({exc})"
    scheme, sep, rest = url.partition("://")
    conninfo = "postgresql" + sep + rest if scheme.startswith("postgresql+") else url
    try:
        with psycopg.connect(conninfo, connect_timeout=5) as conn:
            conn.execute("select 1")
    except Exception as exc:  # noqa: BLE001
        return f"cannot connect to {url}: {exc}".strip()
    return ""


def postgres_url() -> str:
    """SQLAlchemy URL (``postgresql+psycopg://...``) of the test database; its role may create databases."""
    up, reason = _declared("POSTGRES")
    url = setting("OPENLAB_TEST_POSTGRES_URL") or ""
    if up is False or (not url and up is not None):
        unavailable(_down_reason("postgres", reason))
    if not url:
        unavailable(
            "postgres: OPENLAB_TEST_POSTGRES_URL is not set and services.env does not exist; "
            "run: sudo infra/services.sh up"
        )
    problem = _postgres_probe(url)
    if problem:
        unavailable(f"postgres: {problem}")
    return url


require_postgres = postgres_url


# --- chromium -----------------------------------------------------------------------------------


def require_chromium() -> str:
    """Path of the Chromium executable (Debian's /usr/bin/chromium) for playwright's executable_path."""
    return _require_program("chromium", "OPENLAB_TEST_CHROMIUM", "/usr/bin/chromium", "infra/browser/install.sh")


# --- graphviz -----------------------------------------------------------------------------------


def require_graphviz() -> str:
    """Path of graphviz's ``dot``, which renders what ``openlab lineage trace --dot`` prints."""
    return _require_program("dot", "OPENLAB_TEST_GRAPHVIZ", "/usr/bin/dot", "infra/graphviz/install.sh", "graphviz")


def _require_program(program: str, key: str, default: str, installer: str, service: str | None = None) -> str:
    """A program `infra/services.sh up` installs (not a daemon): where the env file says, on the
    PATH, or at Debian's path; else unavailable (skip, or fail under CI) naming its installer."""
    value = setting(key)
    if value in ("0", "false", "no"):
        unavailable(_down_reason(service or program, setting(f"{key}_REASON") or ""))
    candidates = [value] if value and value != "1" else []
    candidates += [p for p in (shutil.which(program), default) if p]
    for path in candidates:
        if Path(path).is_file() and os.access(path, os.X_OK):
            return path
    unavailable(f"{service or program} is not installed; run: sudo {installer}")
