"""Kubernetes backend: one batch/v1 Job per job, through the official ``kubernetes`` client.

- The manifest starts from an editable base template (``infra/k8s/job-template.yaml``, or
  ``[backends.kubernetes] template``); openlab sets the name, namespace, labels (lineage
  ids whose values are valid label values; all of them also as annotations), the first
  container's image/command/env/resources/workingDir, the pod's ``activeDeadlineSeconds`` (the
  time limit), ``backoffLimit`` and ``ttlSecondsAfterFinished`` (from the template unless
  configured), and mounts the artifact root at the same path: the template's own volume named
  ``openlab-artifacts`` where it has one (a PersistentVolumeClaim, NFS: storage every node and
  this side share), else a hostPath.
- The time limit is the pod template's ``activeDeadlineSeconds``, which a kubelet counts from the
  pod's ``startTime`` (once it is on a node), not the Job's, which counts from the Job's start: with
  that one a job whose pods waited to be scheduled (no GPU free, a node being added) lost its run
  time while PENDING. The kubelet then fails the pod (reason ``DeadlineExceeded``) and stops its containers with
  the pod's grace period; the job is FAILED with the time-limit reason once its main container has
  ended (not while it saves), as for a Job-level ``DeadlineExceeded`` (a template's own, kept). Under
  ``backoffLimit`` the Job controller would replace such a pod; openlab does not count it (a rerun
  stops at the same point, as with the Job-level limit) and cleanup deletes the Job whatever
  ``delete_finished`` says. A pod that is never scheduled never times out: it stays PENDING with
  the scheduler's reason, as a Slurm job waits in the queue. A job's start is its first pod's.
- A job's secret-named variables (:func:`orchestrator.secrets.is_secret_name`: ``-e WANDB_API_KEY=...``)
  are not written into the Job, which whoever may ``get jobs`` reads: they go in a Secret
  ``<job>-openlab-env`` (Opaque) made just before the Job, which the container's env refers to
  (``valueFrom.secretKeyRef``), owned by the Job and deleted with it, like the helpers ConfigMap
  below. A job without any makes none. The right to create Secrets is needed only by such jobs:
  ``backends check`` names it without failing, and such a job is refused naming its variables.
- Every manifest passes ``kubernetes_validate.validate(manifest, version, strict=True)``
  (``version`` from config, default 1.33) before it is sent: a typo in the template is
  reported here, with the schema's message, not as a half-created Job.
- Status comes from the Job's conditions (Complete / Failed with DeadlineExceeded or
  BackoffLimitExceeded) and counts, exit code and node from its pod (found by the
  ``job-name`` label, filtered client-side too). Logs come from that pod. Exit code, image and
  log are those of the main container (the template's first, named in the pod annotation
  ``kubectl.kubernetes.io/default-container``, which ``kubectl logs`` follows too), never a
  sidecar's (istio-proxy, a log shipper): with two containers the API server refuses a log read
  that names none. A container waiting to start has no log yet (not an error). A pod that
  Kubernetes evicted or preempted carries the ``DisruptionTarget`` condition: its failed Job
  is PREEMPTED, with Kubernetes' reason (``EvictionByEvictionAPI``, ``PreemptionByScheduler``...).
- Cancel deletes the Job (and its Service, ConfigMap and Secret) with ``propagationPolicy=Background``
  and waits until its pods are gone. A cancelled or cleaned-up Job's final status is kept in
  ``$OPENLAB_HOME/jobs/kubernetes/`` so status still answers after the Job is deleted.
- What a job used (CPU seconds, peak resident memory) comes back in its pods' termination
  messages: the first container runs the command under the usage wrapper
  (``launchers/_usage.py``, its parent, reading ``wait4``), which writes it to
  ``terminationMessagePath``, and the kubelet puts that in the pod's status. ``measure_usage``:
  ``"auto"`` (default) for images a local Docker engine holds with the ``openlab.io/python``
  label (the repo's Dockerfile sets it), ``true`` for any image with a ``python3`` (option
  ``python``), ``false`` never. A pod whose runtime could not start the command (a
  ``StartError``: no such program in the image) or whose helper could not start the job's command
  (exit 127) fails with a reason that names the program, and the option to set when it is the
  helpers' Python. The same wrapper sends a job asked to be warned ahead of its time limit
  (``warn_before_limit``) SIGUSR1 that long before ``activeDeadlineSeconds`` ends the pod with
  SIGTERM alone, as Slurm's ``--signal=USR1@N`` does; without the wrapper there is no warning. The
  wrapper counts from its own start, the kubelet from the pod's, before the image is pulled: the
  warning comes that much later than asked (give ``warn_before_limit`` room for a slow pull).
- A container's first process is its PID 1, which the kernel gives no default action for SIGTERM
  and which inherits every orphan: the usage wrapper, when it runs, is written to be that (it
  passes signals on and reaps, counting what orphans used). A pod without it gets
  ``shareProcessNamespace: true`` (unless the template says otherwise), so the pause container is
  PID 1 and reaps, and the command is an ordinary process: a job with no SIGTERM handler ends on a
  cancel or an eviction instead of lasting the grace period out until SIGKILL.
- The helper scripts a pod runs (the usage wrapper; ``launchers/_tasks.py`` for several tasks)
  are this launcher's own copies, sent in a ConfigMap ``<job>-openlab`` made just before the Job
  and mounted read-only at ``/.openlab``: stdlib-only, run with ``python -I -S``, so the image
  needs a Python, not openlab, and never runs a stale copy. The ConfigMap is owned by the Job
  (Kubernetes' garbage collector deletes it with the Job) and deleted with it by cancel and
  cleanup. It needs the right to create ConfigMaps in the namespace; ``helpers_configmap =
  false`` runs the image's own ``python -m orchestrator.launchers._tasks`` / ``._usage`` instead.
- API errors quote the server's ``message``; 5xx and connection errors are retried a
  bounded number of times (``retries``, default 3).

Config (``[backends.kubernetes]``): namespace (default "default"), version, template,
image, host (API URL, e.g. an emulator), kubeconfig, context, verify_ssl, token_env (name
of the variable holding a bearer token), backoff_limit, ttl_seconds, retries,
image_code_check (require | warn | off: pipeline stages refuse an image not built from the
run's tree, see :mod:`orchestrator.provenance.image`), master_port (several-node jobs),
measure_usage, python, helpers_configmap (above).
The job id is ``namespace/name``.

A job of several nodes (``JobSpec.nodes`` > 1) is an *indexed* Job, one pod per node
(``completionMode: Indexed``, ``completions`` = ``parallelism`` = nodes), plus a headless Service of
the Job's name (``clusterIP: None``, ``publishNotReadyAddresses``) that gives each pod the DNS name
``<job>-<index>.<job>`` (the pods' ``subdomain``): pod 0 is the rendezvous (MASTER_ADDR,
MASTER_PORT ``master_port``, default 29500), and each pod runs its node's tasks under
``launchers/_tasks.py`` with its index as node rank, so ranks, line labels and task-end records are
global. Its ``backoffLimit`` is 0: a replaced pod could not join a rendezvous its peers already
left, so a failed pod fails the Job (Kubernetes then stops the others) and a retry is a new attempt,
as on Slurm. Status names the pod that failed first; logs are every pod's, merged as they come; the
Service is owned by the Job (deleted with it by Kubernetes' garbage collector) and deleted with it
by cancel and cleanup.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from orchestrator.errors import ConfigError
from orchestrator.launchers._tasks import command as tasks_command
from orchestrator.launchers.base import (
    HELPERS_MOUNT,
    HELPERS_PYTHON_KEY,
    TIME_LIMIT_REASON,
    BackendUnavailable,
    Backoff,
    JobHandle,
    JobNotFound,
    JobSpec,
    JobState,
    JobStatus,
    Launcher,
    LauncherError,
    combine_usage,
    first_failed_task,
    flag_option,
    helper_script,
    helpers_python,
    list_option,
    measure_usage_option,
    not_started,
    number_option,
    parse_usage,
    table_option,
    task_ends,
    usage_python,
    warn_secret_arguments,
    with_notes,
)
from orchestrator.secrets import is_secret_name, scrub, secret_values

DEFAULT_VERSION = "1.33"
#: The Job annotation naming where a multi-task pod's tasks write how they ended (artifact root).
TASK_ENDS_ANNOTATION = "openlab.io/task-ends"
#: The terminated reasons a kubelet gives a container its runtime could not start (containerd, dockershim).
START_ERRORS = ("StartError", "ContainerCannotRun")
#: The label openlab puts on each Job it makes and on its pods (the job's name), so one list call
#: finds all of them (``openlab job list``).
JOB_NAME_LABEL = "openlab.io/job-name"
#: The pod label (and annotation) an indexed Job's controller gives each pod: its index, our node rank.
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
#: Where node 0 of a several-node job listens for its peers (``[backends.kubernetes] master_port``).
DEFAULT_MASTER_PORT = 29500
NODE_SELECTOR_EXAMPLE = '{"nvidia.com/gpu.product" = "H100"}'
TOLERATIONS_EXAMPLE = '[{key = "gpu", operator = "Exists"}]'
#: Where a container writes its termination message unless its spec says otherwise (Kubernetes' default).
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
#: Who needs the right to make Secrets: only jobs given secret-named variables (their values go in
#: one, never in the Job's manifest), so ``backends check`` does not fail without it.
SECRETS_NEEDED_BY = "jobs given secret-named variables, for their values"
#: What the launcher asks of the API server in its namespace: (API group, resource, verbs, what
#: needs it). ``infra/k8s/rbac.yaml`` grants exactly this (a test holds both to the requests the
#: launcher really makes); ``backends check`` asks the server which of it is allowed.
API_NEEDS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("batch", "jobs", ("create", "get", "list", "delete"), "every job"),
    ("", "pods", ("list",), "every job"),
    ("", "pods/log", ("get",), "every job's log"),
    ("", "services", ("create", "patch", "delete"), "jobs of several nodes"),
    ("", "configmaps", ("create", "patch", "delete"), "jobs of several tasks or measured: helpers_configmap"),
    ("", "secrets", ("create", "patch", "delete"), SECRETS_NEEDED_BY),
)
#: The pod annotation naming the container ``kubectl logs`` and ``exec`` pick by default; openlab sets it to
#: the main container (the template's first) and reads logs, exit code and image of that one, not of a
#: sidecar (istio-proxy, a log shipper), which a mutating webhook may even put first.
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"
#: The reason a kubelet gives a pod it stopped at its own ``activeDeadlineSeconds`` (phase Failed), and
#: the Job controller a Job stopped at the Job's.
DEADLINE_EXCEEDED = "DeadlineExceeded"
#: The pod volume of the job's helper scripts (a ConfigMap of :meth:`KubernetesLauncher.helpers_manifest`).
HELPERS_VOLUME = "openlab-helpers"
#: Longest wait before re-reading a pod log whose follow stream ended while the pod still runs.
FOLLOW_RETRY_S = 1.0
DEFAULT_TEMPLATE = Path(__file__).resolve().parents[2] / "infra" / "k8s" / "job-template.yaml"
FALLBACK_TEMPLATE: dict[str, Any] = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"name": "openlab-job", "labels": {"app.kubernetes.io/managed-by": "openlab"}},
    "spec": {
        "backoffLimit": 0,
        "ttlSecondsAfterFinished": 3600,
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/managed-by": "openlab"}},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "job", "image": "openlab/job:latest"}]},
        },
    },
}
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
T = TypeVar("T")
log = logging.getLogger(__name__)


def k8s_name(name: str) -> str:
    """A DNS-1123 name (``openlab-<slug>-<hex>``, at most 63 characters)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40].strip("-") or "job"
    return f"openlab-{slug}-{uuid.uuid4().hex[:8]}"


