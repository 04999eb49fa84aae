"""What a docker job writes into the artifact root belongs to the person who submitted it.

Against the real engine, with ``openlab job run`` run by a person who is not root (this suite runs
as root here, so as uid 65534 with the ``docker`` group, as someone in that group would be): the job
image names no user, so without ``user`` a container runs as root and its checkpoints could not be
deleted by the person, nor by ``openlab gc`` run as them.
"""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services import docker_image, require_docker

pytestmark = [pytest.mark.docker]

NOBODY = 65534


@pytest.fixture
def person() -> Iterator[tuple[list[str], Path]]:
    """A command prefix that runs as a non-root member of the docker group, and a home it owns."""
    home = Path(tempfile.mkdtemp(prefix="openlab-person-", dir="/tmp"))  # pytest's tmp_path is root's alone
    try:
        if os.getuid() != 0:
            yield [], home
            return
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) is needed to run the CLI as another user")
        os.chown(home, NOBODY, NOBODY)
        group = grp.getgrnam("docker").gr_gid
        yield ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", f"--groups={group}"], home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _job(prefix: list[str], home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENLAB_")}
    env.update(OPENLAB_HOME=str(home / "openlab"), HOME=str(home))
    job = ["job", "run", "-b", "docker", "--image", docker_image("job"), *args]
    command = [*prefix, sys.executable, "-m", "orchestrator.cli.main", *job]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=home)


PROBE = (
    'id -u; echo "home=$HOME"; touch "$OPENLAB_ARTIFACT_ROOT/made-by-job"; mkdir -p "$HOME/.cache/x" && echo cache-ok'
)


def test_a_job_in_an_image_with_no_user_runs_as_the_person_and_its_files_are_theirs(person) -> None:
    require_docker()
    prefix, home = person
    artifacts = home / "artifacts"
    out = _job(prefix, home, "--artifact-root", str(artifacts), "--", "sh", "-c", PROBE)
    assert out.returncode == 0, out.stdout + out.stderr
    uid = NOBODY if prefix else os.getuid()
    lines = out.stdout.splitlines()
    assert str(uid) in lines, out.stdout
    assert "home=/tmp" in lines and "cache-ok" in lines, out.stdout  # a home it can write (wandb, torch caches)
    made = artifacts / "made-by-job"
    assert made.stat().st_uid == uid, (made.stat().st_uid, uid)
    subprocess.run([*prefix, "rm", str(made)], check=True)
    assert not made.exists()  # theirs to delete


def test_user_image_keeps_the_images_user_and_a_given_one_is_used(person) -> None:
    require_docker()
    prefix, home = person
    image = _job(prefix, home, "-o", "user=image", "--", "id", "-u")
    assert image.returncode == 0 and "0" in image.stdout.splitlines(), image.stdout + image.stderr
    given = _job(prefix, home, "-o", "user=4321:4321", "-e", "HOME=/", "--", "sh", "-c", 'id -u; echo "home=$HOME"')
    assert given.returncode == 0, given.stdout + given.stderr
    assert "4321" in given.stdout.splitlines() and "home=/" in given.stdout.splitlines(), given.stdout
