"""A Kubernetes API on 127.0.0.1 (kmock's KubernetesEmulator) plus a tiny Job controller.

kmock stores and serves objects over real HTTP but runs no controller: nothing creates
pods, runs them or writes status. :class:`EmulatedCluster` adds the part the launcher
needs to be tested for real: for every new batch/v1 Job it creates a pod object (with the
template's labels and annotations), runs each of the pod's containers, serves their output as
the pod log, enforces ``activeDeadlineSeconds`` and writes Job/pod status back
(active/succeeded/failed, conditions, start/completion time, exit code, node, image id).
Deleting the Job kills the pod's workload and deletes its pods.
:meth:`EmulatedCluster.evict` does what the Eviction API or a node's kubelet does to a pod: the
``DisruptionTarget`` condition, SIGTERM, SIGKILL after the grace period, pod phase Failed.

Pods are scheduled onto the one node at once, unless it is cordoned (:meth:`EmulatedCluster.cordon`):
then they stay Pending (``PodScheduled`` False, ``Unschedulable``) until it is not, as in a cluster
with no room for them. A pod's ``startTime`` is when it is scheduled. Its containers start once the
Secrets and ConfigMaps their env names (``valueFrom.secretKeyRef``/``configMapKeyRef``) exist; until
then they wait in ``CreateContainerConfigError`` (``secret "x" not found``), as a kubelet makes them.
Deadlines are counted as Kubernetes counts them: the Job's ``activeDeadlineSeconds`` from the Job's
start (time Pending included; its pods are stopped, one not yet scheduled deleted, and the Job Failed
with reason DeadlineExceeded, no new pod); the pod template's from the pod's ``startTime``, after
which the kubelet makes the pod Failed (reason DeadlineExceeded) at once and stops its containers
(SIGTERM, SIGKILL after the pod's ``terminationGracePeriodSeconds``, here 2 s unless it says), and
the Job controller counts it as any failed pod (a new one under ``backoffLimit``).

A pod of several containers (a sidecar) runs each; it ends when all have (``restartPolicy: Never``),
Failed if any failed; container statuses are sorted by name, as a kubelet sorts them. The log
endpoint answers as the API server and kubelet do: ``container=`` picks one, and must be given when
the pod has several (400 ``a container name must be specified for pod P, choose one of: [a b]``);
an unknown one is 400; a pod not yet scheduled has an empty log, a container waiting to start a 400
(``... is waiting to start: CreateContainerConfigError``); a deleted pod 404.

An *indexed* Job (``completionMode: Indexed``) gets one pod per index at once, as the Job
controller makes them: the ``batch.kubernetes.io/job-completion-index`` label and annotation, the
``JOB_COMPLETION_INDEX`` env var, hostname ``<job>-<index>``. It completes when every index has
succeeded; the first failure beyond ``backoffLimit`` fails it and the others are stopped (SIGTERM,
SIGKILL after a grace period), and its Failed condition is written once all have ended. Services,
ConfigMaps and Secrets are stored (kmock serves them; a Secret's ``stringData`` is merged into its
base64 ``data``, as an API server does), and deleting a Job deletes the Services, ConfigMaps and
Secrets whose ``ownerReferences`` name its uid, as the garbage collector does (every created object
gets a ``uid`` and a ``creationTimestamp``, as from an API server); a pod whose ``subdomain`` names
a Service of its namespace gets the DNS names cluster DNS would give it
(``<hostname>.<subdomain>[.<ns>.svc[.cluster.local]]``): its main container joins this cluster's
own Docker network with those names as aliases.

Where the pod runs (``runtime``), as a kubelet would as far as the launcher can tell:

- ``docker`` (chosen when the engine is up and the test job image exists): a real
  container of the pod's image per container, ``command``/``args`` as entrypoint/cmd, env (its
  ``valueFrom`` resolved), workingDir,
  hostPath volumes as bind mounts, configMap volumes as read-only bind mounts of a folder holding
  the ConfigMap's keys as files (as the kubelet projects them), cpu/memory limits (so an OOM kill
  is ``OOMKilled``), the image's real id as ``imageID``. Without ``shareProcessNamespace`` the
  command is the container's PID 1, as in a pod (no default action for SIGTERM, orphans left as
  zombies); with it, Docker's init plays the pause container's part (PID 1, reaping orphans; the
  command gets the stop signal as an ordinary process). Manifests are then exercised the way a
  cluster would run them, not just accepted. A sidecar's container does not share the main one's
  network namespace, as in a pod it would.
- ``process`` (otherwise): each container's command as a local process in its own process group, with
  the manifest's env and workingDir and this machine's PATH; a process has no mounts of its own,
  so an argument under a configMap volume's ``mountPath`` is rewritten to that folder.

Authorization, when a test asks for it (:meth:`EmulatedCluster.rbac`, a Role's rules): each
namespaced request is mapped to RBAC's (API group, resource[/subresource], verb) as the API server
does (:func:`rbac_of`), and one the rules do not grant is refused with the API server's 403
``Forbidden`` Status; ``SelfSubjectAccessReview`` (``kubectl auth can-i``) answers from the same
rules. Without rules every request is allowed, as for a cluster admin.

A pod that mounts a ConfigMap that does not exist would wait in ``ContainerCreating`` on a real
node; here that is an error of the emulator (:attr:`EmulatedCluster.errors`, which the fixtures
assert empty), since every launcher path that makes such a pod is a bug.

The emulator's event loop runs in one thread and the controller in another; every read
or write of the emulator's objects is done on the loop thread.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime as dt
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import apps
from kmock._internal.references import resource

JOBS = resource("batch", "v1", "jobs")
PODS = resource("", "v1", "pods")
SERVICES = resource("", "v1", "services")
CONFIGMAPS = resource("", "v1", "configmaps")
SECRETS = resource("", "v1", "secrets")
#: What the garbage collector deletes once the owners its ``ownerReferences`` name are gone.
OWNED = (SERVICES, CONFIGMAPS, SECRETS)
NODE = "emulated-node"
#: What the scheduler says of a pod while the node is cordoned (:meth:`EmulatedCluster.cordon`).
UNSCHEDULABLE = (
    "0/1 nodes are available: 1 node(s) were unschedulable. preemption: 0/1 nodes are available: "
    "1 Preemption is not helpful for scheduling."
)
#: What a kubelet writes into a pod it stopped at its ``activeDeadlineSeconds`` (reason DeadlineExceeded).
POD_DEADLINE_MESSAGE = "Pod was active on the node longer than the specified deadline"
_LOG_PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<pod>[^/]+)/log$")
INDEX = "batch.kubernetes.io/job-completion-index"
#: Seconds between SIGTERM and SIGKILL when a failed Job stops its other pods (30 in Kubernetes).
GRACE_S = 2.0


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _quantity(text: str, *, cpu: bool = False) -> float | None:
    """A Kubernetes quantity (``1500m``, ``2``, ``1024Mi``, ``1G``) as cores or bytes; None if unreadable."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    raw = str(text).strip()
    try:
        if raw.endswith("m"):
            return float(raw[:-1]) / 1000
        for suffix in sorted(units, key=len, reverse=True):
            if raw.endswith(suffix) and not cpu:
                return float(raw[: -len(suffix)]) * units[suffix]
        return float(raw)
    except ValueError:
        return None


