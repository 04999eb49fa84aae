"""A docker job runs the host's working tree, read-only — the code lineage hashed, not the image's copy.

Against the real engine: the job image has its own copy of the project baked in at build
time; a stage's identity hashes the working tree. If the container ran the image's copy,
an edited stage would re-run with the old code under the new identity.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.launchers import JobSpec, get_launcher
from tests.forked_cli import run_cli
from tests.services import docker_image, require_docker

pytestmark = [pytest.mark.docker]


def _run(spec: JobSpec, **options: object) -> tuple[str, list[str]]:
    launcher = get_launcher("docker", **options)
    handle = launcher.submit(spec)
    try:
        status = launcher.wait(handle, timeout=120)
        return status.state.value, list(launcher.logs(handle))
    finally:
        launcher.cleanup(handle)


def test_job_runs_the_hosts_working_tree_read_only(tmp_path: Path) -> None:
    require_docker()
    image = docker_image("job")
    tree = tmp_path / "tree"
    (tree / "workloads").mkdir(parents=True)
    (tree / "workloads" / "__init__.py").write_text("")
    (tree / "workloads" / "probe.py").write_text(
        "import pathlib\n"
        "print('probe from the working tree', pathlib.Path(__file__).resolve())\n"
        "try:\n"
        "    pathlib.Path('written-by-job').write_text('x')\n"
        "    print('workdir writable')\n"
        "except OSError as exc:\n"
        "    print('workdir read-only', exc.errno)\n"
    )
    spec = JobSpec(name="workdir-probe", command=["python", "-m", "workloads.probe"], image=image, workdir=str(tree))
    state, lines = _run(spec, image=image)
    text = "\n".join(lines)
    assert state == "SUCCEEDED", text
    assert f"probe from the working tree {tree.resolve()}/workloads/probe.py" in text
    assert "workdir read-only 30" in text  # EROFS: a job cannot change the code it was identified by
    assert not (tree / "written-by-job").exists()


@pytest.mark.parametrize("mount", [True, False], ids=["mounted", "mount_workdir=false"])
def test_mount_workdir_can_be_turned_off(tmp_path: Path, mount: bool) -> None:
    """Images that ship their code on purpose can opt out; then the host's folder is not there."""
    require_docker()
    image = docker_image("job")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "only-on-host.txt").write_text("host")
    spec = JobSpec(name="workdir-opt", command=["ls", "-1", str(tree)], image=image, workdir=str(tree))
    state, lines = _run(spec, image=image, mount_workdir=mount)
    assert state == "SUCCEEDED", lines
    assert ("only-on-host.txt" in lines) is mount


def test_mount_workdir_false_on_the_command_line_is_false(tmp_path: Path) -> None:
    """``-o mount_workdir=false`` is read as openlab.toml would read it: the text "false" once
    counted as true (a non-empty string) and the folder was mounted all the same."""
    require_docker()
    image = docker_image("job")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "only-on-host.txt").write_text("host")
    cli = ["job", "run", "-b", "docker"]
    ls = ["--image", image, "--workdir", str(tree), "--", "ls", "-1", str(tree)]
    env = {**os.environ, "OPENLAB_HOME": str(tmp_path / "home")}
    for value, listed in (("true", True), ("false", False)):
        proc = run_cli([*cli, "-o", f"mount_workdir={value}", *ls], env=env, cwd=Path.cwd(), timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert ("only-on-host.txt" in proc.stdout) is listed, (value, proc.stdout)
    proc = run_cli([*cli, "-o", "mount_workdir=nah", *ls], env=env, cwd=Path.cwd(), timeout=120)
    assert proc.returncode == 2 and "backend option mount_workdir = 'nah' is not yes or no" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_stage_can_ask_for_a_bigger_dev_shm(tmp_path: Path) -> None:
    """Docker gives /dev/shm 64 MB, which PyTorch's DataLoader workers outgrow; `shm_size` (a
    recipe's `resources.<stage>.docker`, or [backends.docker]) sizes it."""
    require_docker()
    image = docker_image("job")
    probe = ["sh", "-c", "df -k /dev/shm | tail -n 1"]
    state, lines = _run(JobSpec(name="shm-default", command=probe, image=image), image=image)
    assert state == "SUCCEEDED" and lines[-1].split()[1] == str(64 * 1024), lines
    spec = JobSpec(name="shm-2g", command=probe, image=image, options={"shm_size": "2G"})
    state, lines = _run(spec, image=image)
    assert state == "SUCCEEDED" and lines[-1].split()[1] == str(2 * 1024 * 1024), lines