def helpers_name(job: str) -> str:
    """The name of the ConfigMap that holds a Job's helper scripts."""
    return f"{job}-openlab"


def env_secret_name(job: str) -> str:
    """The name of the Secret that holds a Job's secret-named variables."""
    return f"{job}-openlab-env"


def secret_env(env: Mapping[str, str]) -> dict[str, str]:
    """Those of a job's variables whose names say they hold secrets (:func:`orchestrator.secrets.is_secret_name`)."""
    return {str(k): str(v) for k, v in env.items() if is_secret_name(str(k))}


def k8s_memory(nbytes: int) -> str:
    """Bytes as a Kubernetes quantity (Mi, rounded up)."""
    return f"{max(1, -(-nbytes // 2**20))}Mi"


def k8s_cpu(cpus: float) -> str:
    return str(int(cpus)) if float(cpus).is_integer() else f"{int(round(cpus * 1000))}m"


def _phase(pod: Any) -> str | None:
    return pod.status.phase if pod.status else None


#: Container waiting reasons that are only the way to running, not a reason to tell anyone.
_ON_THE_WAY = frozenset({"ContainerCreating", "PodInitializing"})
#: Container waiting reasons no retry of the kubelet's ends: the image reference does not parse, or
#: the pod may not pull (imagePullPolicy Never) an image the node lacks. Docker refuses both at submit.
NEVER_STARTS = frozenset({"InvalidImageName", "ErrImageNeverPull"})


def _waiting(pods: list[Any]) -> str | None:
    """Why pods the Job controller counts as active do not run: not scheduled (``Unschedulable:
    0/4 nodes are available: 4 Insufficient nvidia.com/gpu``), or a container that cannot start
    (``ImagePullBackOff``, ``CreateContainerConfigError``: a Secret it names is missing). Without
    it such a Job read RUNNING, with no reason, for as long as it waited, and its clock ran."""
    for pod in pods:
        status = pod.status
        if status is None:
            continue
        for cond in status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False":
                return f"not scheduled: {cond.reason or 'Unschedulable'}" + (
                    f": {cond.message}" if cond.message else ""
                )
        for cs in [*(status.init_container_statuses or []), *(status.container_statuses or [])]:
            waiting = cs.state.waiting if cs.state else None
            if waiting is not None and waiting.reason and waiting.reason not in _ON_THE_WAY:
                return f"{waiting.reason}" + (f": {waiting.message}" if waiting.message else "")
    return None


def _retry_after(exc: Any) -> float | None:
    """Seconds an API server's ``Retry-After`` header asks a client to wait (429, 503), if any."""
    headers = getattr(exc, "headers", None) or {}
    try:
        return float(headers.get("Retry-After") or headers.get("retry-after"))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _api_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            data = json.loads(body)
            if isinstance(data, dict) and data.get("message"):
                return f"{data['message']} ({getattr(exc, 'status', '?')} {data.get('reason', '')})".replace(" )", ")")
        except (ValueError, TypeError):
            pass
        return str(body)[:500]
    return f"{getattr(exc, 'status', '')} {getattr(exc, 'reason', '') or exc}".strip()


def _aware(value: Any) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def _pods_of(pods: list[Any], job: str) -> list[Any]:
    """Those of ``pods`` the Job named ``job`` made (the Job controller's labels), oldest first."""
    own = [
        p
        for p in pods
        if (p.metadata.labels or {}).get("job-name") == job
        or (p.metadata.labels or {}).get("batch.kubernetes.io/job-name") == job
    ]
    return sorted(own, key=lambda p: _aware(p.metadata.creation_timestamp) or dt.datetime.min.replace(tzinfo=dt.UTC))


def _main_name(pod: Any) -> str | None:
    """The name of a pod's main container: the one its annotation names (the Job template's first,
    which openlab runs the command in), else the first of its spec."""
    name = (pod.metadata.annotations or {}).get(DEFAULT_CONTAINER_ANNOTATION) if pod.metadata else None
    if name:
        return str(name)
    containers = pod.spec.containers if pod.spec else None
    return str(containers[0].name) if containers else None


def _main_status(pod: Any) -> Any | None:
    """The main container's status: a sidecar's exit code, image and termination message are not the job's."""
    statuses = (pod.status.container_statuses or []) if pod.status else []
    name = _main_name(pod)
    if name is None:
        return statuses[0] if statuses else None
    return next((cs for cs in statuses if cs.name == name), None)


def _terminated(pod: Any) -> Any | None:
    """How the pod's main container ended (None while it has not)."""
    cs = _main_status(pod)
    return cs.state.terminated if cs is not None and cs.state else None


def _past_deadline(pod: Any) -> bool:
    """Whether the kubelet stopped the pod at its ``activeDeadlineSeconds``: the job's time limit."""
    return bool(pod.status and pod.status.phase == "Failed" and pod.status.reason == DEADLINE_EXCEEDED)


def _up_to_time_limit(pods: list[Any]) -> list[Any]:
    """``pods`` (oldest first) without those the Job controller made after a pod stopped at its time
    limit (under ``backoffLimit`` it replaces it as any failed pod): a rerun would stop at the same
    point, so they are not the job's, as no pod came after a Job-level limit."""
    limited = next((i for i, p in enumerate(pods) if _past_deadline(p) and _index_of(p) is None), None)
    return pods if limited is None else pods[: limited + 1]


def _main_running(pod: Any) -> bool:
    """Whether the pod's main container still runs (a pod past its deadline is Failed at once, while
    its containers are stopped with the pod's grace period: the workload may be saving)."""
    cs = _main_status(pod)
    return bool(cs is not None and cs.state and cs.state.running is not None)


def _pod_end(pod: Any) -> str:
    """``name exit 1`` (or ``name stopped by Kubernetes: reason``) for an ended pod of a Job."""
    name = pod.metadata.name
    status = pod.status
    for c in (status.conditions or []) if status else []:
        if c.type == "DisruptionTarget" and c.status == "True":
            return f"{name} stopped by Kubernetes: {c.reason}"
    term = _terminated(pod)
    if term is not None:
        why = f" ({term.reason})" if term.reason not in (None, "Completed", "Error") else ""
        if not why and status and status.reason:  # the pod's own (DeadlineExceeded: its time limit)
            why = f" ({status.reason})"
        return f"{name} exit {term.exit_code}{why}"
    return f"{name} {status.phase.lower() if status and status.phase else 'ended'}"


