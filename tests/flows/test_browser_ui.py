"""A person's path through the real Prefect UI: open the deployment, Custom run, Submit.

Playwright's sync API drives Debian's Chromium (``/usr/bin/chromium``; no ``playwright
install``). Every request that leaves 127.0.0.1 is aborted: the UI calls an outside
analytics host on load, and tests must neither leak nor depend on the network.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from orchestrator.lineage import LineageStore, PipelineRun, StageRun
from tests.flows.conftest import Served, require_service, sweep_runs_and_table, unavailable, wait_flow_run

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
RECIPE_PATH = "recipes/marin-535b-a23b.yaml"

pytestmark = [pytest.mark.prefect, pytest.mark.browser, pytest.mark.slow]


def _local_only(route: Any) -> None:
    url = route.request.url
    if url.startswith(("http://127.0.0.1", "http://localhost", "data:", "blob:")):
        route.continue_()
    else:
        route.abort()


def _again_while_busy(route: Any) -> None:
    """Send Submit's request again while the server answers 503, up to three times, as the person
    who saw the error toast would click again.

    Prefect answers 503 when its SQLite database was busy (SQLITE_BUSY_SNAPSHOT, which no busy
    timeout waits out: PrefectHQ/prefect#18934); its Python client retries such an answer, its UI
    does not. Seen once on this 2-core machine under a full test run: ``503 .../create_flow_run``.
    """
    response = route.fetch()
    for _ in range(3):
        if response.status != 503:
            break
        time.sleep(1)
        response = route.fetch()
    route.fulfill(response=response)


def _param_input(page: Any, name: str) -> Any:
    """The text box under the form label ``<name> (Optional)`` (the labels carry no ``for=``)."""
    return page.locator(f"xpath=//*[normalize-space(text())='{name} (Optional)']/following::textarea[1]")


@contextmanager
def _custom_run_form(served: Served, deployment_id: Any, tmp_path: Path, what: str) -> Iterator[Any]:
    """The deployment's *Run → Custom run* form in Chromium, as a person opens it. A failure inside
    the block leaves a screenshot and names the local requests that failed or were refused."""
    chromium = require_service("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("the playwright package is not installed")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=chromium, headless=True, args=CHROMIUM_ARGS
        )
        page = context.new_page()
        try:
            page.route("**/*", _local_only)
            page.route("**/create_flow_run", _again_while_busy)  # runs first: the last route added does
            refused: list[str] = []  # local requests that failed or were refused: the failure says which
            page.on("response", lambda r: refused.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.on(
                "requestfailed",
                lambda r: refused.append(f"{r.method} {r.url}: {r.failure}") if "127.0.0.1" in r.url else None,
            )
            page.goto(f"{served.server.ui_url}/deployments/deployment/{deployment_id}", wait_until="domcontentloaded")
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run").click()
            yield page
        except Exception as exc:
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            raise AssertionError(f"the UI did not schedule the {what}; requests that failed: {refused}") from exc
        finally:
            context.close()


def test_custom_run_from_the_ui_completes_with_its_parameters(served: Served, tmp_path: Path) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("replica-pipeline/replica")
    submitted_at = time.time()
    with _custom_run_form(served, deployment.id, tmp_path, "run") as page:
        _param_input(page, "recipe").fill(RECIPE_PATH)
        _param_input(page, "replica").fill("tiny")
        page.get_by_role("button", name="Submit").click()
        # One CI run (2 cores) did not see the toast within 30 s; the same test passed on a rerun.
        page.get_by_text("scheduled to start now").first.wait_for(timeout=60_000)

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=20,
        )
    mine = [r for r in runs if r.parameters.get("recipe") == RECIPE_PATH and r.created.timestamp() >= submitted_at - 5]
    assert mine, [r.parameters for r in runs]
    final = wait_flow_run(mine[0].id, 480)
    assert final.state.is_completed(), final.state.message
    assert final.parameters["recipe"] == RECIPE_PATH and final.parameters["replica"] == "tiny"
    with LineageStore(served.db_url) as store:
        (run,) = store.list(PipelineRun, flow_run_id=str(final.id))
        assert run.state == "COMPLETED" and run.trigger == "ui"
        assert run.params["prefect"]["recipe"] == RECIPE_PATH and run.replica == "tiny"
        assert len(store.list(StageRun, pipeline_run_id=run.id)) == 6


def test_a_sweep_submitted_from_the_ui_runs_its_grid_and_publishes_the_table(served: Served, tmp_path: Path) -> None:
    """*replica-sweep/sweep → Run → Custom run*, the parameters typed as JSON (the form's *Use JSON
    input*), Submit: the sweep runs one pipeline run per value and its `sweep` artifact has a row each."""
    import json

    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("replica-sweep/sweep")
    params = {
        "grid": {"data.max_bytes_per_domain": [140000, 110000]},
        "replica": "tiny",
        "until": "data",
        "metrics": ["data:data/code/train_bytes"],
    }
    submitted_at = time.time()
    with _custom_run_form(served, deployment.id, tmp_path, "sweep") as page:
        page.get_by_role("button", name="Submit").wait_for(timeout=30_000)
        # the grid is prefilled with an example; the whole parameter set is typed as JSON instead
        page.locator("xpath=//*[normalize-space(text())='Parameters']/following::button[1]").click()
        page.get_by_text("Use JSON input").click()
        page.locator("textarea.p-code-input__textarea").first.fill(json.dumps(params))
        page.get_by_role("button", name="Submit").click()
        page.get_by_text("scheduled to start now").first.wait_for(timeout=60_000)

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
    (mine,) = [
        r for r in runs if r.parameters.get("grid") == params["grid"] and r.created.timestamp() >= submitted_at - 5
    ]
    sweep = wait_flow_run(mine.id, 240)
    assert sweep.state.is_completed(), sweep.state.message
    assert sweep.name == "sweep marin-535b-a23b:tiny on local: data.max_bytes_per_domain x2"
    children, table = sweep_runs_and_table(sweep.id)
    assert sorted(c.parameters["overrides"]["data.max_bytes_per_domain"] for c in children) == [110000, 140000]
    rows = [line for line in table.splitlines() if line.startswith("| `prun_")]
    assert sorted(row.split("|")[3].strip() for row in rows) == ["110000", "140000"], table