class _Workload:
    """The running part of a pod: a local process or a Docker container."""

    image_id: str | None = None
    oom_killed = False
    #: Why the container runtime could not start the command (a kubelet's ``StartError``), if so.
    start_error: str | None = None

    def termination_message(self) -> str | None:
        """What the container wrote to its termination message file (the kubelet's part), if any."""
        return None

    def poll(self) -> int | None:
        """Exit code once it has ended (128+N when killed by signal N), else None."""
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL everything of it and wait until it is gone."""
        raise NotImplementedError

    def terminate(self) -> None:
        """SIGTERM, as a kubelet's graceful stop; returns at once."""
        raise NotImplementedError

    def alive(self) -> bool:
        """Whether anything of it still runs, asked of the OS or the engine, not of our own bookkeeping."""
        raise NotImplementedError


class _Process(_Workload):
    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None, log: Path) -> None:
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
        with log.open("wb") as fh:
            try:
                self.proc = subprocess.Popen(
                    argv, stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=True
                )
            except OSError as exc:
                fh.write(f"exec failed: {exc}\n".encode())
                self.proc = subprocess.Popen(["false"])

    def poll(self) -> int | None:
        code = self.proc.poll()
        return None if code is None else (128 - code if code < 0 else code)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)

    def terminate(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return self.proc.poll() is None
        except ProcessLookupError:
            return False


class _Container(_Workload):
    """A pod's container on the real engine; its output is copied into the pod log file as it comes."""

    def __init__(
        self,
        client: Any,
        pod: str,
        container: dict[str, Any],
        pod_spec: dict[str, Any],
        log: Path,
        labels: dict[str, str],
        network: str | None = None,
        aliases: list[str] | None = None,
        sources: dict[str, Path] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        import docker.errors

        self.client, self.log, self.code = client, log, None
        self._done = threading.Event()
        self.container: Any = None
        volumes = {v["name"]: v["hostPath"]["path"] for v in pod_spec.get("volumes") or [] if v.get("hostPath")}
        binds = {
            volumes[m["name"]]: {"bind": m["mountPath"], "mode": "ro" if m.get("readOnly") else "rw"}
            for m in container.get("volumeMounts") or []
            if m.get("name") in volumes
        }
        for m in container.get("volumeMounts") or []:  # a configMap volume is read-only whatever the mount says
            if m.get("name") in (sources or {}):
                binds[str((sources or {})[m["name"]])] = {"bind": m["mountPath"], "mode": "ro"}
        # The kubelet's termination message: a file of the node's, mounted at terminationMessagePath,
        # read once the container ends (at most 4096 bytes) into the terminated state's ``message``.
        self.message_file = log.with_suffix(".termination-log")
        self.message_file.write_bytes(b"")
        self.message_file.chmod(0o666)
        binds[str(self.message_file)] = {
            "bind": container.get("terminationMessagePath") or "/dev/termination-log",
            "mode": "rw",
        }
        limits = (container.get("resources") or {}).get("limits") or {}
        kwargs: dict[str, Any] = {}
        if limits.get("memory") and _quantity(limits["memory"]):
            kwargs["mem_limit"] = int(_quantity(limits["memory"]) or 0)
            kwargs["memswap_limit"] = kwargs["mem_limit"]  # no swap: over the limit is an OOM kill, as on a node
        if limits.get("cpu") and _quantity(limits["cpu"], cpu=True):
            kwargs["nano_cpus"] = int((_quantity(limits["cpu"], cpu=True) or 0) * 1e9)
        if pod_spec.get("hostname"):
            kwargs["hostname"] = pod_spec["hostname"]
        if pod_spec.get("shareProcessNamespace"):  # the pause container is PID 1 (module docstring)
            kwargs["init"] = True
        if network is not None:  # cluster DNS: the names a headless Service gives the pod
            kwargs["network"] = network
            kwargs["networking_config"] = {network: client.api.create_endpoint_config(aliases=aliases or [])}
        try:
            image = client.images.get(container["image"])
            self.image_id = image.id
            self.container = client.containers.run(
                container["image"],
                entrypoint=container.get("command") or None,  # Kubernetes' command replaces the ENTRYPOINT...
                command=container.get("args") or None,  # ...and args the CMD
                environment=env or {},  # the kubelet's part: valueFrom resolved (EmulatedCluster._env)
                working_dir=container.get("workingDir"),
                volumes=binds,
                name=pod,
                labels=labels,
                detach=True,
                **kwargs,
            )
        except (docker.errors.ImageNotFound, docker.errors.APIError) as exc:
            explanation = getattr(exc, "explanation", None) or exc
            self.start_error = explanation.decode() if isinstance(explanation, bytes) else str(explanation)
            log.write_bytes(b"")  # the runtime's message is in the pod's status, as a kubelet reports it
            try:  # created but not started (e.g. no such executable): do not leave it behind
                client.containers.get(pod).remove(force=True)
            except docker.errors.APIError:
                pass
            self.code = 128  # what a kubelet reports for a StartError
            self._done.set()
            return
        log.touch()
        threading.Thread(target=self._follow, name=f"pod-{pod}", daemon=True).start()

    def _follow(self) -> None:
        """Copy the output into the log file, then record the exit: logs are complete when the pod ends."""
        try:
            with self.log.open("ab") as fh:
                for chunk in self.container.logs(stream=True, follow=True, stdout=True, stderr=True):
                    fh.write(chunk)
                    fh.flush()
            code = int(self.container.wait(timeout=30).get("StatusCode", 1))
            self.container.reload()
            self.oom_killed = bool(self.container.attrs.get("State", {}).get("OOMKilled"))
            if code == 127 and self.container.attrs.get("HostConfig", {}).get("Init"):
                code = self._not_started_under_init(code)
            self.code = code
        except Exception as exc:  # noqa: BLE001 - the engine went away: a failed pod, said in its log
            with self.log.open("ab") as fh:
                fh.write(f"lost the container: {exc}\n".encode())
            self.code = 128 + signal.SIGKILL
        finally:
            self._remove()  # before done: once the pod has ended, the engine has nothing of it left
            self._done.set()

    def _not_started_under_init(self, code: int) -> int:
        """Docker's init standing in for the pause container execs the command itself, and says so
        when it cannot (``[FATAL tini (7)] exec X failed: No such file or directory``, exit 127). In a
        pod the runtime execs the command and fails to start it: a ``StartError`` (exit 128) with
        runc's message and no log line. Tell it as a kubelet would."""
        lines = self.log.read_bytes().decode("utf-8", "replace").splitlines(keepends=True)
        fatal = [line for line in lines if line.startswith("[FATAL tini") and " exec " in line]
        found = re.search(r"exec (\S+) failed: No such file or directory", fatal[-1]) if fatal else None
        if found is None:
            return code
        self.log.write_text("".join(line for line in lines if line not in fatal))
        self.start_error = (
            "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create "
            f'failed: unable to start container process: exec: "{found.group(1)}": executable file not found in '
            "$PATH: unknown"
        )
        return 128

    def termination_message(self) -> str | None:
        try:
            text = self.message_file.read_bytes()[:4096].decode("utf-8", "replace")
        except OSError:
            return None
        return text or None

    def _remove(self) -> None:
        if self.container is not None:
            try:
                self.container.remove(force=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def poll(self) -> int | None:
        return self.code if self._done.is_set() else None

    def kill(self) -> None:
        if self.container is not None and not self._done.is_set():
            try:
                self.container.kill()
            except Exception:  # noqa: BLE001 - it ended meanwhile
                pass
        self._done.wait(30)
        self._remove()

    def terminate(self) -> None:
        if self.container is not None and not self._done.is_set():
            try:
                self.container.kill(signal="SIGTERM")
            except Exception:  # noqa: BLE001 - it ended meanwhile
                pass

    def alive(self) -> bool:
        if self.container is None:
            return False
        try:
            self.container.reload()
        except Exception:  # noqa: BLE001 - removed: nothing runs
            return False
        return self.container.status in ("created", "running", "restarting", "paused")


class _NotStarted(_Workload):
    """A pod's containers before they start (not scheduled, or a Secret they need is missing)."""

    def poll(self) -> int | None:
        return None

    def kill(self) -> None:
        pass

    def terminate(self) -> None:
        pass

    def alive(self) -> bool:
        return False


class _Pod(_Workload):
    """A pod's containers, each a workload of its own, by name; the first is the main one. Under
    ``restartPolicy: Never`` the pod has ended once every container has: a sidecar that runs on keeps
    it running, as in Kubernetes."""

    def __init__(self, parts: dict[str, _Workload], main: str) -> None:
        self.parts, self.main = parts, main

    @property  # type: ignore[override]
    def image_id(self) -> str | None:
        return self.parts[self.main].image_id

    @property  # type: ignore[override]
    def oom_killed(self) -> bool:
        return self.parts[self.main].oom_killed

    @property  # type: ignore[override]
    def start_error(self) -> str | None:
        return self.parts[self.main].start_error

    def termination_message(self) -> str | None:
        return self.parts[self.main].termination_message()

    def poll(self) -> int | None:
        """The main container's exit code once all have ended, else the first other's that failed."""
        codes = {name: part.poll() for name, part in self.parts.items()}
        if any(code is None for code in codes.values()):
            return None
        return codes[self.main] or next((code for code in codes.values() if code), 0)

    def kill(self) -> None:
        for part in self.parts.values():
            part.kill()

    def terminate(self) -> None:
        for part in self.parts.values():
            part.terminate()

    def alive(self) -> bool:
        return any(part.alive() for part in self.parts.values())


class _Run:
    """One pod of a Job: made Pending, then scheduled (its ``startTime``: a pod's
    ``activeDeadlineSeconds`` counts from it) and its containers started when they can be."""

    def __init__(self, pod: str, pod_spec: dict[str, Any], logs: dict[str, Path], deadline: float | None) -> None:
        self.pod, self.spec, self.logs, self.deadline = pod, pod_spec, logs, deadline
        self.workload: _Workload = _NotStarted()
        grace = pod_spec.get("terminationGracePeriodSeconds")
        self.grace = GRACE_S if grace is None else float(grace)
        self.created = _now()
        self.started: str | None = None  # when scheduled: the pod's startTime
        self.started_mono: float | None = None
        #: Why its containers wait to start once scheduled (CreateContainerConfigError), if they do.
        self.waiting: tuple[str, str] | None = None
        self.running = False  # its containers were started
        self.labels: dict[str, str] = {}  # of its Docker containers
        self.finished = False
        self.deadline_hit = False  # stopped at its own activeDeadlineSeconds (the kubelet's part)
        #: Set by an eviction: the DisruptionTarget condition, and when the grace period ends.
        self.disruption: dict[str, str] | None = None
        self.kill_at: float | None = None
        #: Pods of this Job that failed before this one (backoffLimit retries), and when the
        #: controller creates the next pod after this one fails (None: no retry due).
        self.failed_before = 0
        self.retry_at: float | None = None
        self.index: int | None = None  # of an indexed Job's pod
        self.code: int | None = None

    @property
    def main(self) -> str:
        return str(self.spec["containers"][0]["name"])


def docker_runtime() -> tuple[Any, str | None, str]:
    """``(client, job image, why not)``: the engine and image pods run on, or why they cannot.

    Uses the services helpers' view (services.env, then a live probe), so the emulator
    agrees with the docker tests about whether the engine is up.
    """
    from tests import services

    declared = services.setting("OPENLAB_TEST_DOCKER")
    if declared in ("0", "false", "no"):
        return None, None, f"docker marked down: {services.setting('OPENLAB_TEST_DOCKER_REASON') or 'no reason'}"
    client, problem = services._docker_probe()
    if client is None:
        return None, None, problem
    image = services.setting("OPENLAB_TEST_DOCKER_JOB_IMAGE") or "openlab/job:latest"
    try:
        client.images.get(image)
    except Exception as exc:  # noqa: BLE001
        return None, None, f"job image {image} missing: {exc}"
    return client, image, ""


class _NotReady(Exception):
    """What a container needs to start is not there yet (a Secret): it waits, as a kubelet makes it."""


def _failed(reason: str, now: str) -> dict[str, str]:
    """A Job's Failed condition."""
    return {
        "type": "Failed",
        "status": "True",
        "reason": reason,
        "message": f"Job failed: {reason}",
        "lastTransitionTime": now,
    }


#: HTTP methods that write, as RBAC names them (a GET is ``get``, ``list`` or ``watch``).
WRITES = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
#: Who the client is to the API server, in its 403 messages.
USER = "system:serviceaccount:default:openlab"
ACCESS_REVIEW = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


def rbac_of(method: str, path: str, params: dict[str, str]) -> tuple[str, str, str]:
    """The (API group, resource[/subresource], verb) that RBAC checks for one namespaced request."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if rest[:1] != ["namespaces"]:
        raise ValueError(f"not a namespaced request: {path}")
    resource, name, sub = (rest[2:] + [None, None])[:3]
    if sub:
        resource = f"{resource}/{sub}"
    verb = WRITES.get(method) or ("get" if name else "watch" if params.get("watch") == "true" else "list")
    return group, str(resource), verb


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason}
    return aiohttp.web.json_response({**body, "code": code}, status=code)


#: requests kmock keeps to match a new one against (more than are ever in flight at once)
_KEPT_REQUESTS = 16


class _ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator, plus what every API server writes into an object it creates: a
    ``metadata.uid`` (what ``ownerReferences`` name) and a ``creationTimestamp``; a Secret's
    ``stringData`` merged into its base64 ``data``; pod logs as a kubelet serves them, by container
    (:meth:`_pod_log`); and RBAC when :attr:`rules` is set (module docstring)."""

    rules: frozenset[tuple[str, str, str]] | None = None
    #: (HTTP method, path, query) of every request, in order (EmulatedCluster sets it; :meth:`EmulatedCluster.requests`)
    answered: list[tuple[str, str, dict[str, str]]]
    #: Each pod's containers' log files, by (namespace, pod) and container name (EmulatedCluster fills it).
    logs: dict[tuple[str, str], dict[str, Path]]

    def _pod_log(self, ns: str, name: str, params: dict[str, str]) -> aiohttp.web.Response:
        """``GET .../pods/NAME/log`` as the API server and kubelet answer it: the named container's log
        (``container=``), which must be named when the pod has several (400, as the API server says
        it); empty before the pod is on a node; 400 while the container waits to start."""
        key = (PODS, ns, name)
        obj = self.objects[key] if key in self.objects else None
        if obj is None or obj.deleted:
            return _status(404, "NotFound", f'pods "{name}" not found')
        pod = obj.last.raw
        names = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        container = params.get("container")
        if not container:
            if len(names) != 1:
                return _status(
                    400,
                    "BadRequest",
                    f"a container name must be specified for pod {name}, choose one of: [{' '.join(names)}]",
                )
            container = names[0]
        elif container not in names:
            return _status(400, "BadRequest", f"container {container} is not valid for pod {name}")
        if not (pod.get("spec") or {}).get("nodeName"):
            return aiohttp.web.Response(body=b"")  # not scheduled: no kubelet to ask, an empty log
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting")
            if cs.get("name") == container and waiting is not None:
                return _status(
                    400,
                    "BadRequest",
                    f'container "{container}" in pod "{name}" is waiting to start: {waiting.get("reason")}',
                )
        path = (self.logs.get((ns, name)) or {}).get(container)
        text = path.read_text(errors="replace") if path is not None and path.exists() else ""
        if params.get("tailLines"):
            text = "".join(text.splitlines(keepends=True)[-int(params["tailLines"]) :])
        return aiohttp.web.Response(body=text.encode(), content_type="text/plain")

    def _allowed(self, group: str, resource: str, verb: str) -> bool:
        return self.rules is None or (group, resource, verb) in self.rules

    async def _handle(self, request: Any) -> Any:
        method, path = str(request.method.value).upper(), request.url.path
        self.answered.append((method, path, dict(request.params)))
        # kmock finds each request's reaction by walking every request it has kept, so a session's cluster
        # answered slower with each request (the indexed-Job tests spent half their time there); it keeps the
        # last few (those in flight), and requests() reads ``answered``
        del self._requests[:-_KEPT_REQUESTS]
        if method == "POST" and path == ACCESS_REVIEW:
            spec = (request.data or {}).get("spec") or {}
            attrs = spec.get("resourceAttributes") or {}
            resource = attrs.get("resource", "") + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
            allowed = self._allowed(attrs.get("group", ""), resource, attrs.get("verb", ""))
            review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview", "spec": spec}
            return aiohttp.web.json_response({**review, "status": {"allowed": allowed}}, status=201)
        if self.rules is not None and "/namespaces/" in path:
            group, resource, verb = rbac_of(method, path, dict(request.params))
            if not self._allowed(group, resource, verb):
                ns = path.split("/namespaces/", 1)[1].split("/", 1)[0]
                kind = resource.split("/")[0] + (f".{group}" if group else "")
                return _status(
                    403,
                    "Forbidden",
                    f'{kind} is forbidden: User "{USER}" cannot {verb} resource "{resource}" '
                    f'in API group "{group}" in the namespace "{ns}"',
                )
        if method == "GET" and (found := _LOG_PATH.match(path)):
            return self._pod_log(found["ns"], found["pod"], dict(request.params))
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta["uid"] = str(uuid.uuid4())
            meta.setdefault("creationTimestamp", dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            if path.endswith("/secrets"):  # stringData is write-only: merged into data, base64
                strings = request.data.pop("stringData", None) or {}
                data = request.data.setdefault("data", {})
                data.update({k: base64.b64encode(str(v).encode()).decode() for k, v in strings.items()})
                request.data.setdefault("type", "Opaque")
        return await super()._handle(request)


class EmulatedCluster:
    """Start with :meth:`start`, stop with :meth:`stop`; :attr:`url` is the API server.

    ``runtime`` is ``"auto"`` (docker when :func:`docker_runtime` finds the engine and job
    image, else process), ``"docker"`` or ``"process"``; :attr:`runtime` says which one
    runs, :attr:`runtime_reason` why docker was not used, and :attr:`image` is the image
    jobs should name (the test job image under docker).
    """

    def __init__(self, runtime: str = "auto") -> None:
        self.docker: Any = None
        self.image = "openlab/job:latest"
        self.runtime_reason = ""
        if runtime in ("auto", "docker"):
            self.docker, image, self.runtime_reason = docker_runtime()
            if self.docker is None and runtime == "docker":
                raise RuntimeError(f"docker runtime requested but unavailable: {self.runtime_reason}")
            self.image = image or self.image
        elif runtime != "process":
            raise ValueError(f"runtime must be auto, docker or process, not {runtime!r}")
        self.runtime = "docker" if self.docker is not None else "process"
        self.id = uuid.uuid4().hex[:8]  # labels this cluster's containers, so stop() finds every one
        self.url = ""
        self.km: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        #: The current pod run of each index of each Job (one, for a plain Job), and runs of deleted
        #: Jobs (still asked whether anything lives).
        self._runs: dict[tuple[str, str], list[_Run]] = {}
        self._ended: dict[tuple[str, str], list[_Run]] = {}
        self._settled: set[tuple[str, str]] = set()  # Jobs whose final condition is written
        self._job_status: dict[tuple[str, str], dict[str, Any]] = {}  # an indexed Job's counts, as last written
        self._job_started: dict[tuple[str, str], float] = {}  # a Job's startTime (monotonic): its deadline's
        #: Whether the one node is cordoned (:meth:`cordon`): new pods are not scheduled meanwhile.
        self.cordoned = False
        self._network: str | None = None  # this cluster's Docker network, made for the first pod DNS asks for
        self._logdir = Path(tempfile.mkdtemp(prefix="k8s-emulator-"))
        self.errors: list[BaseException] = []

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> EmulatedCluster:
        self._server = threading.Thread(target=self._serve, name="kmock", daemon=True)
        self._server.start()
        if not self._ready.wait(15):
            raise RuntimeError("kmock emulator did not start")
        self._controller = threading.Thread(target=self._control, name="k8s-controller", daemon=True)
        self._controller.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if hasattr(self, "_controller"):
            self._controller.join(5)
        for runs in list(self._runs.values()):
            for run in runs:
                run.workload.kill()
        for container in self.containers():  # anything that slipped past the bookkeeping
            container.remove(force=True)
        if self._network is not None:
            try:
                self.docker.networks.get(self._network).remove()
            except Exception:  # noqa: BLE001 - already gone
                pass
        # Wait for the server to shut down here: kmock swaps a process-wide aiohttp resolver in and
        # out, so two emulators must leave in the reverse order they came (a module's cluster
        # before the session's); leaving it to the server thread let the second overtake the first.
        if hasattr(self, "_server"):
            self._server.join(15)

    def _serve(self) -> None:
        async def main() -> None:
            async with _ApiServer() as km, apps.Server(km, host="127.0.0.1") as server:
                km.resources["v1/pods"] = {}
                km.resources["batch/v1/jobs"] = {}
                km.resources["v1/services"] = {}
                km.resources["v1/configmaps"] = {}
                km.resources["v1/secrets"] = {}
                km.logs = {}
                km.answered = []
                self.km, self._loop = km, asyncio.get_running_loop()
                self.url = str(server.url).rstrip("/")
                self._ready.set()
                # woken by stop() rather than polling: an idle cluster lives the whole session
                await asyncio.to_thread(self._stop.wait)

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001
            self.errors.append(exc)
            self._ready.set()

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the emulator's loop thread and return its result."""
        assert self._loop is not None

        async def call() -> Any:
            return fn()

        coro = call()
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop has closed (the emulator stopped): no "never awaited" warning
            coro.close()
            raise
        try:  # the loop answers the API too: on a loaded machine it can be busy for seconds
            return future.result(60)
        except TimeoutError:
            future.cancel()  # not left to run after the emulator stops ("never awaited")
            raise

    # -- objects -----------------------------------------------------------------------
    def jobs(self) -> dict[tuple[str, str], dict[str, Any]]:
        def read() -> dict[tuple[str, str], dict[str, Any]]:
            out = {}
            for key, obj in list(self.km.objects.items()):
                if key[0] == JOBS and not obj.deleted:
                    out[(key[1], key[2])] = copy.deepcopy(dict(obj.last.raw))
            return out

        return self.on_loop(read)

    def pods(self) -> list[tuple[str, str]]:
        return self.on_loop(
            lambda: [(k[1], k[2]) for k, obj in list(self.km.objects.items()) if k[0] == PODS and not obj.deleted]
        )

    def pod_phases(self) -> dict[tuple[str, str], str]:
        def read() -> dict[tuple[str, str], str]:
            return {
                (k[1], k[2]): (obj.last.raw.get("status") or {}).get("phase", "Pending")
                for k, obj in list(self.km.objects.items())
                if k[0] == PODS and not obj.deleted
            }

        return self.on_loop(read)

    def _patch(self, res: Any, ns: str, name: str, status: dict[str, Any], spec: dict[str, Any] | None = None) -> None:
        def write() -> None:
            key = (res, ns, name)
            if key not in self.km.objects or self.km.objects[key].deleted:
                return
            self.km.objects[key].patch({"status": status, **({"spec": spec} if spec else {})})

        self.on_loop(write)

    # -- the controller -----------------------------------------------------------------
    def _control(self) -> None:
        while not self._stop.is_set():
            try:
                self._reconcile()
            except BaseException as exc:  # noqa: BLE001 - surfaced by the fixture
                if not self._stop.is_set():
                    self.errors.append(exc)
            time.sleep(0.05)

    def _reconcile(self) -> None:
        jobs = self.jobs()
        for key, job in jobs.items():
            if key not in self._runs:
                try:
                    self._start_job(key, job)
                except RuntimeError:
                    if key in self.jobs():  # a pod of a live Job without what it mounts: openlab's fault
                        raise
                    # deleted (with what it mounts) while its first pod was being made, as a submit that
                    # was cut short withdraws it: the kubelet would drop the pod with its Job, no error
                    self._runs.pop(key, None)
            elif job["spec"].get("completionMode") == "Indexed":
                self._watch_indexed(key, job)
            else:
                self._watch(key, job)
        for key in [k for k in self._runs if k not in jobs]:  # deleted Jobs
            runs = self._runs.pop(key)
            self._ended[key] = runs
            for run in runs:
                run.workload.kill()
                self._delete_pod(key[0], run.pod)
        self._collect_orphans()

    def _delete_pod(self, ns: str, pod: str) -> None:
        def delete() -> None:
            key = (PODS, ns, pod)
            if key in self.km.objects and not self.km.objects[key].deleted:
                del self.km.objects[key]

        self.on_loop(delete)

    def _collect_orphans(self) -> None:
        """The garbage collector's part: delete a Service, ConfigMap or Secret whose owners in
        ``ownerReferences`` are all gone, whether or not the controller ever saw them (a Job deleted
        before it started). Jobs and owned objects are read in one step on the server's loop, so an
        owner created meanwhile counts."""

        def collect() -> None:
            objects = list(self.km.objects.items())
            live = {
                str((obj.last.raw.get("metadata") or {}).get("uid"))
                for key, obj in objects
                if key[0] == JOBS and not obj.deleted
            }
            for key, obj in objects:
                if key[0] not in OWNED or obj.deleted:
                    continue
                owners = (obj.last.raw.get("metadata") or {}).get("ownerReferences") or []
                if owners and not any(str(o.get("uid")) in live for o in owners):
                    del self.km.objects[key]

        self.on_loop(collect)

    @contextmanager
    def rbac(self, rules: set[tuple[str, str, str]] | frozenset[tuple[str, str, str]]) -> Iterator[None]:
        """While inside, the API server allows only ``rules`` ((API group, resource, verb) triples,
        as a Role grants them) and refuses the rest with 403 (module docstring)."""
        self.km.rules = frozenset(rules)
        try:
            yield
        finally:
            self.km.rules = None

    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        """Every request the API server has answered, as (HTTP method, path, query): what a client
        (the launcher) asked of it; the controller's own reads and writes do not go over HTTP."""

        return self.on_loop(lambda: list(self.km.answered))

    def cordon(self) -> None:
        """As ``kubectl cordon`` on the one node: pods made from now on stay Pending, not scheduled
        (``PodScheduled`` False, ``Unschedulable``), as while a cluster has no room for them, until
        :meth:`uncordon`. Pods already on the node run on."""
        self.cordoned = True

    def uncordon(self) -> None:
        self.cordoned = False

    def secrets(self) -> list[tuple[str, str]]:
        return self.on_loop(
            lambda: [(k[1], k[2]) for k, obj in list(self.km.objects.items()) if k[0] == SECRETS and not obj.deleted]
        )

    def secret(self, ns: str, name: str) -> dict[str, Any] | None:
        """A stored Secret as the API serves it (None when there is none)."""

        def read() -> dict[str, Any] | None:
            key = (SECRETS, ns, name)
            obj = self.km.objects[key] if key in self.km.objects else None
            return None if obj is None or obj.deleted else copy.deepcopy(dict(obj.last.raw))

        return self.on_loop(read)

    def _env(self, ns: str, container: dict[str, Any]) -> dict[str, str]:
        """The kubelet's part for a container's env: ``value`` as it is, ``valueFrom.secretKeyRef`` (base64
        decoded) and ``configMapKeyRef`` from the object they name. One that is missing (not
        ``optional``) is :class:`_NotReady`: the container waits in ``CreateContainerConfigError``."""
        env: dict[str, str] = {}
        for entry in container.get("env") or []:
            source = entry.get("valueFrom")
            if source is None:
                env[entry["name"]] = str(entry.get("value", ""))
                continue
            ref = source.get("secretKeyRef") or source.get("configMapKeyRef")
            if ref is None:
                raise RuntimeError(f"the emulator does not resolve env valueFrom {sorted(source)} ({entry['name']})")
            secret = "secretKeyRef" in source
            obj = self.secret(ns, ref["name"]) if secret else self.configmap(ns, ref["name"])
            data = ((obj or {}).get("data") or {}) if obj is not None else None
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                kind = "Secret" if secret else "ConfigMap"
                raise _NotReady(
                    f'{kind.lower()} "{ref["name"]}" not found'
                    if data is None
                    else f"couldn't find key {ref['key']} in {kind} {ns}/{ref['name']}"
                )
            value = data[ref["key"]]
            env[entry["name"]] = base64.b64decode(value).decode() if secret else str(value)
        return env

    def configmaps(self) -> list[tuple[str, str]]:
        return self.on_loop(
            lambda: [(k[1], k[2]) for k, obj in list(self.km.objects.items()) if k[0] == CONFIGMAPS and not obj.deleted]
        )

    def configmap(self, ns: str, name: str) -> dict[str, Any] | None:
        """A stored ConfigMap as the API serves it (None when there is none)."""

        def read() -> dict[str, Any] | None:
            key = (CONFIGMAPS, ns, name)
            obj = self.km.objects[key] if key in self.km.objects else None
            return None if obj is None or obj.deleted else copy.deepcopy(dict(obj.last.raw))

        return self.on_loop(read)

    def _project(self, ns: str, pod: str, pod_spec: dict[str, Any]) -> dict[str, Path]:
        """The kubelet's part for configMap volumes: each volume's ConfigMap keys as files in a folder
        of their own (mode ``defaultMode``), by volume name. A ConfigMap that does not exist is an
        emulator error (see the module docstring)."""
        sources: dict[str, Path] = {}
        for volume in pod_spec.get("volumes") or []:
            ref = volume.get("configMap")
            if not ref:
                continue
            data = (self.configmap(ns, ref["name"]) or {}).get("data")
            if data is None:
                raise RuntimeError(f"pod {ns}/{pod} mounts ConfigMap {ref['name']}, which does not exist")
            folder = self._logdir / f"{ns}-{pod}-{volume['name']}"
            folder.mkdir()
            for key, text in data.items():
                (folder / key).write_text(text)
                (folder / key).chmod(int(ref.get("defaultMode", 0o644)))
            sources[volume["name"]] = folder
        return sources

    def services(self) -> list[tuple[str, str]]:
        return self.on_loop(
            lambda: [(k[1], k[2]) for k, obj in list(self.km.objects.items()) if k[0] == SERVICES and not obj.deleted]
        )

    def service(self, ns: str, name: str) -> dict[str, Any] | None:
        """A stored Service as the API serves it (None when there is none)."""

        def read() -> dict[str, Any] | None:
            obj = self.km.objects[(SERVICES, ns, name)] if (SERVICES, ns, name) in self.km.objects else None
            return None if obj is None or obj.deleted else copy.deepcopy(dict(obj.last.raw))

        return self.on_loop(read)

    def _dns(self, ns: str, pod_spec: dict[str, Any]) -> tuple[str | None, list[str]]:
        """The Docker network and names a pod gets from cluster DNS: a hostname in the ``subdomain``
        of a headless Service of its namespace (none without that Service, as in a cluster)."""
        host, sub = pod_spec.get("hostname"), pod_spec.get("subdomain")
        if self.docker is None or not host or not sub or (ns, sub) not in self.services():
            return None, []
        if self._network is None:
            self._network = f"openlab-k8s-{self.id}"
            self.docker.networks.create(self._network, labels={"openlab-test.emulator": self.id})
        short = f"{host}.{sub}"
        return self._network, [short, f"{short}.{ns}.svc", f"{short}.{ns}.svc.cluster.local"]

    def _start_job(self, key: tuple[str, str], job: dict[str, Any]) -> None:
        """The Job controller's first pods: one, or one per index of an indexed Job. The Job's
        ``startTime`` is now, whether or not its pods can be scheduled: a Job-level
        ``activeDeadlineSeconds`` counts the time they wait."""
        self._job_started[key] = time.monotonic()
        if job["spec"].get("completionMode") == "Indexed":
            count = int(job["spec"].get("completions") or 1)
            self._runs[key] = [self._start_pod(key, job, index=i) for i in range(count)]
        else:
            self._runs[key] = [self._start_pod(key, job)]
        runs = self._runs[key]
        ready = sum(1 for r in runs if r.running)
        self._patch(JOBS, *key, {"active": len(runs), "ready": ready, "startTime": _now()})

    def _start_pod(self, key: tuple[str, str], job: dict[str, Any], index: int | None = None) -> _Run:
        """A new pod of the Job, as its controller makes it from the template (labels and annotations
        included), started at once where it can be (:meth:`_schedule`)."""
        ns, name = key
        template = job["spec"]["template"]
        pod_spec = copy.deepcopy(template["spec"])
        meta = template.get("metadata") or {}
        labels = {**(meta.get("labels") or {}), "job-name": name, "batch.kubernetes.io/job-name": name}
        annotations: dict[str, str] = dict(meta.get("annotations") or {})
        if index is not None:  # what the Job controller gives an indexed Job's pods
            labels[INDEX] = annotations[INDEX] = str(index)
            for container in pod_spec["containers"]:
                env = [e for e in container.get("env") or [] if e.get("name") != "JOB_COMPLETION_INDEX"]
                container["env"] = [*env, {"name": "JOB_COMPLETION_INDEX", "value": str(index)}]
            pod_spec.setdefault("hostname", f"{name}-{index}")
            pod = f"{name}-{index}-{uuid.uuid4().hex[:5]}"
        else:
            pod = f"{name}-{uuid.uuid4().hex[:5]}"
        logs = {c["name"]: self._logdir / f"{ns}-{pod}-{c['name']}.log" for c in pod_spec["containers"]}
        deadline = pod_spec.get("activeDeadlineSeconds")
        run = _Run(pod, pod_spec, logs, float(deadline) if deadline else None)
        run.index = index
        run.labels = {"openlab-test.emulator": self.id, "openlab-test.pod": f"{ns}/{pod}"}
        self._schedule(key, run)
        spec = {**pod_spec, **({"nodeName": NODE} if run.started else {})}
        pod_obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod,
                "namespace": ns,
                "labels": labels,
                "creationTimestamp": run.created,
                **({"annotations": annotations} if annotations else {}),
            },
            "spec": spec,
            "status": self._pod_status(run),
        }

        def create() -> None:
            # The log files first: a pod the launcher can see has them, as with a kubelet.
            self.km.logs[(ns, pod)] = logs
            self.km.objects[(PODS, ns, pod)] = pod_obj

        self.on_loop(create)
        return run

    def _schedule(self, key: tuple[str, str], run: _Run, *, patch: bool = False) -> None:
        """The scheduler's and the kubelet's part for a pod that does not run yet: onto the node unless
        it is cordoned (then ``startTime``, from which the pod's own ``activeDeadlineSeconds`` counts),
        then its containers, once what their env names exists (else they wait in
        ``CreateContainerConfigError``, retried on every pass). ``patch``: write what changed."""
        ns, _ = key
        if run.started is None:
            if self.cordoned:
                return
            run.started, run.started_mono = _now(), time.monotonic()
            if patch:
                self._patch(PODS, ns, run.pod, self._pod_status(run), {"nodeName": NODE})
        try:
            envs = {c["name"]: self._env(ns, c) for c in run.spec["containers"]}
        except _NotReady as exc:
            if run.waiting != ("CreateContainerConfigError", str(exc)):
                run.waiting = ("CreateContainerConfigError", str(exc))
                if patch:
                    self._patch(PODS, ns, run.pod, self._pod_status(run))
            return
        run.waiting = None
        for volume in run.spec.get("volumes") or []:  # the kubelet's part for hostPath volumes
            host_path = volume.get("hostPath") or {}
            if host_path.get("type") == "DirectoryOrCreate":
                Path(host_path["path"]).mkdir(parents=True, exist_ok=True)
        sources = self._project(ns, run.pod, run.spec)
        network, aliases = self._dns(ns, run.spec) if self.docker is not None else (None, [])
        parts: dict[str, _Workload] = {}
        for container in run.spec["containers"]:
            log, cname = run.logs[container["name"]], container["name"]
            if self.docker is not None:
                docker_name = run.pod if cname == run.main else f"{run.pod}-{cname}"
                parts[cname] = _Container(
                    self.docker,
                    docker_name,
                    container,
                    run.spec,
                    log,
                    run.labels,
                    network,
                    aliases if cname == run.main else [],  # the pod's DNS names reach its main container
                    sources,
                    envs[cname],
                )
            else:
                argv = container.get("command", []) + container.get("args", [])
                for mount in container.get("volumeMounts") or []:  # no mounts for a process: point at the folder
                    if mount.get("name") in sources:
                        at = mount["mountPath"].rstrip("/")
                        here = str(sources[mount["name"]])
                        argv = [here + a[len(at) :] if a == at or a.startswith(at + "/") else a for a in argv]
                parts[cname] = _Process(argv, envs[cname], container.get("workingDir"), log)
        run.workload = _Pod(parts, run.main)
        run.running = True
        if patch:
            self._patch(PODS, ns, run.pod, self._pod_status(run))

    def _image_id(self, workload: _Workload) -> str:
        return f"docker://{workload.image_id}" if workload.image_id else f"docker-pullable://x@sha256:{'0' * 64}"

    def _pod_status(self, run: _Run) -> dict[str, Any]:
        """A pod's status as a kubelet reports it before it ends: Pending and unschedulable, Pending
        with its containers waiting, or Running (container statuses sorted by name, as a kubelet
        sorts them)."""
        if run.started is None:
            return {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": UNSCHEDULABLE,
                        "lastTransitionTime": run.created,
                    }
                ],
            }
        scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": run.started}
        statuses = []
        for container in sorted(run.spec["containers"], key=lambda c: c["name"]):
            if run.running:
                part = run.workload.parts[container["name"]]  # type: ignore[attr-defined]
                image_id, state = self._image_id(part), {"running": {"startedAt": run.started}}
            else:
                reason, message = run.waiting or ("ContainerCreating", "")
                image_id, state = "", {"waiting": {"reason": reason, **({"message": message} if message else {})}}
            statuses.append(
                {
                    "name": container["name"],
                    "image": container["image"],
                    "imageID": image_id,
                    "ready": run.running,
                    "restartCount": 0,
                    "state": state,
                }
            )
        return {
            "phase": "Running" if run.running else "Pending",
            "startTime": run.started,
            "conditions": [scheduled, *([run.disruption] if run.disruption else [])],
            "containerStatuses": statuses,
        }

    def evict(self, job_id: str, reason: str = "EvictionByEvictionAPI", grace: float = 2.0, index: int = 0) -> None:
        """Evict the pod of Job ``namespace/name`` (of its ``index``, for an indexed Job) as the
        Eviction API (or the scheduler preempting it, reason ``PreemptionByScheduler``) does: the pod
        gets the ``DisruptionTarget`` condition, its container SIGTERM, and SIGKILL if it still runs
        ``grace`` seconds later."""
        ns, name = job_id.split("/", 1)
        runs = self._runs[(ns, name)]
        run = next((r for r in runs if r.index == index), runs[0])
        messages = {
            "EvictionByEvictionAPI": "Eviction API: evicting",
            "PreemptionByScheduler": "default-scheduler: preempting to accommodate a higher priority pod",
        }
        run.disruption = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": reason,
            "message": messages.get(reason, reason),
            "lastTransitionTime": _now(),
        }
        self._patch(PODS, ns, run.pod, {"phase": "Running", "conditions": [run.disruption]})
        run.kill_at = time.monotonic() + grace
        run.workload.terminate()

    def _ended_now(self, key: tuple[str, str], run: _Run) -> int | None:
        """The run's exit code if its workload has ended (the kubelet's part: its own deadline and
        grace period kills), else None. At the pod's ``activeDeadlineSeconds``, counted from its
        ``startTime``, the kubelet makes it Failed (reason DeadlineExceeded) at once and stops its
        containers as in a graceful kill: SIGTERM, SIGKILL after the pod's grace period."""
        now = time.monotonic()
        if (
            run.deadline
            and not run.deadline_hit
            and run.started_mono is not None
            and now - run.started_mono > run.deadline
            and run.workload.poll() is None
        ):
            run.deadline_hit = True
            status = {"phase": "Failed", "reason": "DeadlineExceeded", "message": POD_DEADLINE_MESSAGE}
            self._patch(PODS, key[0], run.pod, status)
            run.kill_at = now + run.grace
            run.workload.terminate()
        if run.kill_at is not None and now > run.kill_at and run.workload.poll() is None:
            run.workload.kill()  # the grace period is over
        return run.workload.poll()

    def _record_end(self, key: tuple[str, str], job: dict[str, Any], run: _Run, code: int) -> str:
        """Write an ended pod's status (phase, each container's terminated state); return the time."""
        run.finished, run.code = True, code
        now = _now()
        statuses = []
        for container in sorted(run.spec["containers"], key=lambda c: c["name"]):
            part = run.workload.parts[container["name"]]  # type: ignore[attr-defined]
            exit_code = part.poll()
            exit_code = 128 + signal.SIGKILL if exit_code is None else exit_code
            terminated = {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "startedAt": run.started,
                "finishedAt": now,
            }
            message = part.termination_message()
            if message:
                terminated["message"] = message
            if part.start_error is not None:  # what a kubelet reports when the runtime could not start it
                terminated["reason"], terminated["message"] = "StartError", part.start_error
            if part.oom_killed:
                terminated["reason"] = "OOMKilled"
            statuses.append(
                {
                    "name": container["name"],
                    "image": container["image"],
                    "imageID": self._image_id(part),
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            )
        failed = code != 0 or run.deadline_hit  # a pod the kubelet stopped at its deadline failed, whatever its exit
        pod_status: dict[str, Any] = {
            "phase": "Failed" if failed else "Succeeded",
            "startTime": run.started,
            **({"conditions": [run.disruption]} if run.disruption else {}),
            "containerStatuses": statuses,
        }
        if run.deadline_hit:
            pod_status.update(reason="DeadlineExceeded", message=POD_DEADLINE_MESSAGE)
        self._patch(PODS, key[0], run.pod, pod_status)
        return now

    def _past_job_deadline(self, key: tuple[str, str], job: dict[str, Any]) -> bool:
        """Whether the Job's own ``activeDeadlineSeconds`` has passed, counted from its startTime
        (so the time its pods waited to be scheduled counts)."""
        limit = job["spec"].get("activeDeadlineSeconds")
        return bool(limit) and time.monotonic() - self._job_started[key] > float(limit)

    def _fail_at_job_deadline(self, key: tuple[str, str], job: dict[str, Any]) -> None:
        """The Job controller at a Job's deadline: every pod of it stopped (a pod not yet on a node is
        deleted), no new one, and the Failed condition with reason DeadlineExceeded."""
        self._settled.add(key)
        runs = self._runs[key]
        for run in runs:
            run.retry_at = None
            if run.finished:
                continue
            if not run.running:
                run.finished = True
                self._delete_pod(key[0], run.pod)
                continue
            run.workload.kill()
            self._record_end(key, job, run, run.workload.poll() or 128 + signal.SIGKILL)
        failed = sum(1 for r in runs if r.code) + max((r.failed_before for r in runs), default=0)
        self._patch(
            JOBS, *key, {"active": 0, "ready": 0, "failed": failed, "conditions": [_failed("DeadlineExceeded", _now())]}
        )

    def _watch(self, key: tuple[str, str], job: dict[str, Any]) -> None:
        if key in self._settled:
            return
        if self._past_job_deadline(key, job):
            self._fail_at_job_deadline(key, job)
            return
        (run,) = self._runs[key]
        if run.finished:
            if run.retry_at is not None and time.monotonic() >= run.retry_at:  # the Job controller's next pod
                run.retry_at = None
                new = self._start_pod(key, job)
                new.failed_before = run.failed_before + 1
                self._runs[key] = [new]
                self._patch(JOBS, *key, {"active": 1, "ready": int(new.running)})
            return
        if not run.running:
            self._schedule(key, run, patch=True)
            if run.running:
                self._patch(JOBS, *key, {"ready": 1})
            return
        ns, name = key
        code = self._ended_now(key, run)
        if code is None:
            return
        now = self._record_end(key, job, run, code)
        if code == 0 and not run.deadline_hit:
            self._settled.add(key)
            cond = {"type": "Complete", "status": "True", "lastTransitionTime": now}
            self._patch(
                JOBS, ns, name, {"active": 0, "ready": 0, "succeeded": 1, "completionTime": now, "conditions": [cond]}
            )
        elif run.failed_before + 1 <= int(job["spec"].get("backoffLimit", 6)):
            # The Job controller replaces a failed pod until backoffLimit failures, one its kubelet stopped
            # at its own activeDeadlineSeconds too: a new pod, a new name, after a back-off (10 s and
            # doubling in Kubernetes; 1.1 s here, so that the new pod's creationTimestamp, which has
            # whole seconds, sorts after the old one's)
            self._patch(JOBS, ns, name, {"active": 0, "ready": 0, "failed": run.failed_before + 1})
            run.retry_at = time.monotonic() + 1.1
        else:
            self._settled.add(key)
            self._patch(
                JOBS,
                ns,
                name,
                {
                    "active": 0,
                    "ready": 0,
                    "failed": run.failed_before + 1,
                    "conditions": [_failed("BackoffLimitExceeded", now)],
                },
            )

    def _watch_indexed(self, key: tuple[str, str], job: dict[str, Any]) -> None:
        """An indexed Job: count its pods' ends; past ``backoffLimit`` failures stop the rest, and once
        none runs write Complete or Failed (its deadline: :meth:`_fail_at_job_deadline`). Failed pods are
        not replaced here beyond what backoffLimit 0 needs (openlab's several-node Jobs ask for 0)."""
        if key in self._settled:
            return
        if self._past_job_deadline(key, job):
            self._fail_at_job_deadline(key, job)
            return
        runs = self._runs[key]
        for run in runs:
            if run.finished:
                continue
            if not run.running:
                self._schedule(key, run, patch=True)
                continue
            code = self._ended_now(key, run)
            if code is not None:
                self._record_end(key, job, run, code)
        failed = [r for r in runs if r.finished and (r.code or r.deadline_hit)]
        if len(failed) > int(job["spec"].get("backoffLimit", 6)) and not any(r.kill_at for r in runs if not r.finished):
            for r in runs:  # the Job failed: Kubernetes stops its other pods (one not yet on a node is deleted)
                if r.finished:
                    continue
                if not r.running:
                    r.finished = True
                    self._delete_pod(key[0], r.pod)
                    continue
                r.kill_at = time.monotonic() + GRACE_S
                r.workload.terminate()
        active = [r for r in runs if not r.finished]
        succeeded = [r for r in runs if r.finished and r.code == 0 and not r.deadline_hit]
        done = ",".join(str(r.index) for r in succeeded)
        counts = {
            "active": len(active),
            "ready": sum(1 for r in active if r.running),
            "succeeded": len(succeeded),
            "failed": len(failed),
        }
        if active:
            status = {**counts, **({"completedIndexes": done} if done else {})}
            if self._job_status.get(key) != status:  # written when it changes, as the Job controller does:
                self._job_status[key] = status  # every pass wrote it, and every watcher read it, 20 times a second
                self._patch(JOBS, *key, status)
            return
        now = _now()
        self._settled.add(key)
        if not failed:
            cond = {"type": "Complete", "status": "True", "lastTransitionTime": now}
            self._patch(JOBS, *key, {**counts, "completedIndexes": done, "completionTime": now, "conditions": [cond]})
        else:
            self._patch(JOBS, *key, {**counts, "conditions": [_failed("BackoffLimitExceeded", now)]})

    def workload_alive(self, job_id: str) -> bool:
        """Whether anything of a Job's (``namespace/name``) pods still runs: a process group or container.

        Asked of the OS or the engine even after the Job is gone from the API, since a
        cancel that deleted the Job but left the container running is exactly the bug to catch.
        """
        ns, name = job_id.split("/", 1)
        runs = self._runs.get((ns, name)) or self._ended.get((ns, name)) or []
        return any(run.workload.alive() for run in runs)

    def containers(self, job_id: str | None = None) -> list[Any]:
        """This cluster's containers (of one Job's pods) the engine still has, running or not.

        Always [] under the process runtime.
        """
        if self.docker is None:
            return []
        found = self.docker.containers.list(all=True, filters={"label": f"openlab-test.emulator={self.id}"})
        if job_id is not None:
            found = [c for c in found if c.labels.get("openlab-test.pod", "").startswith(job_id + "-")]
        return found
