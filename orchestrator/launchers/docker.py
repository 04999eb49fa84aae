"""Docker backend: one container per job, through the ``docker`` SDK.

- The image comes from the spec, else ``[backends.docker] image`` (default
  ``openlab/job:latest``, built from the repo's Dockerfile by
  ``infra/docker/build-job-image.sh``); it is never pulled unless ``pull = true``, since
  these machines have no registry. Its digest (RepoDigests, else the image id) is recorded.
- Limits: ``nano_cpus``, ``mem_limit`` (with swap off, so over the limit means OOM, which
  is reported as ``FAILED`` with reason "out of memory"), ``pids_limit`` (default 4096).
  ``shm_size`` (e.g. ``2G``; not set by default) sizes ``/dev/shm``: Docker's default is 64 MB,
  too small for PyTorch's DataLoader workers, which pass batches through it (the MoE workload
  uses none, so it is left to a stage that does: ``resources.<stage>.docker.shm_size``).
- ``network_mode`` defaults to ``"none"``: a job reads its inputs from the artifact root,
  which is bind-mounted at the same path, so lineage paths mean the same inside and out.
- The spec's working directory, when it is a folder on this host, is bind-mounted
  read-only at the same path (``mount_workdir = false`` turns this off), so a pipeline
  stage runs the working tree its identity hashed rather than the code the image was
  built with; ``mounts = {HOST = "TARGET[:ro]"}`` adds more. With ``mount_workdir = false``
  the image's code runs, and pipeline stages first check the image was built from the
  run's tree (``image_code_check``, see :mod:`orchestrator.provenance.image`).
- The time limit is enforced in the container by GNU ``timeout`` (so it holds with nobody
  watching; set ``time_limit_wrapper = false`` for images without coreutils) and by
  :meth:`DockerLauncher.status` as a backstop. ``--foreground``: the job's process is told
  once, as a ``docker stop`` tells it; without it timeout signals the job and then its whole
  process group, so a job could hear its time limit or a cancel twice, and one that saves on
  the first SIGTERM and quits on the second would lose its checkpoint. What the job started
  ends with the container. A job asked to be warned ahead of its limit (``warn_before_limit``)
  gets SIGUSR1 that long before it from a second ``timeout`` inside the first, as Slurm's
  ``--signal=USR1@N`` gives it, so that a training saves and stops while it may; one that goes
  on is stopped at the limit as before.
- What a job used (CPU seconds, peak resident memory) is measured inside the container by
  ``launchers/_usage.py``, the parent of the job's command, because the container's cgroup
  and its counters are gone once it exits. It writes ``/.openlab/usage.json`` in the
  container (below: how that comes back).
  ``measure_usage = "auto"`` (the default) does it for images that name their interpreter in
  the ``openlab.io/python`` label (the repo's Dockerfile does); ``true`` uses ``python``
  (default ``python3``, which every image with a Python 3 has; plain ``python`` only some) in any
  image; ``false`` never.
- A job of several tasks runs them under this launcher's copy of ``launchers/_tasks.py``.
- A program the container cannot start (the helpers' Python, the job's command) ends the job with
  exit code 127 and only docker-init's or the helpers' line in its log; the attempt's reason names
  it (``the image has no 'python3'``) and, for the helpers' Python, the option to set.
- Both helper scripts are this launcher's own copies (stdlib only, run with ``python -I -S``) at
  ``/.openlab`` in the container, so a job needs a Python in its image, not openlab, and never
  runs a stale copy an old image holds. With an engine on this host they are in a per-job folder
  of ``$OPENLAB_HOME/jobs/docker/mounted/`` mounted there (which also takes the usage record,
  read from this side); with an engine on another host (``base_url``, ``DOCKER_HOST``), which
  cannot mount a folder of this host, they are copied into the container between its creation
  and its start (``put_archive``) and the record is read back out of the ended container
  (``get_archive``), once: the same jobs run and are measured, at about 0.1 s more per job
  (two archive calls of ~50 ms each, measured on the local engine).
- Jobs run as the person who submitted them where the image names no user of its own (``user =
  "auto"``, the default; :func:`container_user`), so what they write into the artifact root is
  theirs to delete, not root's; ``user = "image"`` keeps the image's user, ``user = "UID:GID"`` or a
  name picks one.
- Yes/no options (``mount_workdir``, ``time_limit_wrapper``, ``init``, ``pull``,
  ``measure_usage``) take booleans or ``true``/``false``-like text; anything else is refused
  before the job starts (:func:`~orchestrator.launchers.base.flag_option`).
- Containers carry the spec's labels plus ``openlab.io/managed``; once a job ended and its
  logs were collected (:meth:`DockerLauncher.cleanup`, called by ``run_job``, or
  :meth:`DockerLauncher.cancel`) the log goes to ``logs_dir/ID.log``, the final status to
  ``$OPENLAB_HOME/jobs/docker/ID.json`` and the container is removed.

The job id is the container name (``openlab-<name>-<hex>``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
import re
import shutil
import tarfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.launchers._tasks import command as tasks_command
from orchestrator.launchers.base import (
    HELPERS_MOUNT,
    HELPERS_PYTHON_KEY,
    STOP_GRACE,
    TIME_LIMIT_REASON,
    BackendUnavailable,
    ImageNotFound,
    JobHandle,
    JobNotFound,
    JobSpec,
    JobState,
    JobStatus,
    Launcher,
    LauncherError,
    first_failed_task,
    flag_option,
    helper_script,
    helpers_python,
    measure_usage_option,
    not_started,
    number_option,
    parse_memory,
    parse_usage,
    table_option,
    usage_python,
    with_notes,
)
from orchestrator.secrets import scrub, secret_values

DEFAULT_IMAGE = "openlab/job:latest"


def _how_to_get(image: object) -> str:
    """What to do about a missing image: openlab's own is built from this repo; another one is
    the user's to pull or build (or ``pull = true`` under ``[backends.docker]``), or a misspelt name."""
    if str(image) == DEFAULT_IMAGE:
        return "run infra/docker/build-job-image.sh"
    return f"docker pull {image} (or set pull = true under [backends.docker]), or check the name"


