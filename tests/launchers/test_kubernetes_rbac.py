"""``infra/k8s/rbac.yaml`` grants exactly what the Kubernetes launcher asks of the API server.

A cluster admin applies that Role for openlab's service account; if the launcher starts calling
something the Role does not grant, every job on such a cluster fails with "forbidden" (the helpers
ConfigMap was such a call). Here jobs that use every path (a several-node job of several tasks
under the usage wrapper, a cancel, ``backends check``) run against the emulated API, and each
request it answered is mapped to Kubernetes' RBAC (API group, resource, verb) and checked against
the Role; the Role granting something no request needed is a failure too (least privilege)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from orchestrator.launchers import JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.lineage import LineageStore
from tests.conftest import REPO_ROOT
from tests.launchers.k8s_emulator import EmulatedCluster

RBAC = REPO_ROOT / "infra" / "k8s" / "rbac.yaml"
WRITES = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def _granted(path: Path) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) the file's Role grants; every document passes strict validation."""
    import kubernetes_validate

    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    (account,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def rbac_of(method: str, path: str, params: dict[str, str]) -> tuple[str, str, str]:
    """The (API group, resource[/subresource], verb) RBAC checks for one namespaced request."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    assert rest[0] == "namespaces", path
    resource, name, sub = (rest[2:] + [None, None])[:3]
    if sub:
        resource = f"{resource}/{sub}"
    verb = WRITES.get(method) or ("get" if name else "watch" if params.get("watch") == "true" else "list")
    return group, str(resource), verb


def test_requests_map_to_rbac_as_the_api_server_does() -> None:
    assert rbac_of("GET", "/apis/batch/v1/namespaces/ml/jobs", {}) == ("batch", "jobs", "list")
    assert rbac_of("GET", "/apis/batch/v1/namespaces/ml/jobs", {"watch": "true"}) == ("batch", "jobs", "watch")
    assert rbac_of("GET", "/apis/batch/v1/namespaces/ml/jobs/j", {}) == ("batch", "jobs", "get")
    assert rbac_of("GET", "/api/v1/namespaces/ml/pods/p/log", {"follow": "true"}) == ("", "pods/log", "get")
    assert rbac_of("PATCH", "/api/v1/namespaces/ml/configmaps/c", {}) == ("", "configmaps", "patch")
    assert rbac_of("POST", "/api/v1/namespaces/ml/services", {}) == ("", "services", "create")


@pytest.mark.docker
def test_the_role_in_infra_allows_every_request_the_launcher_makes_and_no_more(
    k8s_cluster: EmulatedCluster, store: LineageStore
) -> None:
    from tests.services import require_docker

    require_docker()
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    granted = _granted(RBAC)
    before = len(k8s_cluster.requests())
    launcher = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image, measure_usage=True)
    launcher.poll_interval = 0.2

    # Job, Service and ConfigMap made and owned, pods listed, logs followed, all deleted at cleanup
    lines: list[str] = []
    spec = JobSpec(name="rbac", command=["python", "-c", "print('hello')"], nodes=2, cpus=0.5)
    _, status = run_job(store, launcher, spec, on_log=lines.append, timeout=180)
    assert status.state is JobState.SUCCEEDED, (status, lines)

    # a running job cancelled
    handle = launcher.submit(JobSpec(name="rbac-cancel", command=["sleep", "120"]))
    deadline = time.monotonic() + 60
    while launcher.status(handle).state is not JobState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.2)
    launcher.cancel(handle)
    assert launcher.status(handle).state is JobState.CANCELLED

    ok, why = launcher.check()
    assert ok, why

    asked: dict[tuple[str, str, str], str] = {}
    for method, path, params in k8s_cluster.requests()[before:]:
        if "/namespaces/" in path:
            asked.setdefault(rbac_of(method, path, params), f"{method} {path}")
    missing = {rule: example for rule, example in asked.items() if rule not in granted}
    assert not missing, f"{RBAC.name} does not grant: {missing}"
    unused = granted - set(asked)
    assert not unused, f"{RBAC.name} grants what the launcher never asked for: {sorted(unused)}"