def _index_of(pod: Any) -> int | None:
    """An indexed Job's pod's index (its node rank), None for a plain Job's pod."""
    meta = pod.metadata
    raw = (meta.labels or {}).get(INDEX_LABEL) or (meta.annotations or {}).get(INDEX_LABEL)
    return int(raw) if raw is not None and str(raw).isdigit() else None


def _current(pods: list[Any]) -> list[Any]:
    """The pods that make up the Job now, oldest first: the newest pod of each index (indexed
    Job), else the newest pod (earlier ones were replaced under ``backoffLimit``)."""
    if not pods:
        return []
    latest: dict[int | None, Any] = {}
    for p in pods:  # newest last, so each index keeps its newest
        latest[_index_of(p)] = p
    if None in latest:
        return [latest[None]]
    return [latest[i] for i in sorted(latest)]  # type: ignore[type-var]


def _finished(pod: Any) -> dt.datetime | None:
    term = _terminated(pod)
    return _aware(term.finished_at) if term is not None else None


def _exit_code(pod: Any) -> int | None:
    term = _terminated(pod)
    return int(term.exit_code) if term is not None else None


def _started(pods: list[Any]) -> dt.datetime | None:
    """When the first of ``pods`` started on a node (its ``startTime``, set once the kubelet took it):
    the job's start, not the Job's, which counts the time its pods waited to be scheduled."""
    starts = [s for p in pods if p.status is not None and (s := _aware(p.status.start_time)) is not None]
    return min(starts) if starts else None


def _pods_usage(pods: list[Any]) -> dict[str, float] | None:
    """What the pods' usage wrappers reported in their termination messages: CPU seconds summed
    over the pods (the nodes of an indexed Job, and pods the Job controller replaced), the largest
    peak memory; None when none did."""
    reports = []
    for pod in pods:
        for cs in (pod.status.container_statuses or []) if pod.status else []:  # a sidecar's is not JSON of ours
            term = cs.state.terminated if cs.state else None
            usage = parse_usage(term.message) if term is not None else None
            if usage is not None:
                reports.append(usage)
    return combine_usage(reports)


def _failed(pod: Any) -> bool:
    return bool(_exit_code(pod))


def _deciding(current: list[Any], ends_prefix: str | None) -> Any:
    """The pod whose end is the Job's: the first to fail (the others were stopped because of it),
    else the last. Pod end times have whole seconds, so the tasks' own end records (to the
    microsecond, naming the pod's hostname) decide first; then the end time, a failure before a
    stop by signal (128+N: what the others get when the Job fails) in the same second, the index."""
    failed = [p for p in current if _failed(p)]
    if not failed:
        return current[-1]
    first = next((e for e in task_ends(ends_prefix) if e.code != 0), None)
    if first is not None:
        by_host = [p for p in failed if p.spec and first.host in (p.spec.hostname, p.metadata.name)]
        if by_host:
            return by_host[0]
    never = dt.datetime.max.replace(tzinfo=dt.UTC)
    return min(failed, key=lambda p: (_finished(p) or never, (_exit_code(p) or 0) > 128, _index_of(p) or 0))