MOUNTS_EXAMPLE = '{"/data" = "/data:ro"}'
MANAGED_LABEL = "openlab.io/managed"
TIME_LIMIT_LABEL = "openlab.io/time-limit"
#: Seconds a cancel gives the job between SIGTERM and SIGKILL (``grace``, default :data:`STOP_GRACE`).
GRACE_LABEL = "openlab.io/grace"
#: Where a multi-task container's tasks write how they ended (under the mounted artifact root).
TASK_ENDS_LABEL = "openlab.io/task-ends"
#: Where the container's usage wrapper (launchers/_usage.py) leaves what the job used, on this host.
USAGE_LABEL = "openlab.io/usage"
#: Per-job folders of this host for them, mounted at HELPERS_MOUNT: ``mounted`` (now), ``usage`` (older openlab,
#: for a job that ran across the upgrade); removed at cleanup.
JOB_FOLDERS = ("mounted", "usage")
CANCEL_EXIT_CODES = (137, 143)


def _parse_time(text: str | None) -> dt.datetime | None:
    """Docker's RFC 3339 timestamps with nanoseconds; the zero time means 'never'."""
    if not text or text.startswith("0001-"):
        return None
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)?", text)
    if not match:
        return None
    frac = (match.group(2) or ".0")[:7]
    tz = match.group(3) or "Z"
    return dt.datetime.fromisoformat(match.group(1) + frac + ("+00:00" if tz == "Z" else tz)).astimezone(dt.UTC)


def _slug(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]+", "-", name).strip("-.")[:40] or "job"


def _api_message(exc: Exception) -> str:
    explanation = getattr(exc, "explanation", None)
    if explanation:
        return explanation.decode() if isinstance(explanation, bytes) else str(explanation)
    return str(exc)


def _tail(container: Any, lines: int = 20) -> str:
    """The last ``lines`` of a container's output ("" when the engine has none)."""
    try:
        return container.logs(tail=lines).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - removed meanwhile, or the log driver keeps nothing to read back
        return ""


