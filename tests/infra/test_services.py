"""Small real checks of the services infra/services.sh starts (skip locally, fail under CI=true)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests import services

pytestmark = pytest.mark.timeout(300)


def test_docker_runs_a_container_without_network() -> None:
    client = services.require_docker()
    image = services.docker_image("base")
    out = client.containers.run(
        image,
        ["python", "-c", "import socket, sys; print('hello', sys.version_info[:2], socket.if_nameindex())"],
        network_mode="none",
        remove=True,
    )
    text = out.decode()
    assert text.startswith("hello (3, 11)"), text
    assert "'lo'" in text and "eth0" not in text, text  # --network none: loopback only


@pytest.mark.slurm
def test_slurm_batch_job_completes_and_its_output_is_readable(tmp_path: Path) -> None:
    services.require_slurm()
    out_dir = services.state_dir() / "slurm" / "jobs"
    target = out_dir if out_dir.is_dir() and os.access(out_dir, os.W_OK) else tmp_path
    marker = uuid.uuid4().hex
    output = target / f"test-{marker}-%j.out"
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--wait",
            "-J",
            "openlab-infra-test",
            "-t",
            "1",
            "-o",
            str(output),
            "--chdir",
            str(target),
            "--wrap",
            f"echo {marker}; echo host=$(hostname)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    path = Path(str(output).replace("%j", job_id))
    try:
        assert marker in path.read_text()
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True)
        assert "JobState=COMPLETED" in shown.stdout and "ExitCode=0:0" in shown.stdout, shown.stdout
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.slurm
def test_slurm_failed_job_reports_its_exit_code() -> None:
    services.require_slurm()
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--wait", "-t", "1", "-o", "/dev/null", "--wrap", "exit 3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    assert job_id, submitted.stderr
    deadline = time.monotonic() + 10
    while True:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True)
        if "JobState=FAILED" in shown.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "JobState=FAILED" in shown.stdout and "ExitCode=3:0" in shown.stdout, shown.stdout


def test_postgres_accepts_a_connection() -> None:
    url = services.postgres_url()
    import psycopg

    conninfo = url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(conninfo, connect_timeout=5) as conn:
        version = conn.execute("show server_version").fetchone()[0]
        can_create = conn.execute("select rolcreatedb from pg_roles where rolname = current_user").fetchone()[0]
    assert version.split(".")[0].isdigit()
    assert can_create, "the test role must be able to CREATE DATABASE"


def test_chromium_renders_headless(tmp_path: Path) -> None:
    chromium = services.require_chromium()
    done = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            "data:text/html,<p>openlab-ok</p>",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert "openlab-ok" in done.stdout, done.stderr[-2000:]


def test_services_env_skip_and_ci_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The helpers' contract, without any service: recorded 0 -> skip locally, fail under CI."""
    (tmp_path / "services.env").write_text(
        "# comment\nOPENLAB_TEST_SLURM=0\nOPENLAB_TEST_SLURM_REASON='slurmctld did not start'\n"
        'export SLURM_CONF="/x/slurm.conf"\n'
    )
    monkeypatch.setenv("OPENLAB_INFRA_STATE", str(tmp_path))
    for key in ("OPENLAB_TEST_SLURM", "OPENLAB_TEST_SLURM_REASON", "SLURM_CONF"):
        monkeypatch.delenv(key, raising=False)
    assert services.services_env()["OPENLAB_TEST_SLURM_REASON"] == "slurmctld did not start"
    assert services.setting("SLURM_CONF") == "/x/slurm.conf"
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="slurmctld did not start"):
        services.require_slurm()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="slurmctld did not start"):
        services.require_slurm()
    monkeypatch.setenv("OPENLAB_TEST_SLURM", "1")  # the environment overrides the file
    assert services._declared("SLURM") == (True, "slurmctld did not start")


def test_bringing_one_tool_up_keeps_what_the_last_up_recorded_for_the_others(tmp_path: Path) -> None:
    """`OPENLAB_SERVICES=graphviz infra/services.sh up` installs graphviz; it once also marked
    docker, slurm and postgres "not requested", so every test of them skipped until a full `up`."""
    dot = services.require_graphviz()  # installed already: the step only checks it renders
    repo = Path(__file__).resolve().parents[2]
    recorded = (
        "OPENLAB_TEST_DOCKER=1\nOPENLAB_TEST_SLURM=1\nSLURM_CONF=/x/slurm.conf\n"
        "OPENLAB_TEST_POSTGRES=1\nOPENLAB_TEST_POSTGRES_URL='postgresql://u@h/d x'\n"  # quoted, as write_env quotes
    )
    (tmp_path / "services.env").write_text(recorded)
    env = {**os.environ, "OPENLAB_INFRA_STATE": str(tmp_path), "OPENLAB_SERVICES": "graphviz"}
    done = subprocess.run(["bash", str(repo / "infra/services.sh"), "up"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    written = services.parse_env_file(tmp_path / "services.env")
    assert written["OPENLAB_TEST_GRAPHVIZ"] == dot
    assert (written["OPENLAB_TEST_DOCKER"], written["OPENLAB_TEST_SLURM"]) == ("1", "1"), written
    assert written["SLURM_CONF"] == "/x/slurm.conf" and written["OPENLAB_TEST_POSTGRES_URL"] == "postgresql://u@h/d x"
    assert written["OPENLAB_TEST_CHROMIUM"] == "0" and "not requested" in written["OPENLAB_TEST_CHROMIUM_REASON"]
