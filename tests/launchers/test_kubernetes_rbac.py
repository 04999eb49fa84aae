"""What the Kubernetes launcher asks of the API server, what ``infra/k8s/rbac.yaml`` grants, and what
``backends check`` says when a namespace grants less.

A cluster admin applies that Role for openlab's service account; if the launcher starts calling
something the Role does not grant, every job on such a cluster fails with "forbidden" (the helpers
ConfigMap was such a call). ``API_NEEDS`` in the launcher is the one list of what it needs: the Role
must grant exactly that, and jobs that use every path (a several-node job of several tasks under the
usage wrapper, a cancel, ``backends check``) against the emulated API server, which then enforces the
Role as RBAC does, must succeed and ask for all of it and nothing else."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from orchestrator.launchers import JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.launchers.base import LauncherError
from orchestrator.launchers.kubernetes import API_NEEDS
from orchestrator.lineage import LineageStore
from tests.conftest import REPO_ROOT
from tests.launchers.k8s_emulator import EmulatedCluster, rbac_of

RBAC = REPO_ROOT / "infra" / "k8s" / "rbac.yaml"
NEEDED = {(group, resource, verb) for group, resource, verbs, _ in API_NEEDS for verb in verbs}


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


def test_requests_map_to_rbac_as_the_api_server_does() -> None:
    assert rbac_of("GET", "/apis/batch/v1/namespaces/ml/jobs", {}) == ("batch", "jobs", "list")
    assert rbac_of("GET", "/apis/batch/v1/namespaces/ml/jobs", {"watch": "true"}) == ("batch", "jobs", "watch")
    assert rbac_of("GET", "/apis/batch/v1/namespaces/ml/jobs/j", {}) == ("batch", "jobs", "get")
    assert rbac_of("GET", "/api/v1/namespaces/ml/pods/p/log", {"follow": "true"}) == ("", "pods/log", "get")
    assert rbac_of("PATCH", "/api/v1/namespaces/ml/configmaps/c", {}) == ("", "configmaps", "patch")
    assert rbac_of("POST", "/api/v1/namespaces/ml/services", {}) == ("", "services", "create")


def test_the_role_in_infra_grants_what_the_launcher_needs_and_no_more() -> None:
    assert _granted(RBAC) == NEEDED


@pytest.mark.docker
def test_under_the_role_every_path_works_and_asks_for_all_of_it_and_nothing_else(
    k8s_cluster: EmulatedCluster, store: LineageStore
) -> None:
    from tests.services import require_docker

    require_docker()
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    before = len(k8s_cluster.requests())
    launcher = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image, measure_usage=True)
    launcher.poll_interval = 0.2
    with k8s_cluster.rbac(_granted(RBAC)):
        # Job, Service, ConfigMap and Secret made and owned, pods listed, logs followed, all deleted at cleanup
        lines: list[str] = []
        check_key = "import os; print('hello' if os.environ['WANDB_API_KEY'] == 'rbac-secret-value' else 'no key')"
        spec = JobSpec(
            name="rbac",
            command=["python", "-c", check_key],
            nodes=2,
            cpus=0.5,
            env={"WANDB_API_KEY": "rbac-secret-value"},
        )
        _, status = run_job(store, launcher, spec, on_log=lines.append, timeout=180)
        assert status.state is JobState.SUCCEEDED, (status, lines)
        assert lines.count("0: hello") == 1 and lines.count("1: hello") == 1, lines

        # a running job cancelled
        handle = launcher.submit(JobSpec(name="rbac-cancel", command=["sleep", "120"]))
        deadline = time.monotonic() + 60
        while launcher.status(handle).state is not JobState.RUNNING and time.monotonic() < deadline:
            time.sleep(0.2)
        launcher.cancel(handle)
        assert launcher.status(handle).state is JobState.CANCELLED

        ok, why = launcher.check()
        assert ok and "rights ok" in why, why

    asked: dict[tuple[str, str, str], str] = {}
    for method, path, params in k8s_cluster.requests()[before:]:
        if "/namespaces/" in path:
            asked.setdefault(rbac_of(method, path, params), f"{method} {path}")
    assert not {rule: example for rule, example in asked.items() if rule not in NEEDED}, "API_NEEDS misses these"
    assert not NEEDED - set(asked), f"API_NEEDS lists what the launcher never asked for: {NEEDED - set(asked)}"


@pytest.mark.docker
def test_a_namespace_without_configmap_rights_is_found_by_backends_check_and_named_at_submit(
    k8s_cluster: EmulatedCluster, store: LineageStore
) -> None:
    """``backends check`` asks the server (``kubectl auth can-i``'s review) before any job is sent;
    a job that needs a ConfigMap there fails in one line saying how to do without; and
    ``helpers_configmap = false`` then passes the check and runs the image's own helpers."""
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    no_configmaps = {rule for rule in _granted(RBAC) if rule[1] != "configmaps"}
    launcher = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image, measure_usage=True)
    with k8s_cluster.rbac(no_configmaps):
        ok, why = launcher.check()
        assert not ok, why
        assert why.endswith(
            ": may not create, patch, delete configmaps (jobs of several tasks or measured: helpers_configmap)"
            " (grant the Role in infra/k8s/rbac.yaml)"
        ), why

        with pytest.raises(LauncherError) as refused:
            launcher.submit(JobSpec(name="needs-helpers", command=["true"]))
        assert "configmaps is forbidden" in str(refused.value), refused.value
        assert "set [backends.kubernetes] helpers_configmap = false" in str(refused.value), refused.value
        assert not [n for _, n in k8s_cluster.jobs() if "-needs-helpers-" in n], "no Job is sent"

        own = get_launcher(
            "kubernetes", host=k8s_cluster.url, image=k8s_cluster.image, measure_usage=True, helpers_configmap=False
        )
        ok, why = own.check()
        assert ok, why
        own.poll_interval = 0.2
        _, status = run_job(store, own, JobSpec(name="own-helpers", command=["true"]), timeout=120)
        assert status.state is JobState.SUCCEEDED, status