class KubernetesLauncher(Launcher):
    """Runs jobs as Kubernetes Jobs (see the module docstring)."""

    name = "kubernetes"
    poll_interval = 0.5
    #: Several tasks of one job in its pod (launchers/_tasks.py); several nodes as an indexed Job
    #: with a headless Service for the rendezvous (one pod per node).
    multi_task = True
    max_nodes = None
    known_options = Launcher.known_options | {
        "host", "kubeconfig", "context", "verify_ssl", "token_env", "version", "retries", "namespace",
        "template", "image", "image_code_check", "backoff_limit", "ttl_seconds", "delete_finished",
        "cancel_timeout", "master_port", "node_selector", "tolerations", "priority_class", "service_account",
        "measure_usage", "helpers_configmap",
    }  # fmt: skip

    @classmethod
    def check_options(cls, opts: Mapping[str, Any]) -> None:
        super().check_options(opts)
        table_option(opts, "node_selector", NODE_SELECTOR_EXAMPLE)
        list_option(opts, "tolerations", TOLERATIONS_EXAMPLE)
        flag_option(opts, "verify_ssl", True)
        flag_option(opts, "delete_finished", True)
        flag_option(opts, "helpers_configmap", True)
        measure_usage_option(opts)
        for name, default in (("retries", 3), ("cancel_timeout", 30), ("master_port", DEFAULT_MASTER_PORT)):
            number_option(opts, name, default)
        # whole numbers the API server takes as they are: `-o backoff_limit=three` was a ValueError
        # traceback from manifest(), after the attempt was recorded, and -1 the API server's 422
        for name, default in (("backoff_limit", 0), ("ttl_seconds", 3600)):
            if name in opts and not number_option(opts, name, default).is_integer():
                raise ConfigError(
                    f"backend option {name} = {opts[name]!r} is not a whole number: give one, e.g. {default}"
                )

    def __init__(self, settings: Any = None, config: Any = None) -> None:
        super().__init__(settings, config)
        self.namespace = str(self.config.get("namespace", "default"))
        self.version = str(self.config.get("version", DEFAULT_VERSION))
        self.retries = int(number_option(self.config, "retries", 3))
        self.state_dir = self.settings.home / "jobs" / "kubernetes"
        self._api_client: Any = None
        #: each Job's secret-named values this process gave it (its Secret, which openlab never reads back)
        self._given_secrets: dict[str, list[str]] = {}

    # -- connection -------------------------------------------------------------------
    def _find_cluster(self) -> str | None:
        """The API server's address: what a Job's name is unique within (with its namespace). From
        inside a pod every cluster's is the same service address (``https://10.96.0.1:443``):
        there ``[backends.kubernetes] cluster`` should name it."""
        return str(self.api_client.configuration.host).rstrip("/") or None

    @property
    def api_client(self) -> Any:
        if self._api_client is None:
            from kubernetes import client, config

            try:
                if self.config.get("host"):
                    cfg = client.Configuration()
                    cfg.host = str(self.config["host"]).rstrip("/")
                    cfg.verify_ssl = flag_option(self.config, "verify_ssl", True)
                    token_env = self.config.get("token_env")
                    if token_env and os.environ.get(str(token_env)):
                        cfg.api_key = {"authorization": "Bearer " + os.environ[str(token_env)]}
                    self._api_client = client.ApiClient(cfg)
                elif os.environ.get("KUBERNETES_SERVICE_HOST") and not self.config.get("kubeconfig"):
                    config.load_incluster_config()
                    self._api_client = client.ApiClient()
                else:
                    self._api_client = config.new_client_from_config(
                        config_file=self.config.get("kubeconfig"), context=self.config.get("context")
                    )
            except Exception as exc:  # noqa: BLE001 - kubeconfig errors come in many types
                raise BackendUnavailable(
                    f"no Kubernetes API configured: {exc} (set backends.kubernetes.host or .kubeconfig in openlab.toml)"
                ) from None
        return self._api_client

    @property
    def batch(self) -> Any:
        from kubernetes import client

        return client.BatchV1Api(self.api_client)

    @property
    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    def _call(self, what: str, fn: Callable[[], T], *, not_found: Callable[[], T] | None = None) -> T:
        """Call the API; retry 5xx, 429 (API Priority and Fairness, after its Retry-After) and
        connection errors; 404 -> ``not_found()``; quote the server's message. A 5xx or 429 that
        outlasts the retries is :class:`BackendUnavailable`, an outage ``run_job`` waits out, not
        the job's failure (which cancelled a healthy multi-day job when the API server was busy)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        delay = 0.25
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except ApiException as exc:
                if exc.status == 404 and not_found is not None:
                    return not_found()
                busy = exc.status == 429 or (exc.status or 0) >= 500
                if busy and attempt < self.retries:
                    time.sleep(min(_retry_after(exc) or delay, 30.0))
                    delay *= 2
                    continue
                if busy:
                    raise BackendUnavailable(f"kubernetes API could not {what}: {_api_message(exc)}") from None
                raise LauncherError(f"kubernetes API refused to {what}: {_api_message(exc)}") from None
            except HTTPError as exc:
                if attempt < self.retries:
                    time.sleep(delay)
                    delay *= 2
                    continue
                host = getattr(self.api_client.configuration, "host", "?")
                raise BackendUnavailable(f"kubernetes API at {host} not reachable: {exc}") from None
        raise AssertionError("unreachable")

    # -- the manifest -----------------------------------------------------------------
    def template(self) -> dict[str, Any]:
        import yaml

        path = self.config.get("template")
        path = Path(path).expanduser() if path else DEFAULT_TEMPLATE
        if not path.exists():
            if self.config.get("template"):
                raise LauncherError(f"kubernetes job template {path} does not exist")
            return copy.deepcopy(FALLBACK_TEMPLATE)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise LauncherError(f"kubernetes job template {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict) or data.get("kind") != "Job":
            raise LauncherError(f"kubernetes job template {path} must be one batch/v1 Job manifest")
        return data

    def image_name(self, spec: JobSpec) -> str | None:
        """The image the Job's main container gets: the spec's, the configured one, the template's."""
        opts = {**self.config, **spec.options}
        containers = self.template().get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}]
        return str(spec.image or opts.get("image") or containers[0].get("image") or "openlab/job:latest")

    def environment_image(self, image: str | None = None) -> str | None:
        """The image a Job would run: pinned by digest when the reference is, or when a local
        Docker engine holds it (clusters that load local images); else the reference itself,
        whose tag may move — pin images by ``@sha256:`` for identities that cannot drift."""
        name = str(self.image_ref(image))
        if "@sha256:" in name:
            return str(name)
        from orchestrator.launchers.docker import DockerLauncher

        local = self._local_image(name)
        return str(DockerLauncher.image_digest(local)) if local is not None else str(name)

    def runs_image_code(self) -> bool:
        return True  # a pod runs the image's copy of the code; nothing of this host is mounted

    def image_labels(self, image: str | None = None) -> dict[str, str] | None:
        name = str(self.image_ref(image))
        local = self._local_image(name)
        return dict(local.labels or {}) if local is not None else None

    @staticmethod
    def _local_image(name: str) -> Any | None:
        """The image as a local Docker engine holds it (clusters that load local images), or None."""
        try:
            import docker

            return docker.from_env(timeout=5).images.get(name)
        except Exception:  # noqa: BLE001 - no engine, or not there: the reference is all we know
            return None

    def manifest(self, spec: JobSpec, name: str) -> dict[str, Any]:
        """The Job manifest for ``spec`` (validated; public so users can see what is sent)."""
        opts = {**self.config, **spec.options}
        job = self.template()
        job["apiVersion"], job["kind"] = "batch/v1", "Job"
        meta = job.setdefault("metadata", {})
        meta.pop("generateName", None)
        meta["name"] = name
        meta["namespace"] = str(opts.get("namespace", self.namespace))
        labels = {str(k): str(v) for k, v in spec.labels.items() if _LABEL_VALUE.match(str(v)) and len(str(v)) <= 63}
        # a label value ends in a letter or digit: cut to 63 after the strip, a name could end in "-" (422)
        labels[JOB_NAME_LABEL] = re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.name).strip("-_.")[:63].rstrip("-_.") or "job"
        annotations = {str(k): str(v) for k, v in spec.labels.items()}
        meta["labels"] = {**(meta.get("labels") or {}), **labels}
        meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
        jspec = job.setdefault("spec", {})
        if "backoff_limit" in opts:
            jspec["backoffLimit"] = int(float(opts["backoff_limit"]))
        jspec.setdefault("backoffLimit", 0)
        if spec.nodes > 1:  # one pod per node, each told its index (see the module docstring)
            jspec.update(completionMode="Indexed", completions=spec.nodes, parallelism=spec.nodes, backoffLimit=0)
        if "ttl_seconds" in opts:
            jspec["ttlSecondsAfterFinished"] = int(float(opts["ttl_seconds"]))
        pod = jspec.setdefault("template", {})
        pod_meta = pod.setdefault("metadata", {})
        pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **labels}
        pod_spec = pod.setdefault("spec", {})
        pod_spec["restartPolicy"] = "Never"
        if spec.time_limit:  # the pod's, counted from when it is on a node: time queued is not run time
            pod_spec["activeDeadlineSeconds"] = int(spec.time_limit)
        if spec.nodes > 1:
            pod_spec["subdomain"] = name  # <job>-<index>.<job>: the headless Service's DNS names
        # Placement (a recipe's `resources.<stage>.kubernetes`, or [backends.kubernetes]) over the template's.
        if selector := table_option(opts, "node_selector", NODE_SELECTOR_EXAMPLE):
            pod_spec["nodeSelector"] = {**(pod_spec.get("nodeSelector") or {}), **selector}
        if tolerations := list_option(opts, "tolerations", TOLERATIONS_EXAMPLE):
            pod_spec["tolerations"] = [*(pod_spec.get("tolerations") or []), *tolerations]
        if opts.get("priority_class"):
            pod_spec["priorityClassName"] = str(opts["priority_class"])
        if opts.get("service_account"):
            pod_spec["serviceAccountName"] = str(opts["service_account"])
        containers = pod_spec.setdefault("containers", [{"name": "job"}])
        if not containers:
            containers.append({"name": "job"})
        main = containers[0]
        main.setdefault("name", "job")
        # The container logs are read from (and `kubectl logs` shows): a sidecar makes it ambiguous.
        pod_meta["annotations"] = {**(pod_meta.get("annotations") or {}), DEFAULT_CONTAINER_ANNOTATION: main["name"]}
        main["image"] = spec.image or opts.get("image") or main.get("image") or "openlab/job:latest"
        main["command"] = list(spec.command)
        # The helper scripts from this launcher's ConfigMap (module docstring), or the image's openlab.
        shipped = flag_option(opts, "helpers_configmap", True)
        pythons: list[str] = []  # what the helper scripts run with
        if spec.tasks > 1:  # one process per task in the pod, told its place (launchers/_tasks.py)
            python = helpers_python(opts)
            pythons.append(python)
            script = f"{HELPERS_MOUNT}/tasks.py" if shipped else None
            main["command"] = tasks_command(python, spec.tasks_per_node, list(spec.command), spec.nodes, script=script)
        auto = measure_usage_option(opts) is None  # then the image's labels decide
        wrapper = usage_python(opts, self.image_labels(main["image"]) if auto else None)
        if wrapper is not None:  # what the job used, written where the kubelet returns it in the pod's status
            out = str(main.get("terminationMessagePath") or TERMINATION_MESSAGE_PATH)
            runner = ["-I", "-S", f"{HELPERS_MOUNT}/usage.py"] if shipped else ["-m", "orchestrator.launchers._usage"]
            if shipped and spec.time_limit and spec.warn_before_limit:  # ahead of activeDeadlineSeconds' SIGTERM
                runner.append(f"--warn-after={spec.time_limit - spec.warn_before_limit}")
            main["command"] = [wrapper, *runner, out, "--", *main["command"]]
            pythons.append(wrapper)
        if pythons:
            meta["annotations"][HELPERS_PYTHON_KEY] = " ".join(dict.fromkeys(pythons))
        main.pop("args", None)
        if wrapper is None:  # the pod's pause container as PID 1, not the command (module docstring)
            pod_spec.setdefault("shareProcessNamespace", True)
        volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") != HELPERS_VOLUME]
        mounts = [m for m in main.get("volumeMounts") or [] if m.get("name") != HELPERS_VOLUME]
        if shipped and (spec.tasks > 1 or wrapper is not None):
            configmap = {"name": helpers_name(name), "defaultMode": 0o444}
            volumes.append({"name": HELPERS_VOLUME, "configMap": configmap})
            mounts.append({"name": HELPERS_VOLUME, "mountPath": HELPERS_MOUNT, "readOnly": True})
        for owner, key, items in ((pod_spec, "volumes", volumes), (main, "volumeMounts", mounts)):
            if items:
                owner[key] = items
            else:
                owner.pop(key, None)
        env = [e for e in main.get("env") or [] if e.get("name") not in spec.env]
        secrets = secret_env(spec.env)  # in the Job's Secret, so that whoever may read the Job does not see them
        env += [
            {"name": str(k), "valueFrom": {"secretKeyRef": {"name": env_secret_name(name), "key": str(k)}}}
            if str(k) in secrets
            else {"name": str(k), "value": str(v)}
            for k, v in spec.env.items()
        ]
        env += [
            {"name": "OPENLAB_JOB_ID", "value": f"{meta['namespace']}/{name}"},
            {"name": "OPENLAB_JOB_NAME", "value": spec.name},
            {"name": "OPENLAB_LABELS", "value": json.dumps(dict(spec.labels), sort_keys=True)},
        ]
        if spec.nodes > 1:
            port = str(opts.get("master_port", DEFAULT_MASTER_PORT))
            env += [{"name": "MASTER_ADDR", "value": f"{name}-0.{name}"}, {"name": "MASTER_PORT", "value": port}]
        if spec.workdir:
            main["workingDir"] = spec.workdir
        resources = main.setdefault("resources", {})
        limits, requests = resources.setdefault("limits", {}), resources.setdefault("requests", {})
        if spec.cpus:  # per task, as Slurm counts them: the pod holds its node's tasks
            limits["cpu"] = requests["cpu"] = k8s_cpu(spec.cpus * spec.tasks_per_node)
        if spec.memory_bytes:
            limits["memory"] = requests["memory"] = k8s_memory(spec.memory_bytes)
        if spec.gpus:
            limits["nvidia.com/gpu"] = str(spec.gpus)
        if not limits:
            resources.pop("limits")
        if not requests:
            resources.pop("requests")
        if not resources:
            main.pop("resources")
        if spec.artifact_root is not None:
            root = str(Path(spec.artifact_root).resolve())
            env.append({"name": "OPENLAB_ARTIFACT_ROOT", "value": root})
            volumes = pod_spec.get("volumes") or []
            shared = next((v for v in volumes if v.get("name") == "openlab-artifacts" and "hostPath" not in v), None)
            if shared is None:  # a node's own disk, at the same path: one machine, or storage every node mounts there
                volumes = [v for v in volumes if v.get("name") != "openlab-artifacts"]
                volumes.append({"name": "openlab-artifacts", "hostPath": {"path": root, "type": "DirectoryOrCreate"}})
            # else the template's own volume of that name (a PersistentVolumeClaim, NFS): the cluster's
            # shared storage, mounted at the artifact root's path, as this side sees it (hostPath is
            # refused under Pod Security "baseline", and each node would write to its own disk)
            pod_spec["volumes"] = volumes
            mounts = [m for m in main.get("volumeMounts") or [] if m.get("name") != "openlab-artifacts"]
            mounts.append({"name": "openlab-artifacts", "mountPath": root})
            main["volumeMounts"] = mounts
            if spec.tasks > 1:  # how each task ended, where this side can read it (the same path)
                ends = str(Path(root) / ".tasks" / f"{meta['namespace']}-{name}.ends")
                env.append({"name": "OPENLAB_TASK_ENDS", "value": ends})
                meta["annotations"][TASK_ENDS_ANNOTATION] = ends
        main["env"] = env
        self.validate(job, source=self.template_source())
        return job

    def service_manifest(self, job: dict[str, Any]) -> dict[str, Any]:
        """The headless Service that names a several-node Job's pods (validated like the Job)."""
        meta = job["metadata"]
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": meta["name"],
                "namespace": meta["namespace"],
                "labels": dict(meta.get("labels") or {}),
            },
            "spec": {
                "clusterIP": "None",
                "selector": {"job-name": meta["name"]},
                "publishNotReadyAddresses": True,  # peers resolve each other before any is Ready
            },
        }
        self.validate(service)
        return service

    def env_secret_manifest(self, spec: JobSpec, job: dict[str, Any]) -> dict[str, Any] | None:
        """The Secret of a Job's secret-named variables (validated like the Job), which its main
        container's env refers to (``valueFrom.secretKeyRef``); None when it has none."""
        values = secret_env(spec.env)
        if not values:
            return None
        meta = job["metadata"]
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {
                "name": env_secret_name(meta["name"]),
                "namespace": meta["namespace"],
                "labels": dict(meta.get("labels") or {}),
            },
            "data": {k: base64.b64encode(v.encode()).decode("ascii") for k, v in values.items()},
        }
        self.validate(secret)
        return secret

    def helpers_manifest(self, job: dict[str, Any]) -> dict[str, Any] | None:
        """The ConfigMap of helper scripts a Job's pods mount (validated like the Job), or None when
        its manifest mounts none (one task, no usage wrapper, or ``helpers_configmap = false``)."""
        volumes = job["spec"]["template"]["spec"].get("volumes") or []
        if not any(v.get("name") == HELPERS_VOLUME for v in volumes):
            return None
        meta = job["metadata"]
        configmap = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": helpers_name(meta["name"]),
                "namespace": meta["namespace"],
                "labels": dict(meta.get("labels") or {}),
            },
            "data": {name: helper_script(name).read_text() for name in ("tasks.py", "usage.py")},
        }
        self.validate(configmap)
        return configmap

    def template_source(self) -> str:
        """Where the base manifest comes from, for error messages: the user's file or the built-in one."""
        path = self.config.get("template")
        if path:
            return str(Path(path).expanduser())
        return str(DEFAULT_TEMPLATE) if DEFAULT_TEMPLATE.exists() else "the built-in job template"

    def validate(self, manifest: dict[str, Any], *, source: str | None = None) -> None:
        """Strict schema validation for the configured Kubernetes version; one line naming the field and template.

        Strict means unknown fields are errors, so a typo in a user-edited template
        (``imagePullPolicey``) is refused here instead of being dropped silently by the API
        server, and a field newer than the configured version is refused too.
        """
        import kubernetes_validate

        try:
            kubernetes_validate.validate(manifest, self.version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in getattr(exc, "path", []) or [])
            at = f" (at {where})" if where else ""
            origin = f" (from template {source})" if source else ""
            message = " ".join(f"{exc.message}{at}".split())  # one line, whatever the schema says
            raise LauncherError(f"job manifest is invalid for Kubernetes {self.version}{origin}: {message}") from None
        except kubernetes_validate.utils.VersionNotSupportedError:
            raise LauncherError(f"kubernetes-validate has no schema for Kubernetes {self.version}") from None
        except kubernetes_validate.utils.SchemaNotFoundError as exc:
            raise LauncherError(f"kubernetes-validate: {exc}") from None

    # -- interface --------------------------------------------------------------------------
    @staticmethod
    def _split(job_id: str) -> tuple[str, str]:
        if "/" not in job_id:
            raise JobNotFound(f"{job_id!r} is not a kubernetes job id (namespace/name)")
        namespace, name = job_id.split("/", 1)
        return namespace, name

    def submit(self, spec: JobSpec) -> JobHandle:
        warn_secret_arguments(spec, "the Job manifest (whoever may read Jobs or Pods)")
        name = k8s_name(spec.name)
        manifest = self.manifest(spec, name)
        namespace = manifest["metadata"]["namespace"]
        job_id = f"{namespace}/{name}"
        helpers = self.helpers_manifest(manifest)
        secret = self.env_secret_manifest(spec, manifest)
        service = self.service_manifest(manifest) if spec.nodes > 1 else None
        made = {"service": service is not None, "helpers": helpers is not None, "secret": secret is not None}
        self._given_secrets[job_id] = secret_values(spec.env)
        # All before the Job: its pods cannot start without their ConfigMap and Secret, and pod 0's
        # name must resolve when its peers look it up.
        if helpers is not None:
            try:
                self._call(
                    f"create ConfigMap {namespace}/{helpers_name(name)}",
                    lambda: self.core.create_namespaced_config_map(namespace, helpers),
                )
            except BackendUnavailable:
                raise
            except LauncherError as exc:
                raise LauncherError(
                    f"{exc} (the job's helper scripts go in a ConfigMap; without the right to create one, "
                    "set [backends.kubernetes] helpers_configmap = false to run the image's own openlab)"
                ) from None
        if secret is not None:
            try:
                self._call(
                    f"create Secret {namespace}/{env_secret_name(name)}",
                    lambda: self.core.create_namespaced_secret(namespace, secret),
                )
            except LauncherError as exc:
                self._delete_companions(job_id, service=False, helpers=helpers is not None, secret=False)
                if isinstance(exc, BackendUnavailable):
                    raise
                names = ", ".join(sorted(secret["data"]))
                raise LauncherError(
                    f"{exc} (the job's secret-named variables ({names}) go in a Secret, so that its manifest "
                    "does not show their values: grant create, patch, delete on secrets (infra/k8s/rbac.yaml), "
                    "or give them to its pods from a Secret of your own in the job template)"
                ) from None
        try:
            if service is not None:
                self._call(
                    f"create Service {job_id}",
                    lambda: self.core.create_namespaced_service(namespace, service),
                )
            created = self._call(f"create Job {job_id}", lambda: self.batch.create_namespaced_job(namespace, manifest))
        except LauncherError:
            self._delete_companions(job_id, **made)
            raise
        except BaseException:  # Ctrl-C, SIGTERM: the Job may be in; nobody learns its name, so it must not run
            self._withdraw(job_id, **made)
            raise
        uid = getattr(getattr(created, "metadata", None), "uid", None)
        try:
            if service is not None:
                self._own(job_id, uid, "Service", name, self.core.patch_namespaced_service)
            if helpers is not None:
                self._own(job_id, uid, "ConfigMap", helpers_name(name), self.core.patch_namespaced_config_map)
            if secret is not None:
                self._own(job_id, uid, "Secret", env_secret_name(name), self.core.patch_namespaced_secret)
        except BaseException:  # refused, or interrupted: the submit fails, so the Job it made goes too
            self._withdraw(job_id, **made)
            raise
        return JobHandle(self.name, job_id, str(self.settings.logs_dir / f"k8s-{namespace}-{name}.log"))

    def _delete_job(self, job_id: str) -> None:
        """Delete a Job, its pods after it (Background propagation: the call does not wait for them)."""
        from kubernetes import client

        namespace, name = self._split(job_id)
        self._call(
            f"delete Job {job_id}",
            lambda: self.batch.delete_namespaced_job(
                name, namespace, body=client.V1DeleteOptions(propagation_policy="Background")
            ),
            not_found=lambda: None,
        )

    def _withdraw(self, job_id: str, *, service: bool, helpers: bool, secret: bool) -> None:
        """Undo a submit that did not return: delete the Job (if it was made) and what was made for it.
        Best effort: the submit's own error is the one to report."""
        try:
            self._delete_job(job_id)
            # its pods first: one the Job controller made meanwhile must not start without its ConfigMap
            deadline = time.monotonic() + self.cancel_wait()
            while self.pods(job_id) and time.monotonic() < deadline:
                time.sleep(0.2)
            self._delete_companions(job_id, service=service, helpers=helpers, secret=secret)
        except Exception as exc:  # noqa: BLE001 - warned; the submit's own error goes on up
            log.warning(
                "could not remove %s after its submit failed: %s; delete it by hand (kubectl delete job)", job_id, exc
            )

    def _own(self, job_id: str, uid: str | None, kind: str, name: str, patch: Callable[..., Any]) -> None:
        """Make the Job the owner of its Service, ConfigMap or Secret, so Kubernetes deletes that with the
        Job (its TTL, or a user's ``kubectl delete``) even if openlab never gets to."""
        if not uid:  # an API server always assigns one; without it, deleting it is openlab's alone
            return
        namespace, job = self._split(job_id)
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": uid, "blockOwnerDeletion": False}
        self._call(
            f"make Job {job_id} own its {kind} {name}",
            lambda: patch(name, namespace, {"metadata": {"ownerReferences": [owner]}}),
            not_found=lambda: None,
        )

    def _delete_companions(
        self, job_id: str, *, service: bool = True, helpers: bool = True, secret: bool | None = True
    ) -> None:
        """Delete a Job's headless Service, helpers ConfigMap and variables' Secret (any gone or never
        made: nothing to do). ``secret=None``: perhaps one, so a namespace that refuses openlab Secrets
        (which jobs without secret variables do not need) is no error."""
        namespace, name = self._split(job_id)
        if service:
            self._call(
                f"delete Service {job_id}",
                lambda: self.core.delete_namespaced_service(name, namespace),
                not_found=lambda: None,
            )
        if helpers:
            self._call(
                f"delete ConfigMap {namespace}/{helpers_name(name)}",
                lambda: self.core.delete_namespaced_config_map(helpers_name(name), namespace),
                not_found=lambda: None,
            )
        if secret or secret is None:
            try:
                self._call(
                    f"delete Secret {namespace}/{env_secret_name(name)}",
                    lambda: self.core.delete_namespaced_secret(env_secret_name(name), namespace),
                    not_found=lambda: None,
                )
            except LauncherError as exc:
                if secret or isinstance(exc, BackendUnavailable):
                    raise
                log.debug("no Secret of %s deleted: %s", job_id, exc)

    def _nodes(self, job_id: str) -> int:
        """How many pods (nodes) a Job runs at once: its ``completions`` when indexed, else 1; 0 when
        the Job is gone (its pods may outlive it a while)."""
        namespace, name = self._split(job_id)
        job = self._call(
            f"read Job {job_id}", lambda: self.batch.read_namespaced_job(name, namespace), not_found=lambda: None
        )
        if job is None:
            return 0
        if job.spec is None or job.spec.completion_mode != "Indexed":
            return 1
        return int(job.spec.completions or 1)

    def _companions(self, job_id: str) -> dict[str, bool | None]:
        """Which of its Service, helpers ConfigMap and Secret a Job was given (all, to be sure, when the
        Job is gone already: deleting what does not exist is a no-op)."""
        namespace, name = self._split(job_id)
        job = self._call(
            f"read Job {job_id}", lambda: self.batch.read_namespaced_job(name, namespace), not_found=lambda: None
        )
        return self._companions_of(job_id, job)

    @classmethod
    def _companions_of(cls, job_id: str, job: Any) -> dict[str, bool | None]:
        """:meth:`_companions` of a Job as read (None: gone)."""
        _, name = cls._split(job_id)
        if job is None or job.spec is None:
            return {"service": True, "helpers": True, "secret": None}
        pod = job.spec.template.spec if job.spec.template and job.spec.template.spec else None
        volumes = (pod.volumes or []) if pod is not None else []
        env = (pod.containers[0].env or []) if pod is not None and pod.containers else []
        refs = [e.value_from.secret_key_ref for e in env if e.value_from and e.value_from.secret_key_ref]
        return {
            "service": job.spec.completion_mode == "Indexed",
            "helpers": any(v.name == HELPERS_VOLUME for v in volumes),
            "secret": any(ref.name == env_secret_name(name) for ref in refs),
        }

    def _final_path(self, job_id: str) -> Path:
        return self.state_dir / (job_id.replace("/", "__") + ".json")

    def _saved(self, job_id: str) -> JobStatus | None:
        path = self._final_path(job_id)
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return JobStatus(
            JobState(data["state"]),
            data.get("exit_code"),
            data.get("reason"),
            data.get("host"),
            _aware(data.get("started_at")),
            _aware(data.get("ended_at")),
            data.get("image_digest"),
            usage=data.get("usage"),
        )

    def _save(self, job_id: str, status: JobStatus) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._final_path(job_id).write_text(json.dumps(status.to_dict()))

    def pods(self, job_id: str) -> list[Any]:
        """The Job's pods, newest last (selector sent, and applied again here), up to one stopped at its
        time limit (:func:`_up_to_time_limit`)."""
        namespace, name = self._split(job_id)
        found = self._call(
            f"list pods of {job_id}",
            lambda: self.core.list_namespaced_pod(namespace, label_selector=f"job-name={name}"),
            not_found=lambda: None,
        )
        return _up_to_time_limit(_pods_of(found.items if found is not None else [], name))

    def _pods_at(self, job_id: str, index: int | None) -> list[Any]:
        """The Job's pods, or (``index`` given) those of one index of an indexed Job, newest last."""
        pods = self.pods(job_id)
        if index is None:
            return pods
        return [p for p in pods if _index_of(p) == index]

    def find(self, labels: Mapping[str, str]) -> list[JobHandle]:
        """Jobs of the launcher's namespace (a job sent to another by its own ``namespace`` option is
        not looked for) whose annotations hold ``labels``: every label is one, where a value that
        is no valid label value is not a label (:meth:`manifest`)."""
        wanted = {str(k): str(v) for k, v in labels.items()}
        selector = ",".join(
            [JOB_NAME_LABEL] + [f"{k}={v}" for k, v in wanted.items() if _LABEL_VALUE.match(v) and len(v) <= 63]
        )
        namespace = self.namespace
        jobs = self._call(
            f"list Jobs in namespace {namespace}",
            lambda: self.batch.list_namespaced_job(namespace, label_selector=selector),
        )
        found = []
        for job in jobs.items or []:
            notes = job.metadata.annotations or {}
            if all(notes.get(k) == v for k, v in wanted.items()):  # the selector, applied again here
                ns, name = job.metadata.namespace or namespace, job.metadata.name
                found.append(JobHandle(self.name, f"{ns}/{name}", str(self.settings.logs_dir / f"k8s-{ns}-{name}.log")))
        return found

    def status(self, handle: JobHandle) -> JobStatus:
        namespace, name = self._split(handle.job_id)
        job = self._call(
            f"read Job {handle.job_id}", lambda: self.batch.read_namespaced_job(name, namespace), not_found=lambda: None
        )
        if job is None:
            saved = self._saved(handle.job_id)
            return saved or JobStatus(JobState.LOST, reason=f"Job {handle.job_id} no longer exists")
        return self._status_of(handle, job)

    def statuses(self, handles: Sequence[JobHandle]) -> list[JobStatus | Exception]:
        """Every handle's state with two list calls per namespace (its openlab Jobs, and their
        pods) where one by one it takes a read and a list per job.

        A Job the lists do not show (deleted by its TTL, made before openlab labelled its Jobs)
        and every job of a namespace that refuses the lists is asked about by :meth:`status`, so
        each answer is the one it gives.
        """
        if len(handles) < 2:
            return super().statuses(handles)
        listed: dict[str, tuple[dict[str, Any], list[Any]] | None] = {}
        for handle in handles:
            namespace = handle.job_id.partition("/")[0] if "/" in handle.job_id else None
            if namespace is None or namespace in listed:
                continue
            try:
                jobs = self._call(
                    f"list Jobs in namespace {namespace}",
                    lambda ns=namespace: self.batch.list_namespaced_job(ns, label_selector=JOB_NAME_LABEL),
                )
                pods = self._call(
                    f"list pods in namespace {namespace}",
                    lambda ns=namespace: self.core.list_namespaced_pod(ns, label_selector=JOB_NAME_LABEL),
                )
            except LauncherError as exc:  # RBAC without list, say: one by one, as before
                log.debug("asking %s jobs one by one: %s", namespace, exc)
                listed[namespace] = None
            else:
                listed[namespace] = ({j.metadata.name: j for j in jobs.items or []}, pods.items or [])
        found: list[JobStatus | Exception] = []
        for handle in handles:
            namespace, _, name = handle.job_id.partition("/")
            entry = listed.get(namespace)
            job = entry[0].get(name) if entry is not None else None
            if entry is None or job is None:
                found.extend(super().statuses([handle]))
                continue
            try:
                found.append(self._status_of(handle, job, _pods_of(entry[1], name)))
            except Exception as exc:  # noqa: BLE001 - handed back in its job's place
                found.append(exc)
        return found

    def _status_of(self, handle: JobHandle, job: Any, pods: list[Any] | None = None) -> JobStatus:
        """The state of ``job`` (a Job object as read) from it and its pods (listed here when None)."""
        st = job.status
        conditions = {c.type: c for c in (st.conditions or []) if st is not None and c.status == "True"} if st else {}
        started = _aware(st.start_time) if st else None
        ended = _aware(st.completion_time) if st else None
        exit_code, host, digest, pod_reason, pod_message = None, None, None, None, None
        disruption = None
        if not (st and (st.active or st.succeeded or st.failed or conditions)):
            pods = []  # nothing ran yet
        elif pods is None:
            pods = self.pods(handle.job_id)
        # A pod the kubelet stopped at its activeDeadlineSeconds is the job's time limit, whatever the Job
        # controller does next (cleanup deletes a Job it would go on with).
        pods = _up_to_time_limit(pods)
        limited = next((p for p in pods if _past_deadline(p)), None)
        started = _started(pods) or started  # its first pod on a node: the time it waited is not run time
        current = _current(pods)  # one pod per index (the last one); the last pod of a plain Job
        ends_prefix = (job.metadata.annotations or {}).get(TASK_ENDS_ANNOTATION)
        if current:
            pod = limited if limited is not None else _deciding(current, ends_prefix)
            host = ",".join(sorted({p.spec.node_name for p in current if p.spec and p.spec.node_name})) or None
            # Kubernetes marks a pod it evicts or preempts (Eviction API, scheduler preemption, node
            # pressure, taints) with the DisruptionTarget condition before it stops it.
            disruption = next(
                (
                    c
                    for p in [pod, *current]
                    for c in ((p.status.conditions or []) if p.status else [])
                    if c.type == "DisruptionTarget" and c.status == "True"
                ),
                None,
            )
            main = _main_status(pod)  # not a sidecar's: its image, exit code and message are not the job's
            digest = (main.image_id or None) if main is not None else None
            term = _terminated(pod)
            if term is not None:
                exit_code = term.exit_code
                pod_reason = term.reason if term.reason not in (None, "Completed", "Error") else None
                pod_message = term.message
                started = started or _aware(term.started_at)
                ended = ended or _aware(term.finished_at)
        if "Complete" in conditions or "SuccessCriteriaMet" in conditions:
            state, reason = JobState.SUCCEEDED, None
            exit_code = 0 if exit_code is None else exit_code
            cond = conditions.get("Complete") or conditions["SuccessCriteriaMet"]
            ended = ended or _aware(cond.last_transition_time)
        elif limited is not None and any(_main_running(p) for p in current):  # stopping, within the grace period
            state, reason = JobState.RUNNING, None
        elif limited is not None:  # as the Job-level DeadlineExceeded below
            state = JobState.FAILED
            reason = f"{TIME_LIMIT_REASON} ({limited.spec.active_deadline_seconds}s)"
        elif "Failed" in conditions or "FailureTarget" in conditions:
            cond = conditions.get("Failed") or conditions["FailureTarget"]
            state = JobState.FAILED
            if disruption is not None and cond.reason != "DeadlineExceeded":
                state = JobState.PREEMPTED
                reason = f"pod stopped by Kubernetes: {disruption.reason}" + (
                    f" ({disruption.message})" if disruption.message else ""
                )
            elif cond.reason == "DeadlineExceeded":
                reason = f"{TIME_LIMIT_REASON} ({job.spec.active_deadline_seconds}s)"
            elif pod_reason == "OOMKilled":
                reason = "out of memory"
            elif exit_code is not None:
                reason = f"exit code {exit_code}" + (f" ({cond.reason})" if cond.reason else "")
            else:
                reason = cond.message or cond.reason or "failed"
            ended = ended or _aware(cond.last_transition_time)
        elif st and (st.active or (st.ready or 0) > 0):
            state, reason = JobState.RUNNING, None
        else:
            state, reason = JobState.PENDING, None
        if state is JobState.PENDING and pods and pods[-1].status and pods[-1].status.phase == "Running":
            state = JobState.RUNNING
        if state is JobState.RUNNING and current and all(_phase(p) == "Pending" for p in current):
            waiting = _waiting(current)  # active to the Job controller, but no pod of it runs: say why
            if waiting and waiting.split(":", 1)[0] in NEVER_STARTS:
                # the kubelet retries these for ever (a Job with no time limit waited for good, one with a
                # limit failed as "time limit exceeded" without having run): the image name is the job's
                state, reason, started = JobState.FAILED, f"the container cannot start: {waiting}", None
            elif waiting:
                state, reason, started = JobState.PENDING, waiting, None
        if not state.terminal:
            exit_code, ended = None, None
        notes = []
        if current and state is JobState.FAILED and (pod_reason in START_ERRORS or exit_code == 127):  # not started
            notes.append(self._not_started(handle, job, pod, pod_message if pod_reason in START_ERRORS else None))
        if state.terminal and exit_code:  # a multi-task pod: which task failed first
            notes.append(first_failed_task(ends_prefix))
        if state.terminal and len(current) > 1 and exit_code:  # several nodes: which pod ended the job
            notes.append(f"pod {_pod_end(pod)} ended first of {len(current)}")
        now = {p.metadata.name for p in current}
        replaced = [p for p in pods if p.metadata.name not in now]
        if state.terminal and replaced:  # the Job controller replaced failed pods (backoffLimit)
            before = ", ".join(_pod_end(p) for p in replaced)
            notes.append(f"Kubernetes ran {len(pods)} pods (backoffLimit); before the last: {before}")
        reason = with_notes(reason, *notes)
        usage = _pods_usage(pods) if state.terminal else None  # every pod of the Job, replaced ones too
        return JobStatus(state, exit_code, reason, host, started, ended, digest, usage=usage)

    def _not_started(self, handle: JobHandle, job: Any, pod: Any, runtime_said: str | None) -> str | None:
        """What could not start in the pod that decided the Job: from the runtime's message (a
        StartError), else from the end of the pod's log (a helper script's "cannot run")."""
        pythons = ((job.metadata.annotations or {}).get(HELPERS_PYTHON_KEY) or "").split()
        if runtime_said is not None:
            return not_started(runtime_said, pythons, "kubernetes") or runtime_said
        resp = self._read_log(handle, tail=20, pods=[pod])
        return not_started(resp.data.decode("utf-8", "replace") if resp is not None else "", pythons, "kubernetes")

    def _read_log(
        self, handle: JobHandle, *, tail: int | None = None, follow: bool = False, pods: list[Any] | None = None
    ) -> Any:
        namespace, _ = self._split(handle.job_id)
        pods = self.pods(handle.job_id) if pods is None else pods
        if not pods:
            return None
        main = _main_status(pods[-1])
        if main is not None and main.state and main.state.waiting is not None:
            return None  # not started (pulling its image, say): the kubelet answers 400 "waiting to start"
        pod = pods[-1].metadata.name
        kwargs: dict[str, Any] = {"_preload_content": False}
        container = _main_name(pods[-1])
        if container is not None:  # required once a pod has a sidecar: 400 "a container name must be specified"
            kwargs["container"] = container
        if tail is not None:
            kwargs["tail_lines"] = tail
        if follow:
            kwargs["follow"] = True
        return self._call(
            f"read the log of pod {namespace}/{pod}",
            lambda: self.core.read_namespaced_pod_log(pod, namespace, **kwargs),
            not_found=lambda: None,
        )

    def _secrets(self, job_id: str) -> list[str]:
        """The values to mask in a Job's log: those this process gave it and its own environment's
        (the W&B key a pipeline passes on). Pods print what they like, and the API server keeps it;
        what openlab streams, shows and keeps in ``logs/`` has them as ``***``. A process that knows
        neither (``job logs`` from another shell without the key) shows the log as the API has it:
        openlab may not read Secrets back (infra/k8s/rbac.yaml)."""
        return [*self._given_secrets.get(job_id, []), *secret_values()]

    def logs(self, handle: JobHandle, *, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        secrets = self._secrets(handle.job_id)
        lines = self._unmasked_logs(handle, follow=follow, tail=tail)
        return (scrub(line, secrets) for line in lines) if secrets else lines

    def _unmasked_logs(self, handle: JobHandle, *, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        nodes = self._nodes(handle.job_id)
        if nodes > 1:
            yield from self._logs_of_nodes(handle, nodes, follow=follow, tail=tail)
            return
        if not follow:
            saved = Path(handle.log_path) if handle.log_path else None
            # A deleted Job's log is the one kept at cleanup (every node's), even while its pods terminate.
            resp = None if nodes == 0 and saved is not None and saved.exists() else self._read_log(handle, tail=tail)
            if resp is None:
                if saved is not None and saved.exists():
                    from orchestrator.launchers.local import follow_file

                    yield from follow_file(saved, lambda: True, follow=False, tail=tail)
                return
            yield from resp.data.decode("utf-8", "replace").splitlines()
            return
        yield from self._follow(handle, tail)

    def _node_logs(self, handle: JobHandle) -> bytes:
        """Every pod's log of a several-node Job, in index order (their lines carry global ranks)."""
        out = b""
        for pod in _current(self.pods(handle.job_id)):
            resp = self._read_log(handle, pods=[pod])
            if resp is not None:
                data = resp.data
                out += data if not data or data.endswith(b"\n") else data + b"\n"
        return out

    def _logs_of_nodes(self, handle: JobHandle, nodes: int, *, follow: bool, tail: int | None) -> Iterator[str]:
        """A several-node Job's log: every pod's lines (each labelled with its task's global rank).
        Followed, one follower per pod feeds a queue, so lines come as each pod writes them;
        ``tail`` is then each pod's last lines."""
        if not follow:
            lines = self._node_logs(handle).decode("utf-8", "replace").splitlines()
            yield from lines[-tail:] if tail else ([] if tail == 0 else lines)
            return
        import queue
        import threading

        lines_q: queue.Queue[tuple[int, str | BaseException | None]] = queue.Queue()
        asked = threading.Lock()
        last: list[Any] = [0.0, False]  # when the Job's state was last read, and whether it had ended

        def ended() -> bool:
            """Whether the Job has ended, read at most every FOLLOW_RETRY_S for all the followers
            together: N pods' followers must not each poll the API server."""
            with asked:
                if not last[1] and time.monotonic() - last[0] >= FOLLOW_RETRY_S:
                    last[:] = [time.monotonic(), self.status(handle).state.terminal]
                return bool(last[1])

        def pump(index: int) -> None:
            try:
                for line in self._follow(handle, tail, index=index, ended=ended):
                    lines_q.put((index, line))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the reader below
                lines_q.put((index, exc))
            lines_q.put((index, None))

        for index in range(nodes):
            threading.Thread(target=pump, args=(index,), name=f"k8s-log-{index}", daemon=True).start()
        running = nodes
        while running:
            _, item = lines_q.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    def _follow(
        self,
        handle: JobHandle,
        tail: int | None,
        index: int | None = None,
        ended: Callable[[], bool] | None = None,
    ) -> Iterator[str]:
        """Stream with ``follow=true``; when a stream ends early (API restart, an emulator), read again.

        Logs only grow, so each new read skips the lines already yielded. The re-reads back off
        from 50 ms to at most FOLLOW_RETRY_S, not ``poll_interval``: that is how often status is
        looked at (a minute, for a gentle user), and lines must not wait for it, nor be cut off
        when the job ends while the follower sleeps.
        """
        backoff = Backoff(min(self.poll_interval, FOLLOW_RETRY_S), first=0.05)
        seen = 0
        if tail is not None:
            resp = self._read_log(handle, pods=self._pods_at(handle.job_id, index))
            lines = resp.data.decode("utf-8", "replace").splitlines() if resp is not None else []
            yield from lines[-tail:] if tail else []
            seen = len(lines)
        following: Any = None  # the pod whose log is read; the Job controller may replace it (backoffLimit)
        while True:
            done = ended() if ended is not None else self.status(handle).state.terminal
            pods = self._pods_at(handle.job_id, index)
            if pods and following is not None and pods[-1].metadata.name != following.metadata.name:
                old = next((p for p in pods if p.metadata.name == following.metadata.name), following)  # as it ended
                yield f"[openlab] pod {_pod_end(old)}; Kubernetes started pod {pods[-1].metadata.name} (backoffLimit)"
                seen = 0  # a new pod's log starts from its first line
            following = pods[-1] if pods else following
            resp = self._read_log(handle, follow=not done, pods=pods)
            if resp is not None:
                partial, count = b"", 0
                for chunk in resp.stream(4096):
                    partial += chunk
                    *lines_b, partial = partial.split(b"\n")
                    for line in lines_b:
                        count += 1
                        if count > seen:
                            yield line.decode("utf-8", "replace")
                if partial:
                    count += 1
                    if count > seen:
                        yield partial.decode("utf-8", "replace")
                resp.release_conn()
                if count > seen:
                    backoff.reset()
                seen = max(seen, count)
            if done:
                return
            backoff.sleep()

    def cancel_wait(self) -> float:
        """How long a cancel waits for the Job's pods to go: ``cancel_timeout``, else the pods' own
        grace (the template's ``terminationGracePeriodSeconds``, Kubernetes' 30 s) and 30 s more.
        It was 30 s flat, as long as the grace a job that saves on SIGTERM is given: such a cancel
        ended "pods still exist", and the attempt FAILED instead of CANCELLED."""
        pod = ((self.template().get("spec") or {}).get("template") or {}).get("spec") or {}
        grace = pod.get("terminationGracePeriodSeconds")
        grace = 30 if grace is None else grace
        return number_option(self.config, "cancel_timeout", float(grace) + 30)

    def cancel(self, handle: JobHandle) -> None:
        status = self.status(handle)
        if status.state.terminal:
            self.cleanup(handle)
            return
        self._save_logs(handle)
        status.state, status.reason, status.ended_at = JobState.CANCELLED, "cancelled", dt.datetime.now(dt.UTC)
        self._save(handle.job_id, status)
        self._delete_companions(handle.job_id, **self._companions(handle.job_id))
        self._delete_job(handle.job_id)
        timeout = self.cancel_wait()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.pods(handle.job_id):
                return
            time.sleep(0.2)
        raise LauncherError(
            f"pods of {handle.job_id} still exist {timeout:g}s after the Job was deleted "
            "([backends.kubernetes] cancel_timeout)"
        )

    def _save_logs(self, handle: JobHandle) -> None:
        if not handle.log_path:
            return
        try:
            resp = self._read_log(handle)
        except LauncherError:
            return
        if resp is not None:
            path = Path(handle.log_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            data = self._node_logs(handle) if self._nodes(handle.job_id) > 1 else resp.data
            if secrets := self._secrets(handle.job_id):
                data = scrub(data.decode("utf-8", "replace"), secrets).encode()
            path.write_bytes(data)

    def cleanup(self, handle: JobHandle) -> None:
        """Keep the final status and log, then delete the finished Job (its TTL would anyway)."""

        status = self.status(handle)
        if not status.state.terminal or self._final_path(handle.job_id).exists() and status.state is JobState.LOST:
            return
        self._save_logs(handle)
        self._save(handle.job_id, status)
        namespace, name = self._split(handle.job_id)
        job = self._call(
            f"read Job {handle.job_id}", lambda: self.batch.read_namespaced_job(name, namespace), not_found=lambda: None
        )
        # A Job Kubernetes has not finished though openlab has (a pod stopped at its time limit, which the
        # Job controller would replace under backoffLimit) is deleted whatever delete_finished says.
        going_on = (
            job is not None
            and (6 if job.spec is None or job.spec.backoff_limit is None else job.spec.backoff_limit) > 0
            and not any(
                c.status == "True" and c.type in ("Complete", "SuccessCriteriaMet", "Failed", "FailureTarget")
                for c in ((job.status.conditions or []) if job.status else [])
            )
        )
        if flag_option(self.config, "delete_finished", True) or going_on:
            self._delete_companions(handle.job_id, **self._companions_of(handle.job_id, job))
            self._delete_job(handle.job_id)

    def check(self) -> tuple[bool, str]:
        try:
            self._call(
                f"list Jobs in namespace {self.namespace}",
                lambda: self.batch.list_namespaced_job(self.namespace, limit=1),
            )
            refused = self._refused()
        except LauncherError as exc:
            return False, str(exc)
        host = self.api_client.configuration.host
        where = f"API at {host}, namespace {self.namespace}"
        # Secrets only for jobs given secret-named variables: without them the rest runs, so it is said, not failed.
        needed = [text for resource, text in refused or [] if resource != "secrets"]
        if needed:
            texts = "; ".join(text for _, text in refused or [])
            return False, f"{where}: may not {texts} (grant the Role in infra/k8s/rbac.yaml)"
        rights = "rights not checked: the server answers no SelfSubjectAccessReview" if refused is None else "rights ok"
        if refused:
            rights += f" except: may not {refused[0][1]}: such a job is refused (grant the Role in infra/k8s/rbac.yaml)"
        return True, f"{where}, {rights}, manifests validated for Kubernetes {self.version}"

    def refused_rights(self) -> list[str] | None:
        """What of :data:`API_NEEDS` the server says this client may not do in its namespace, one
        entry per resource (``create, patch configmaps (jobs of several tasks...)``), as ``kubectl
        auth can-i`` asks it (SelfSubjectAccessReview); None when the server answers no such review.
        ConfigMaps are not needed with ``helpers_configmap = false``; Secrets only by jobs given
        secret-named variables (``-e WANDB_API_KEY=...``), so :meth:`check` names them without failing."""
        refused = self._refused()
        return None if refused is None else [text for _, text in refused]

    def _refused(self) -> list[tuple[str, str]] | None:
        """:meth:`refused_rights`, each with its resource."""
        from kubernetes import client

        auth = client.AuthorizationV1Api(self.api_client)
        refused: list[tuple[str, str]] = []
        for group, resource, verbs, why in API_NEEDS:
            if resource == "configmaps" and not flag_option(self.config, "helpers_configmap", True):
                continue
            name, _, sub = resource.partition("/")
            denied = []
            for verb in verbs:
                attrs = client.V1ResourceAttributes(
                    namespace=self.namespace, verb=verb, group=group, resource=name, subresource=sub or None
                )
                review = client.V1SelfSubjectAccessReview(
                    spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs)
                )
                try:
                    answer = self._call(
                        f"review access to {resource}", lambda r=review: auth.create_self_subject_access_review(r)
                    )
                except LauncherError:  # an API server without the review (or that refuses it to us)
                    return None
                if not (answer.status and answer.status.allowed):
                    denied.append(verb)
            if denied:
                refused.append((resource, f"{', '.join(denied)} {resource} ({why})"))
        return refused