def _engine_url(opts: Mapping[str, Any]) -> str:
    """The engine's address: ``base_url`` (in [backends.docker]), else ``$DOCKER_HOST``, else the
    local socket."""
    return str(opts.get("base_url") or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock")


def _engine_is_local(opts: Mapping[str, Any]) -> bool:
    """Whether the engine runs on this host, so it can mount a folder of this host."""
    return _engine_url(opts).startswith("unix://")


def host_user() -> str:
    """This process's ``uid:gid``, as ``docker run --user "$(id -u):$(id -g)"`` names it."""
    return f"{os.getuid()}:{os.getgid()}"


def container_user(opts: Mapping[str, Any], image_user: str, local_engine: bool) -> str | None:
    """Who the container runs as (``user`` option; None: the image's own user).

    ``"auto"`` (the default): an image that names no user would run as root, and everything a job
    writes into the bind-mounted artifact root would then belong to root: a person who is not root
    could not delete their own checkpoints, nor could ``openlab gc``. So with an engine on this host
    such a job runs as the person who submitted it (``uid:gid``, with ``HOME=/tmp`` unless the job
    sets one, since that uid has no home in the image); an image that chose a user keeps it, and
    root submitting changes nothing. ``"image"``: always the image's user. Anything else
    (``"1000:1000"``, ``"app"``) is passed to Docker as given.
    """
    asked = str(opts.get("user") or "auto").strip()
    if asked == "image":
        return None
    if asked != "auto":
        return asked
    if not local_engine or image_user.strip() not in ("", "root", "0", "0:0") or os.getuid() == 0:
        return None
    return host_user()


def _helpers_archive(names: list[str]) -> bytes:
    """A tar of this launcher's helper scripts ``names`` (:func:`helper_script`) under ``.openlab/``,
    for ``put_archive`` at ``/``: the folder writable by anyone, so a job run as another user
    (``user = ...``) can still write its usage record there."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        folder = tarfile.TarInfo(HELPERS_MOUNT.strip("/"))
        folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o777, int(time.time())
        tar.addfile(folder)
        for name in names:
            data = helper_script(name).read_bytes()
            info = tarfile.TarInfo(f"{HELPERS_MOUNT.strip('/')}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o444, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _container_secrets(container: Any) -> list[str]:
    """The values of the container's secret-named variables (``-e MY_TOKEN=...``), which whoever
    reads its log later (``openlab job logs`` in another process) cannot know from its own."""
    env = dict(e.split("=", 1) for e in (container.attrs.get("Config") or {}).get("Env") or [] if "=" in e)
    return secret_values(env)


class DockerLauncher(Launcher):
    """Runs jobs as Docker containers (see the module docstring)."""

    name = "docker"
    #: Several tasks of one job in its container (launchers/_tasks.py), never several machines.
    multi_task = True
    #: Seconds between status looks while a job runs; :meth:`pause` wakes as soon as it ends.
    poll_interval = 2.0
    known_options = Launcher.known_options | {
        "base_url", "timeout", "image", "pull", "image_code_check", "mount_workdir", "mounts", "network_mode",
        "pids_limit", "shm_size", "user", "init", "time_limit_wrapper", "grace", "measure_usage",
    }  # fmt: skip

    def __init__(self, settings: Any = None, config: Any = None) -> None:
        super().__init__(settings, config)
        self._client: Any = None
        self._engine_host: str | None = None
        self._waited: set[str] = set()  # containers whose end the engine already reported to pause()
        self._usage_read: dict[str, dict[str, float] | None] = {}  # ended containers' records read out of them
        self._digests: dict[str, str] | None = None  # image id -> digest, while statuses() asks for many jobs
        self.state_dir = self.settings.home / "jobs" / "docker"

    # -- connection ---------------------------------------------------------------
    @property
    def client(self) -> Any:
        if self._client is None:
            import docker
            from docker.errors import DockerException

            base_url = self.config.get("base_url") or os.environ.get("DOCKER_HOST")
            where = _engine_url(self.config)
            timeout = int(number_option(self.config, "timeout", 60))
            try:
                if base_url:
                    self._client = docker.DockerClient(base_url=base_url, timeout=timeout)
                else:
                    self._client = docker.from_env(timeout=timeout)
                self._client.ping()
            except DockerException as exc:
                self._client = None
                raise BackendUnavailable(
                    f"docker engine not reachable at {where}: {_api_message(exc)} "
                    "(start it with infra/docker/start.sh or set DOCKER_HOST)"
                ) from None
        return self._client

    def _errors(self) -> Any:
        from docker import errors

        return errors

    def _find_cluster(self) -> str | None:
        return self.engine_host  # the engine's machine: a container id means something only there

    @property
    def engine_host(self) -> str | None:
        if self._engine_host is None:
            try:
                self._engine_host = str(self.client.info().get("Name") or "") or None
            except Exception:  # noqa: BLE001 - the host name is informative only
                self._engine_host = None
        return self._engine_host

    @classmethod
    def check_options(cls, opts: Mapping[str, Any]) -> None:
        super().check_options(opts)
        for name, default in (("mount_workdir", True), ("time_limit_wrapper", True), ("init", True), ("pull", False)):
            flag_option(opts, name, default)
        for name, number in (("grace", STOP_GRACE), ("pids_limit", 4096), ("timeout", 60)):
            number_option(opts, name, number)
        table_option(opts, "mounts", MOUNTS_EXAMPLE)
        measure_usage_option(opts)

    def image_name(self, spec: JobSpec) -> str | None:
        return spec.image or self.config.get("image") or DEFAULT_IMAGE

    def _image(self, name: str) -> Any:
        errors = self._errors()
        try:
            return self.client.images.get(name)
        except errors.ImageNotFound:
            if flag_option(self.config, "pull", False):
                try:
                    return self.client.images.pull(name)
                except errors.APIError as exc:
                    raise ImageNotFound(f"image {name} not found and pull failed: {_api_message(exc)}") from None
            raise ImageNotFound(f"image {name} not found: {_how_to_get(name)}") from None
        except errors.APIError as exc:
            raise LauncherError(f"docker could not inspect image {name}: {_api_message(exc)}") from None

    def environment_image(self, image: str | None = None) -> str | None:
        """The digest of the image a job would run (raises ImageNotFound before any job starts)."""
        return self.image_digest(self._image(str(self.image_ref(image))))

    def runs_image_code(self) -> bool:
        return not flag_option(self.config, "mount_workdir", True)

    def image_labels(self, image: str | None = None) -> dict[str, str] | None:
        return dict(self._image(str(self.image_ref(image))).labels or {})

    @staticmethod
    def image_digest(image: Any) -> str | None:
        digests = image.attrs.get("RepoDigests") or []
        return str(digests[0]) if digests else image.id

    # -- state kept after the container is gone -----------------------------------------
    def _final_path(self, job_id: str) -> Path:
        return self.state_dir / f"{job_id}.json"

    def _log_path(self, job_id: str) -> Path:
        return self.settings.logs_dir / f"{job_id}.log"

    def _get(self, job_id: str) -> Any | None:
        import requests

        errors = self._errors()
        try:
            return self.client.containers.get(job_id)
        except errors.NotFound:
            return None
        except errors.APIError as exc:
            raise LauncherError(f"docker could not inspect container {job_id}: {_api_message(exc)}") from None
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            # the engine restarting: the container may well run on (live-restore), so this is an
            # outage to wait out (run_job's outage_grace), not the job's failure
            where = _engine_url(self.config)
            raise BackendUnavailable(f"docker engine not reachable at {where}: {type(exc).__name__}") from None

    # -- interface -------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> JobHandle:
        errors = self._errors()
        image = self._image(str(self.image_name(spec)))
        job_id = f"openlab-{_slug(spec.name)}-{uuid.uuid4().hex[:8]}"
        opts = {**self.config, **spec.options}
        labels = {str(k): str(v) for k, v in spec.labels.items()}
        labels[MANAGED_LABEL] = "true"
        labels["openlab.io/job-name"] = spec.name
        command = list(spec.command)
        task_ends = None
        helpers: list[str] = []  # this launcher's helper scripts, at HELPERS_MOUNT in the container (module docstring)
        pythons: list[str] = []  # what they run with
        if spec.tasks > 1:  # one process per task in the container, told its place (launchers/_tasks.py)
            pythons.append(helpers_python(opts))
            helpers.append("tasks.py")
            command = tasks_command(pythons[-1], spec.tasks, command, script=f"{HELPERS_MOUNT}/tasks.py")
            if spec.artifact_root is not None:  # mounted at the same path: the ends are readable here
                task_ends = str(Path(spec.artifact_root).resolve() / ".tasks" / f"{job_id}.ends")
                labels[TASK_ENDS_LABEL] = task_ends
        grace = int(number_option(opts, "grace", STOP_GRACE))
        labels[GRACE_LABEL] = str(grace)  # the job's own (a stage option may set it), which a cancel waits out
        if spec.time_limit:
            labels[TIME_LIMIT_LABEL] = str(spec.time_limit)
            if flag_option(opts, "time_limit_wrapper", True):
                if spec.warn_before_limit:  # --preserve-status: the job's own exit, not timeout's 124
                    warn_at = str(spec.time_limit - spec.warn_before_limit)
                    command = ["timeout", "--foreground", "--preserve-status", "-s", "USR1", warn_at, *command]
                command = ["timeout", "--foreground", "-k", str(grace), str(spec.time_limit), *command]
        python = usage_python(opts, image.labels)  # module docstring: measure_usage
        if python is not None:  # the job runs under the usage wrapper, its parent in the container
            # Outside `timeout`, which signals its whole process group: inside it, the job would get
            # the time limit's SIGTERM from timeout and again from the wrapper passing it on.
            helpers.append("usage.py")
            pythons.append(python)
            record = f"{HELPERS_MOUNT}/usage.json"
            command = [python, "-I", "-S", f"{HELPERS_MOUNT}/usage.py", record, "--", *command]
        mounted = self._mounted(job_id, helpers) if helpers and _engine_is_local(self.config) else None
        if pythons:
            labels[HELPERS_PYTHON_KEY] = " ".join(dict.fromkeys(pythons))
        if "usage.py" in helpers:  # where this side reads the record: the job's folder, else the container
            labels[USAGE_LABEL] = str(mounted / "usage.json") if mounted is not None else record
        env = {
            **{str(k): str(v) for k, v in spec.env.items()},
            **({"OPENLAB_TASK_ENDS": task_ends} if task_ends else {}),
            "OPENLAB_JOB_ID": job_id,
            "OPENLAB_JOB_NAME": spec.name,
            "OPENLAB_LABELS": json.dumps(dict(spec.labels), sort_keys=True),
        }
        volumes: dict[str, dict[str, str]] = {}
        if spec.artifact_root is not None:
            root = str(Path(spec.artifact_root).resolve())
            Path(root).mkdir(parents=True, exist_ok=True)
            volumes[root] = {"bind": root, "mode": "rw"}
            env["OPENLAB_ARTIFACT_ROOT"] = root
        if spec.workdir and flag_option(opts, "mount_workdir", True) and Path(spec.workdir).is_dir():
            # The job runs the code in the host's working tree — the code lineage hashed —
            # not whatever copy was baked into the image when it was last built.
            workdir = str(Path(spec.workdir).resolve())
            volumes.setdefault(workdir, {"bind": workdir, "mode": "ro"})
        if mounted is not None:
            volumes[str(mounted)] = {"bind": HELPERS_MOUNT, "mode": "rw"}
        for host_path, target in table_option(opts, "mounts", MOUNTS_EXAMPLE).items():
            bind, _, mode = str(target).partition(":")
            volumes[str(host_path)] = {"bind": bind, "mode": mode or "rw"}
        kwargs: dict[str, Any] = {
            "name": job_id,
            "labels": labels,
            "environment": env,
            "network_mode": opts.get("network_mode", "none"),
            "pids_limit": int(number_option(opts, "pids_limit", 4096)),
            "volumes": volumes,
            # docker-init as PID 1 forwards SIGTERM to the job and reaps its zombies, so a
            # cancel ends the job at once instead of after the stop timeout
            "init": flag_option(opts, "init", True),
        }
        if spec.workdir:
            kwargs["working_dir"] = spec.workdir
        if spec.cpus:  # per task, as Slurm counts them: the container holds every task
            kwargs["nano_cpus"] = int(spec.cpus * spec.tasks * 1e9)
        if spec.memory_bytes:
            kwargs["mem_limit"] = spec.memory_bytes
            kwargs["memswap_limit"] = spec.memory_bytes  # no swap: over the limit is an OOM kill
        if spec.gpus:
            from docker.types import DeviceRequest

            kwargs["device_requests"] = [DeviceRequest(count=spec.gpus, capabilities=[["gpu"]])]
        user = container_user(opts, (image.attrs.get("Config") or {}).get("User") or "", _engine_is_local(self.config))
        if user is not None:
            kwargs["user"] = user
            if user == host_user() and "HOME" not in env:  # no home of its own in the image: one it can write
                env["HOME"] = "/tmp"
        if opts.get("shm_size"):
            kwargs["shm_size"] = parse_memory(str(opts["shm_size"]))
        try:
            container = self.client.containers.create(image.id, command, **kwargs)
            if helpers and mounted is None:
                container.put_archive("/", _helpers_archive(helpers))
            container.start()
        except errors.ImageNotFound as exc:
            self._remove_quietly(job_id)
            self._forget_folders(job_id)
            raise ImageNotFound(f"docker: {_api_message(exc)}") from None
        except errors.APIError as exc:
            self._remove_quietly(job_id)
            self._forget_folders(job_id)
            why = _api_message(exc)
            hint = not_started(why, pythons, "docker")
            raise LauncherError(f"docker refused to run the job: {why}" + (f" ({hint})" if hint else "")) from None
        except BaseException:  # Ctrl-C, SIGTERM, a lost engine mid-way: no caller learns its id, so none may run
            self._remove_quietly(job_id)
            self._forget_folders(job_id)
            raise
        try:
            digest = self.image_digest(image)
        except BaseException:
            self._remove_quietly(job_id)
            self._forget_folders(job_id)
            raise
        return JobHandle(
            self.name,
            job_id,
            str(self._log_path(job_id)),
            {"container_id": container.id, "image_digest": digest},
        )

    def _mounted(self, job_id: str, names: list[str]) -> Path:
        """The job's folder of this launcher's helper scripts ``names`` (:func:`helper_script`),
        mounted at HELPERS_MOUNT with an engine on this host; it also takes the usage record.

        World-writable, so a job run as another user (``user = ...``) can still write its record.
        """
        folder = self.state_dir / JOB_FOLDERS[0] / job_id
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)
        for name in names:
            shutil.copyfile(helper_script(name), folder / name)
        return folder

    def _forget_folders(self, job_id: str) -> None:
        for kind in JOB_FOLDERS:
            shutil.rmtree(self.state_dir / kind / job_id, ignore_errors=True)

    def _read_usage(self, container: Any, labels: dict[str, str]) -> dict[str, float] | None:
        """What the usage wrapper recorded for an ended container (None: nothing measured, or the
        wrapper was killed with the job before it could write): from the job's folder on this
        host, or out of the container (an engine elsewhere; read once, then kept)."""
        path = labels.get(USAGE_LABEL)
        if not path:
            return None
        if not path.startswith(f"{HELPERS_MOUNT}/"):
            try:
                return parse_usage(Path(path).read_text())
            except OSError:
                return None
        if container.id not in self._usage_read:
            usage = None
            try:
                stream, _ = container.get_archive(path)
                with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                    member = tar.extractfile(tar.getmembers()[0])
                    usage = parse_usage(member.read().decode(errors="replace")) if member is not None else None
            except (self._errors().APIError, tarfile.TarError, IndexError):
                pass
            self._usage_read[container.id] = usage
        return self._usage_read[container.id]

    def _remove_quietly(self, job_id: str) -> None:
        try:
            container = self._get(job_id)
            if container is not None:
                container.remove(force=True)
        except Exception:  # noqa: BLE001 - best effort after a failed create
            pass

    def _status_of(self, container: Any, job_id: str) -> JobStatus:
        state = container.attrs.get("State", {})
        labels = container.attrs.get("Config", {}).get("Labels") or {}
        started = _parse_time(state.get("StartedAt"))
        ended = _parse_time(state.get("FinishedAt"))
        digest = self._digest_of(container.attrs.get("Image"))
        status_text = state.get("Status", "")
        host = self.engine_host
        if status_text in ("created",):
            return JobStatus(JobState.PENDING, host=host, image_digest=digest)
        if status_text in ("running", "paused", "restarting"):
            limit = int(labels.get(TIME_LIMIT_LABEL) or 0)
            # The in-container wrapper tells the job at its limit and kills it a grace later; only past
            # both (and a margin) did the wrapper not end it (disabled, or missing): end it here. At
            # limit + 10 this killed a job in the middle of the checkpoint its grace was for.
            grace = int(float(labels.get(GRACE_LABEL) or STOP_GRACE))
            if limit and started and (dt.datetime.now(dt.UTC) - started).total_seconds() > limit + grace + 10:
                container.kill()
                container.reload()
                return self._status_of(container, job_id)
            return JobStatus(JobState.RUNNING, host=host, started_at=started, image_digest=digest)
        code = state.get("ExitCode")
        limit = int(labels.get(TIME_LIMIT_LABEL) or 0)
        elapsed = (ended - started).total_seconds() if started and ended else 0.0
        if self._cancel_marker(job_id).exists():
            job_state, reason = JobState.CANCELLED, "cancelled"
        elif state.get("OOMKilled") and code != 0:  # a child killed for memory, the job itself fine: its own exit
            mem = container.attrs.get("HostConfig", {}).get("Memory") or 0
            job_state = JobState.FAILED
            reason = f"out of memory (limit {mem // (1024 * 1024)}M)" if mem else "out of memory"
        elif code == 0:
            job_state, reason = JobState.SUCCEEDED, None
        elif limit and elapsed >= limit - 1 and code in (124, *CANCEL_EXIT_CODES):
            job_state, reason = JobState.FAILED, f"{TIME_LIMIT_REASON} ({limit}s)"
        elif state.get("Error"):
            job_state, reason = JobState.FAILED, str(state["Error"])
        else:
            job_state, reason = JobState.FAILED, f"exit code {code}"
        if status_text == "dead" and job_state is JobState.SUCCEEDED:
            job_state, reason = JobState.LOST, "container is dead"
        if code == 127:  # a program that could not start, named by docker-init or the helper scripts
            pythons = labels.get(HELPERS_PYTHON_KEY, "").split()
            reason = with_notes(reason, not_started(_tail(container), pythons, "docker"))
        if code:
            reason = with_notes(reason, first_failed_task(labels.get(TASK_ENDS_LABEL)))
        usage = self._read_usage(container, labels)
        return JobStatus(job_state, code, reason, host, started, ended, digest, usage=usage)

    def _digest_of(self, image_id: str | None) -> str | None:
        """The image's repo digest (its id when it has none, or is gone since): one engine call an
        image, not a job, while :meth:`statuses` answers for many jobs of one image."""
        if self._digests is not None and image_id in self._digests:
            return self._digests[image_id]
        try:
            digest = self.image_digest(self.client.images.get(image_id))
        except Exception:  # noqa: BLE001 - the image may have been removed since
            digest = image_id
        if self._digests is not None and image_id is not None and digest is not None:
            self._digests[image_id] = digest
        return digest

    def statuses(self, handles: Sequence[JobHandle]) -> list[JobStatus | Exception]:
        """Each job's status as :meth:`status` gives it, reading each image once for all its jobs
        (`openlab job list` with twenty jobs of the job image: 21 engine calls, was 40)."""
        self._digests = {}
        try:
            return super().statuses(handles)
        finally:
            self._digests = None

    def _cancel_marker(self, job_id: str) -> Path:
        return self.state_dir / f"{job_id}.cancelled"

    def status(self, handle: JobHandle) -> JobStatus:
        container = self._get(handle.job_id)
        if container is None:
            final = self._final_path(handle.job_id)
            if final.exists():
                data = json.loads(final.read_text())
                return JobStatus(
                    JobState(data["state"]),
                    data.get("exit_code"),
                    data.get("reason"),
                    data.get("host"),
                    dt.datetime.fromisoformat(data["started_at"]) if data.get("started_at") else None,
                    dt.datetime.fromisoformat(data["ended_at"]) if data.get("ended_at") else None,
                    data.get("image_digest"),
                    usage=data.get("usage"),
                )
            return JobStatus(JobState.LOST, reason=f"container {handle.job_id} no longer exists")
        return self._status_of(container, handle.job_id)

    def pause(self, handle: JobHandle, seconds: float) -> None:
        """Wait up to ``seconds`` on the engine's ``wait`` endpoint, which answers when the container stops.

        So a waiter sees a job end as the engine does, and :attr:`poll_interval` can be long
        without delaying anyone: a long job costs one status look every few seconds instead of
        several engine calls per 0.2 s. Once the engine has answered for a container, later
        pauses for it just sleep: a container that is "not running" without having ended
        (created, never started) would otherwise make its poller spin.
        """
        if seconds <= 0:
            return
        if handle.job_id in self._waited:
            time.sleep(seconds)
            return
        import requests

        errors = self._errors()
        try:
            self.client.api.wait(handle.job_id, timeout=seconds, condition="not-running")
        except errors.NotFound:
            self._waited.add(handle.job_id)  # gone: the next look reads the saved final status
        except errors.DockerException:
            time.sleep(seconds)  # the engine refused the wait
        except requests.exceptions.Timeout:
            pass  # still running after ``seconds``
        except requests.exceptions.RequestException:
            time.sleep(seconds)  # the engine is unreachable: sleep, so a poller does not spin
        else:
            self._waited.add(handle.job_id)

    def logs(self, handle: JobHandle, *, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        container = self._get(handle.job_id)
        if container is None:
            from orchestrator.launchers.local import follow_file

            path = Path(handle.log_path or self._log_path(handle.job_id))
            if not path.exists():
                raise JobNotFound(f"container {handle.job_id} is gone and no log was saved at {path}")
            return follow_file(path, lambda: True, follow=False, tail=tail)
        secrets = _container_secrets(container)
        lines = self._stream(container, follow=follow, tail=tail)
        return (scrub(line, secrets) for line in lines) if secrets else lines

    @staticmethod
    def _stream(container: Any, *, follow: bool, tail: int | None) -> Iterator[str]:
        kwargs: dict[str, Any] = {"stream": True, "follow": follow, "stdout": True, "stderr": True}
        if tail is not None:
            kwargs["tail"] = tail
        partial = b""
        try:
            for chunk in container.logs(**kwargs):
                partial += chunk
                *lines, partial = partial.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - the container was removed while we followed it
            pass
        if partial:
            yield partial.decode("utf-8", "replace")

    def find(self, labels: Mapping[str, str]) -> list[JobHandle]:
        import requests

        wanted = [f"{k}={v}" for k, v in labels.items()] + [f"{MANAGED_LABEL}=true"]
        try:
            containers = self.client.containers.list(all=True, filters={"label": wanted})
        except self._errors().APIError as exc:
            raise LauncherError(f"docker could not list containers: {_api_message(exc)}") from None
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            raise BackendUnavailable(
                f"docker engine not reachable at {_engine_url(self.config)}: {type(exc).__name__}"
            ) from None
        return [JobHandle(self.name, c.name, str(self._log_path(c.name))) for c in containers]

    def cancel(self, handle: JobHandle) -> None:
        container = self._get(handle.job_id)
        if container is None:
            return
        if container.attrs.get("State", {}).get("Status") in ("created", "running", "paused", "restarting"):
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._cancel_marker(handle.job_id).write_text(str(time.time()))
            try:
                grace = container.labels.get(GRACE_LABEL) or number_option(self.config, "grace", STOP_GRACE)
                container.stop(timeout=int(float(grace)))
                container.reload()
            except self._errors().NotFound:
                return
            except self._errors().APIError as exc:
                raise LauncherError(f"docker could not stop {handle.job_id}: {_api_message(exc)}") from None
            if container.attrs.get("State", {}).get("Status") == "created":
                # never started (a submit cut short between create and start): stop does nothing to
                # it, and cleanup keeps what has not ended, so it stayed PENDING and was never removed
                ended = JobStatus(
                    JobState.CANCELLED, reason="cancelled before it started", ended_at=dt.datetime.now(dt.UTC)
                )
                self._final_path(handle.job_id).write_text(json.dumps(ended.to_dict()))
                with contextlib.suppress(self._errors().NotFound):
                    container.remove(force=True)
                self._forget_folders(handle.job_id)
                return
        self.cleanup(handle)

    def cleanup(self, handle: JobHandle) -> None:
        """Save the log and final status of an ended container, then remove it."""
        container = self._get(handle.job_id)
        if container is None:
            return
        container.reload()
        status = self._status_of(container, handle.job_id)
        if not status.state.terminal:
            return
        log_path = Path(handle.log_path or self._log_path(handle.job_id))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        text = container.logs(stdout=True, stderr=True)
        if secrets := _container_secrets(container):  # the job's own (-e MY_TOKEN=...): masked in the kept log
            text = scrub(text.decode("utf-8", "replace"), secrets).encode()
        log_path.write_bytes(text)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._final_path(handle.job_id).write_text(json.dumps(status.to_dict()))
        try:
            container.remove(force=True)
        except self._errors().NotFound:
            pass
        self._forget_folders(handle.job_id)  # kept in the final status now

    def check(self) -> tuple[bool, str]:
        try:
            info = self.client.info()
        except BackendUnavailable as exc:
            return False, str(exc)
        except Exception as exc:  # noqa: BLE001 - report, do not crash `backends check`
            return False, f"docker engine error: {_api_message(exc)}"
        engine = f"engine {info.get('ServerVersion')} on {info.get('Name')} ({info.get('Driver')})"
        image = self.config.get("image") or DEFAULT_IMAGE
        try:
            found = self.client.images.get(image)
        except Exception:  # noqa: BLE001
            return True, f"{engine}; image {image} missing: {_how_to_get(image)}"
        measured = usage_python(self.config, found.labels) is not None
        how = "what jobs use is measured" if measured else "what jobs use is not measured (see measure_usage)"
        return True, f"{engine}; image {image} present; {how}"
