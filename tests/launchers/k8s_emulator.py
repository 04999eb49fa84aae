"""A Kubernetes API on 127.0.0.1 (kmock's KubernetesEmulator) plus a tiny Job controller.

kmock stores and serves objects over real HTTP but runs no controller: nothing creates
pods, runs them or writes status. :class:`EmulatedCluster` adds the part the launcher
needs to be tested for real: for every new batch/v1 Job it creates a pod object, runs the
pod's container command as a local process (own process group, env and workingDir from
the manifest), serves its output as the pod log, enforces ``activeDeadlineSeconds`` and
writes Job/pod status back (active/succeeded/failed, conditions, start/completion time,
exit code, node). Deleting the Job kills the process group and deletes its pods.

The emulator's event loop runs in one thread and the controller in another; every read
or write of the emulator's objects is done on the loop thread.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kmock
from kmock._internal import apps
from kmock._internal.references import resource

JOBS = resource("batch", "v1", "jobs")
PODS = resource("", "v1", "pods")
NODE = "emulated-node"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Run:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path, pod: str, deadline: float | None) -> None:
        self.proc, self.log, self.pod, self.deadline = proc, log, pod, deadline
        self.started = _now()
        self.started_mono = time.monotonic()
        self.finished = False
        self.deadline_hit = False


class EmulatedCluster:
    """Start with :meth:`start`, stop with :meth:`stop`; :attr:`url` is the API server."""

    def __init__(self) -> None:
        self.url = ""
        self.km: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._runs: dict[tuple[str, str], _Run] = {}
        self._logdir = Path(tempfile.mkdtemp(prefix="k8s-emulator-"))
        self.errors: list[BaseException] = []

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> EmulatedCluster:
        threading.Thread(target=self._serve, name="kmock", daemon=True).start()
        if not self._ready.wait(15):
            raise RuntimeError("kmock emulator did not start")
        self._controller = threading.Thread(target=self._control, name="k8s-controller", daemon=True)
        self._controller.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for run in self._runs.values():
            self._kill(run)
        if hasattr(self, "_controller"):
            self._controller.join(5)

    def _serve(self) -> None:
        async def main() -> None:
            async with kmock.KubernetesEmulator() as km, apps.Server(km, host="127.0.0.1") as server:
                km.resources["v1/pods"] = {}
                km.resources["batch/v1/jobs"] = {}
                self.km, self._loop = km, asyncio.get_running_loop()
                self.url = str(server.url).rstrip("/")
                self._ready.set()
                while not self._stop.is_set():
                    await asyncio.sleep(0.05)

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

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(10)

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

    def _serve_log(self, ns: str, pod: str, path: Path) -> None:
        def respond(request: Any) -> bytes:  # bytes: a str would be served JSON-encoded
            text = path.read_text(errors="replace") if path.exists() else ""
            tail = request.params.get("tailLines") if hasattr(request, "params") else None
            if tail:
                text = "".join(text.splitlines(keepends=True)[-int(tail) :])
            return text.encode()

        self.on_loop(lambda: self.km[f"get /api/v1/namespaces/{ns}/pods/{pod}/log"] << respond)

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
                self._start(key, job)
            else:
                self._watch(key, job)
        for key in [k for k in self._runs if k not in jobs]:  # deleted Jobs
            run = self._runs.pop(key)
            self._kill(run)
            self.on_loop(lambda k=key, r=run: self.km.objects.__delitem__((PODS, k[0], r.pod)))

    def _start(self, key: tuple[str, str], job: dict[str, Any]) -> None:
        ns, name = key
        pod_spec = job["spec"]["template"]["spec"]
        container = pod_spec["containers"][0]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        env.update({e["name"]: e.get("value", "") for e in container.get("env") or []})
        for volume in pod_spec.get("volumes") or []:  # the kubelet's part for hostPath volumes
            host_path = volume.get("hostPath") or {}
            if host_path.get("type") == "DirectoryOrCreate":
                Path(host_path["path"]).mkdir(parents=True, exist_ok=True)
        pod = f"{name}-{uuid.uuid4().hex[:5]}"
        log = self._logdir / f"{ns}-{pod}.log"
        with log.open("wb") as fh:
            try:
                proc = subprocess.Popen(
                    container.get("command", []) + container.get("args", []),
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=container.get("workingDir"),
                    start_new_session=True,
                )
            except OSError as exc:
                fh.write(f"exec failed: {exc}\n".encode())
                proc = subprocess.Popen(["false"])
        deadline = job["spec"].get("activeDeadlineSeconds")
        run = _Run(proc, log, pod, float(deadline) if deadline else None)
        self._runs[key] = run
        labels = {"job-name": name, "batch.kubernetes.io/job-name": name}
        pod_obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": ns, "labels": labels, "creationTimestamp": run.started},
            "spec": {"nodeName": NODE, "restartPolicy": "Never", "containers": [container]},
            "status": {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": container["name"],
                        "image": container["image"],
                        "imageID": f"docker-pullable://{container['image']}@sha256:{'0' * 64}",
                        "ready": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": run.started}},
                    }
                ],
            },
        }

        def create() -> None:
            self.km.objects[(PODS, ns, pod)] = pod_obj

        self.on_loop(create)
        self._serve_log(ns, pod, log)
        self._patch(JOBS, ns, name, {"active": 1, "ready": 1, "startTime": run.started})

    def _kill(self, run: _Run) -> None:
        if run.proc.poll() is None:
            try:
                os.killpg(run.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            run.proc.wait(5)

    def _watch(self, key: tuple[str, str], job: dict[str, Any]) -> None:
        run = self._runs[key]
        if run.finished:
            return
        ns, name = key
        if run.deadline and time.monotonic() - run.started_mono > run.deadline and run.proc.poll() is None:
            run.deadline_hit = True
            self._kill(run)
        code = run.proc.poll()
        if code is None:
            return
        run.finished = True
        code = 128 - code if code < 0 else code
        now = _now()
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                      "startedAt": run.started, "finishedAt": now}
        if run.deadline_hit:
            terminated["reason"] = "DeadlineExceeded"
        pod_status = {
            "phase": "Succeeded" if code == 0 else "Failed",
            "containerStatuses": [
                {
                    "name": job["spec"]["template"]["spec"]["containers"][0]["name"],
                    "image": job["spec"]["template"]["spec"]["containers"][0]["image"],
                    "imageID": f"docker-pullable://x@sha256:{'0' * 64}",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            ],
        }
        self._patch(PODS, ns, run.pod, pod_status)
        if code == 0:
            cond = {"type": "Complete", "status": "True", "lastTransitionTime": now}
            self._patch(JOBS, ns, name, {"active": 0, "ready": 0, "succeeded": 1, "completionTime": now,
                                         "conditions": [cond]})
        else:
            reason = "DeadlineExceeded" if run.deadline_hit else "BackoffLimitExceeded"
            cond = {"type": "Failed", "status": "True", "reason": reason, "message": f"Job failed: {reason}",
                    "lastTransitionTime": now}
            self._patch(JOBS, ns, name, {"active": 0, "ready": 0, "failed": 1, "conditions": [cond]})

    def process_alive(self, job_id: str) -> bool:
        """Whether the local process of a Job (``namespace/name``) still runs."""
        ns, name = job_id.split("/", 1)
        run = self._runs.get((ns, name))
        if run is None:
            return False
        try:
            os.killpg(run.proc.pid, 0)
            return run.proc.poll() is None
        except ProcessLookupError:
            return False
