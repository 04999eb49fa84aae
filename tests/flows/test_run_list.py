"""Finding openlab's runs in the UI's run list: flow runs tagged with their recipe, replica and
backend (as their stages' task runs are), the nightly's verdict task tagged like the stages, and
the reaper's, the gc's and the digest's runs named for what they do. Real flows in this process
against a real Prefect server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.prefect_server import PrefectServer

pytestmark = [pytest.mark.prefect]


def _flow_run(state: Any) -> Any:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id)


def test_a_replica_flow_run_is_tagged_with_its_recipe_replica_and_backend(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    """The run list filters flow runs by tag: a replica's runs, or a backend's, are found without
    opening each; the tags a run was created with (a sweep's, a deployment's) stay."""
    from prefect import tags

    from flows.pipeline import replica_pipeline

    with tags("sweep"):
        state = replica_pipeline(replica="tiny", backend="local", dry_run=True, return_state=True)
    assert state.is_completed(), state.message
    assert set(_flow_run(state).tags) == {
        "sweep",
        "openlab",
        "recipe:marin-535b-a23b",
        "replica:tiny",
        "backend:local",
    }


def test_the_reaper_gc_and_digest_runs_are_named_for_what_they_do(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    from flows.digest import github_digest
    from flows.gc import collect_outputs
    from flows.reconcile import reconcile_lineage

    reaped = reconcile_lineage(dry_run=True, return_state=True)
    assert reaped.is_completed(), reaped.message
    assert _flow_run(reaped).name == "reconcile (dry run)"
    collected = collect_outputs(stages=["pretrain"], replica="tiny", return_state=True)
    assert collected.is_completed(), collected.message
    assert _flow_run(collected).name == "gc: keep 3, unused for 7d of pretrain tiny (dry run)"
    digested = github_digest(since="7d", dry_run=True, return_state=True)
    assert digested.is_completed(), digested.message
    assert _flow_run(digested).name == "digest since 7d (dry run)"


def test_the_nightly_verdict_task_and_the_nightly_run_carry_the_replicas_tags(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    from flows.nightly import nightly_replica

    state = nightly_replica(replica="drops-tiny", backend="local", git_ref="HEAD", return_state=True)
    assert state.is_completed(), state.message
    assert state.result()["verdict"]["status"] == "baseline"
    run = _flow_run(state)
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[run.id])))
    by_name = {t.name.rsplit("-", 1)[0]: set(t.tags) for t in tasks}
    assert by_name["nightly-verdict"] == {"openlab", "recipe:marin-535b-a23b", "replica:drops-tiny"}, by_name
    assert by_name["nightly-verdict"] <= by_name["repro"], by_name  # the stages' recipe and replica tags
    assert {"recipe:marin-535b-a23b", "replica:drops-tiny", "backend:local"} <= set(run.tags), run.tags
