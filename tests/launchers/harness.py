"""Backends for the launcher suite: one :class:`Harness` per backend, real where possible.

- local: always.
- docker: the real engine (``require_docker()`` from tests/services.py: skip locally,
  fail when CI=true). The image is ``OPENLAB_TEST_IMAGE``, else the small locally built
  ``openlab/python-base:bookworm``, else ``openlab/job:latest``.
- slurm: the real single-node cluster (``require_slurm()``).
- kubernetes: kmock's emulator on 127.0.0.1 plus the controller in ``k8s_emulator``, whose
  pods are Docker containers of the test job image when the engine is up, else local processes.

A harness knows how to tell, in the backend's own terms, that nothing of a job is left
running and which labels the backend attached to it.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.launchers import JobHandle, Launcher, get_launcher

try:  # the infra engineer's helpers: skip with a reason locally, fail under CI=true
    from tests import services as _services  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - before tests/services.py exists
    _services = None

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TEST_IMAGES = ("openlab/python-base:bookworm", "openlab/job:latest")


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: services must be up)")
    pytest.skip(reason)


def _require(name: str) -> Any:
    helper = getattr(_services, f"require_{name}", None) if _services else None
    return helper() if helper else None


@dataclass
class Harness:
    """One backend under test."""

    name: str
    launcher: Launcher
    image: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    #: a time limit the backend enforces in reasonable test time, and how long to wait for it
    time_limit: int = 2
    wait_timeout: float = 60

    def nothing_running(self, handle: JobHandle) -> list[str]:
        """What of the job is still running (empty when nothing is)."""
        if self.name == "local":
            from orchestrator.launchers._supervise import group_members

            pgid = self.launcher.process_group(handle)  # type: ignore[attr-defined]
            return [f"pid {p}" for p in group_members(pgid)]
        if self.name == "docker":
            client = self.launcher.client  # type: ignore[attr-defined]
            running = client.containers.list(filters={"name": handle.job_id})
            return [c.name for c in running]
        if self.name == "slurm":
            out = subprocess.run(
                ["squeue", "-h", "-j", handle.job_id, "-o", "%i %T"], capture_output=True, text=True, check=False
            )
            return [line for line in out.stdout.splitlines() if line.strip()]
        if self.name == "kubernetes":
            cluster = self.options["cluster"]
            left = []
            if cluster.workload_alive(handle.job_id):
                left.append(f"pod {cluster.runtime} workload")
            ns, name = handle.job_id.split("/", 1)
            job = cluster.jobs().get((ns, name))
            if job is not None and (job.get("status") or {}).get("active"):
                left.append("active Job")
            left += [
                f"pod {pod}"
                for (pns, pod), phase in cluster.pod_phases().items()
                if pns == ns and pod.startswith(name + "-") and phase in ("Pending", "Running")
            ]
            return left
        raise AssertionError(self.name)

    def native_labels(self, handle: JobHandle) -> dict[str, str]:
        """The labels as the backend itself stores them (call before cleanup)."""
        if self.name == "local":
            return self.launcher._read(handle.job_id)["labels"]  # type: ignore[attr-defined]
        if self.name == "docker":
            container = self.launcher.client.containers.get(handle.job_id)  # type: ignore[attr-defined]
            return dict(container.labels)
        if self.name == "slurm":
            out = subprocess.run(
                ["scontrol", "show", "job", "-o", handle.job_id], capture_output=True, text=True, check=True
            )
            from orchestrator.launchers.slurm import parse_scontrol

            return json.loads(parse_scontrol(out.stdout.splitlines()[0])["Comment"])
        if self.name == "kubernetes":
            ns, name = handle.job_id.split("/", 1)
            return self.options["cluster"].jobs()[(ns, name)]["metadata"]["labels"]
        raise AssertionError(self.name)


def docker_image() -> str:
    import docker

    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:  # noqa: BLE001
        _unavailable(f"docker engine not reachable: {exc}")
    wanted = [os.environ["OPENLAB_TEST_IMAGE"]] if os.environ.get("OPENLAB_TEST_IMAGE") else list(TEST_IMAGES)
    for image in wanted:
        try:
            client.images.get(image)
            return image
        except Exception:  # noqa: BLE001
            continue
    _unavailable(f"no test image ({', '.join(wanted)}): run infra/docker/build-base-image.sh")
    raise AssertionError("unreachable")


def find_slurm_conf() -> str | None:
    """SLURM_CONF from the environment, else from the infra scripts' state (services.env or its default path)."""
    if os.environ.get("SLURM_CONF"):
        return os.environ["SLURM_CONF"]
    state = Path(os.environ.get("OPENLAB_INFRA_STATE", "/var/tmp/openlab-infra"))
    env_file = state / "services.env"
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            if line.startswith(("SLURM_CONF=", "export SLURM_CONF=")):
                return line.split("=", 1)[1].strip().strip("'\"")
    default = state / "slurm" / "etc" / "slurm.conf"
    return str(default) if default.exists() else None


def slurm_ready() -> None:
    conf = find_slurm_conf()
    if conf:
        os.environ["SLURM_CONF"] = conf  # the CLI tools, the launcher and CLI subprocesses all need it
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        _unavailable(f"slurm not available: {exc}")
    if "UP" not in out.stdout:
        _unavailable(f"slurmctld not reachable: {(out.stdout + out.stderr).strip()}")


def make_harness(name: str, request: pytest.FixtureRequest) -> Harness:
    if name == "local":
        return Harness("local", get_launcher("local", grace=2), time_limit=1, wait_timeout=20)
    if name == "docker":
        _require("docker")
        image = docker_image()
        return Harness(
            "docker",
            get_launcher("docker", image=image, grace=2, measure_usage=True),
            image=image,
            time_limit=2,
            wait_timeout=90,
        )
    if name == "slurm":
        _require("slurm")
        slurm_ready()
        # Slurm keeps time limits in whole minutes and checks them about every 30 s
        return Harness("slurm", get_launcher("slurm"), time_limit=60, wait_timeout=150)
    if name == "kubernetes":
        cluster = request.getfixturevalue("k8s_cluster")
        launcher = get_launcher("kubernetes", host=cluster.url)
        launcher.poll_interval = 0.1
        # pods are containers of the test job image when the engine is up (see k8s_emulator): slower to start
        return Harness(
            "kubernetes",
            launcher,
            image=cluster.image,
            options={"cluster": cluster},
            time_limit=1,
            wait_timeout=60 if cluster.runtime == "docker" else 20,
        )
    raise AssertionError(name)


BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("docker", id="docker", marks=[pytest.mark.docker, pytest.mark.slow]),
    pytest.param("slurm", id="slurm", marks=[pytest.mark.slurm]),
    pytest.param("kubernetes", id="kubernetes"),
]


def jobcomp_only_slurm(bin_dir: Path, jobcomp: Path) -> None:
    """Fake ``scontrol``/``sacct`` in ``bin_dir`` for a cluster that has forgotten its jobs
    and has no accounting: only the jobcomp/filetxt log at ``jobcomp`` still knows them."""
    bin_dir.mkdir(exist_ok=True)
    for tool, body in {
        "scontrol": (
            'if [ "$1" = show ] && [ "$2" = config ]; then\n'
            f"  echo 'JobCompLoc              = {jobcomp}'\n"
            "  echo 'JobCompType             = jobcomp/filetxt'\n  exit 0\nfi\n"
            'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n'
        ),
        "sacct": 'echo "Slurm accounting storage is disabled" >&2; exit 1\n',
    }.items():
        path = bin_dir / tool
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