@pytest.mark.docker
def test_a_namespace_without_secret_rights_refuses_only_jobs_given_secrets(
    k8s_cluster: EmulatedCluster, store: LineageStore
) -> None:
    """Only a job given secret-named variables needs the right to make a Secret: ``backends check``
    passes without it, saying which jobs are refused, and such a job is refused in one line naming
    its variables (not their values) and what to do, leaving nothing behind; other jobs run."""
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    no_secrets = {rule for rule in _granted(RBAC) if rule[1] != "secrets"}
    launcher = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image, measure_usage=True)
    launcher.poll_interval = 0.2
    with k8s_cluster.rbac(no_secrets):
        ok, why = launcher.check()
        assert ok, why
        assert (
            "rights ok except: may not create, patch, delete secrets (jobs given secret-named variables, for "
            "their values): such a job is refused (grant the Role in infra/k8s/rbac.yaml)"
        ) in why, why
        assert launcher.refused_rights() == [
            "create, patch, delete secrets (jobs given secret-named variables, for their values)"
        ]

        before = (set(k8s_cluster.configmaps()), set(k8s_cluster.secrets()))
        with pytest.raises(LauncherError) as refused:
            launcher.submit(JobSpec(name="needs-secret", command=["true"], env={"HF_TOKEN": "hf-refused-value"}))
        message = str(refused.value)
        assert "secrets is forbidden" in message and "(HF_TOKEN)" in message, message
        assert "grant create, patch, delete on secrets (infra/k8s/rbac.yaml)" in message, message
        assert "hf-refused-value" not in message
        assert not [n for _, n in k8s_cluster.jobs() if "-needs-secret-" in n], "no Job is sent"
        assert (set(k8s_cluster.configmaps()), set(k8s_cluster.secrets())) == before, "its ConfigMap is deleted"

        _, status = run_job(store, launcher, JobSpec(name="no-secret", command=["true"], env={"A": "1"}), timeout=120)
        assert status.state is JobState.SUCCEEDED, status
