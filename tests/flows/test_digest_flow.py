"""The ``github-digest`` flow against a real Prefect server and the fake GitHub API: it posts one
digest per active issue, says so per issue in the flow's log and lists what it posted in an artifact."""

from __future__ import annotations

import time
from typing import Any

import pytest

from orchestrator.lineage.store import open_store
from orchestrator.prefect_server import PrefectServer
from tests.links.conftest import fake_github, openlab_env  # noqa: F401 - the fake GitHub API and its config
from tests.links.digest_runs import H, record_run
from tests.links.links_fakes import TOKEN, FakeGitHub

pytestmark = [pytest.mark.prefect]


def _logs(flow_run_id: Any, wanted: str, timeout: float = 30.0) -> str:
    """The flow run's log text once it holds ``wanted`` (logs reach the API in batches, after the state)."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            text = "\n".join(log.message for log in logs)
            if wanted in text or time.monotonic() > deadline:
                return text
            time.sleep(0.5)


def _artifact(flow_run_id: Any) -> Any:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return artifact


def test_digest_flow_posts_per_issue_logs_and_lists_them(
    prefect_server: PrefectServer,
    fake_github: FakeGitHub,  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flows.digest import github_digest
    from orchestrator.lineage.models import utcnow

    fake_github.add_issue("lab/exp", 8, title="experiment 8")
    now = utcnow()
    with open_store() as store:
        record_run(store, "prun_seven", "lab/exp#7", started=now - 3 * H, ended=now - 2 * H, state="COMPLETED")
        record_run(
            store,
            "prun_eight",
            "lab/exp#8",
            started=now - 5 * H,
            ended=now - 4 * H,
            state="FAILED",
            stages={"pretrain": "FAILED"},
            error="exit 3: CUDA out of memory",
        )
        record_run(store, "prun_lastweek", "lab/exp#8", started=now - 170 * H, ended=now - 169 * H, state="COMPLETED")

    state = github_digest(return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert {d["issue"]: d["outcome"] for d in result["digests"]} == {"lab/exp#7": "created", "lab/exp#8": "created"}
    [seven] = fake_github.comments_on("lab/exp", 7)
    [eight] = fake_github.comments_on("lab/exp", 8)
    assert "prun_seven" in seven["body"] and "prun_eight" in eight["body"] and "prun_lastweek" not in eight["body"]
    assert "**Failed:** `pretrain`: exit 3: CUDA out of memory" in eight["body"]

    flow_run_id = state.state_details.flow_run_id
    text = _logs(flow_run_id, "lab/exp#8: digest")
    day = f"{now:%Y-%m-%d}"
    assert f"lab/exp#7: digest {day} created (1 run(s)) {fake_github.web}/lab/exp/issues/7#issuecomment-" in text
    assert f"lab/exp#8: digest {day} created (1 run(s))" in text
    artifact = _artifact(flow_run_id)
    assert artifact.key == "github-digest" and f"digest {day}" in str(artifact.description)
    table = str(artifact.data)
    assert "| lab/exp#7 | created | `prun_seven` | [comment](" in table and "prun_eight" in table
    assert TOKEN not in text and TOKEN not in table

    # the same day again from the flow: edited, not posted twice; without a token: queued, not failed
    monkeypatch.delenv("GITHUB_TOKEN")
    with open_store() as store:
        record_run(store, "prun_seven_b", "lab/exp#7", started=now - H, ended=now, state="COMPLETED")
    offline = github_digest(return_state=True)
    assert offline.is_completed(), offline.message
    assert {d["issue"]: d["outcome"] for d in offline.result()["digests"]} == {
        "lab/exp#7": "queued",
        "lab/exp#8": "unchanged",
    }
    assert "lab/exp#7: digest" in _logs(offline.state_details.flow_run_id, "queued")
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    again = github_digest(return_state=True)
    assert {d["issue"]: d["outcome"] for d in again.result()["digests"]} == {
        "lab/exp#7": "edited",
        "lab/exp#8": "unchanged",
    }
    assert (
        len(fake_github.comments_on("lab/exp", 7)) == 1 and "prun_seven_b" in fake_github.comments[seven["id"]]["body"]
    )

    # a digest GitHub refuses for good (no right to comment): the run fails in one line, not a traceback
    with open_store() as store:
        record_run(store, "prun_eight_b", "lab/exp#8", started=now - H, ended=now, state="COMPLETED")
    for method in ("POST", "PATCH"):
        fake_github.fail(method, r"/issues/(8/comments|comments/\d+)", 403, {"message": "Must have admin rights"})
    refused = github_digest(return_state=True)
    assert refused.is_failed() and (refused.message or "").startswith("1 digest(s) not posted: lab/exp#8"), refused
    text = _logs(refused.state_details.flow_run_id, "not posted")
    assert "not posted" in text and "Traceback" not in text, text
