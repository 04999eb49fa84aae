"""The nightly replica: run main's replica, then judge its tracked metrics against the last good nightly.

The comparison itself is :mod:`orchestrator.nightly` (pure library); this flow runs the
pipeline exactly as the UI does (:func:`flows.pipeline.run_replica`, ``git_ref="main"``
by default so the nightly tests what is merged, not what is checked out), then records
the verdict in lineage and fails the flow run — with a message naming the metric, both
values and both commits — when a tracked metric moved beyond the recipe's tolerance.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from flows import events
from flows.cancel import on_cancellation_hook, on_crashed_hook
from flows.pipeline import TASK_RUN_LOGGER, Backend, failed_run, replica_run_name, run_replica, run_tags, shown


@task(name="nightly-verdict", cache_policy=NO_CACHE)
def nightly_verdict(pipeline_run_id: str, recipe: str, replica: str) -> dict[str, Any]:
    """Compare with the previous successful nightly, record the verdict, raise on a regression."""
    from prefect.artifacts import create_markdown_artifact

    from orchestrator.lineage.store import LineageStore
    from orchestrator.nightly import NightlyRegression, evaluate_nightly, parse_tolerances, raise_for_verdict
    from orchestrator.recipes import resolve

    logger = get_run_logger()
    tolerances = parse_tolerances(resolve(recipe, replica).tracked_metrics)
    with LineageStore.open() as store:
        verdict = evaluate_nightly(store, pipeline_run_id, tolerances)
        changes = _changes_since(store, verdict.previous_run_id, pipeline_run_id)
    lines = [
        f"**Nightly verdict: {verdict.status}**",
        "",
        verdict.message,
        "",
        "| metric | previous | now | allowed | s.e. of the difference |",
        "|---|---|---|---|---|",
    ]
    for check in verdict.checks:
        flag = " ❌" if check.regressed else ""
        noise = "" if check.noise is None else f"{check.noise:.4g}"
        lines.append(f"| {check.metric}{flag} | {check.previous} | {check.current} | {check.allowed} | {noise} |")
    lines += ["", *changes]
    try:
        create_markdown_artifact(key="nightly-verdict", markdown="\n".join(lines), description=verdict.message[:500])
    except Exception as exc:  # noqa: BLE001 - the verdict is in lineage either way
        logger.warning("could not publish the verdict artifact: %s", exc)
    (logger.error if not verdict.passed else logger.info)(verdict.message)
    _announce(verdict)
    try:
        raise_for_verdict(verdict)
    except NightlyRegression as exc:  # said above, at ERROR: the flow fails with it, without a traceback
        shown(exc, TASK_RUN_LOGGER)
        raise
    return verdict.to_dict()


def _changes_since(store: Any, previous_run_id: str | None, pipeline_run_id: str) -> list[str]:
    """The verdict artifact's account of what went in differently since the run it was judged against."""
    from orchestrator.cards import render_changes
    from orchestrator.lineage.diff import diff_records

    if not previous_run_id:
        return []
    try:
        sections = diff_records(store, store.find(previous_run_id), store.find(pipeline_run_id))
    except Exception as exc:  # noqa: BLE001 - the verdict stands without it
        get_run_logger().warning("could not compare with %s: %s", previous_run_id, exc)
        return []
    return render_changes(sections, previous_run_id, pipeline_run_id)


def _report_on_github(pipeline_run_id: str) -> str | None:
    """Open, update or close the recipe's regression issue ([github] repo) and mark the tested
    commit with the verdict; the issue's URL, if any.

    Never fails the verdict: the verdict is recorded already, the issue is a courtesy."""
    from orchestrator.lineage.store import LineageStore
    from orchestrator.links.regressions import report_verdict
    from orchestrator.links.statuses import report_status

    logger = get_run_logger()
    try:
        with LineageStore.open() as store:
            report = report_verdict(store, pipeline_run_id)
            status = report_status(store, pipeline_run_id)
    except Exception as exc:  # noqa: BLE001 - the verdict is recorded; GitHub is a courtesy
        logger.warning("could not report the verdict on GitHub: %s", exc)
        return None
    for done in (report, status):
        if done.action != "off":
            (logger.warning if done.action in ("queued", "failed") else logger.info)(done.line())
    return report.url


def _nightly_run_name() -> str:
    return replica_run_name("nightly ")


@flow(
    name="nightly-replica",
    description="Nightly replica of main with a regression verdict against the previous successful nightly.",
    flow_run_name=_nightly_run_name,
    on_cancellation=[on_cancellation_hook],
    on_crashed=[on_crashed_hook],
)
def nightly_replica(
    recipe: str = "marin-535b-a23b",
    replica: str = "small",
    backend: Backend | None = None,
    git_ref: str = "main",
    issue: str | None = None,
) -> dict[str, Any] | State[Any]:
    """Run ``recipe``'s ``replica`` at ``git_ref`` and fail when a tracked metric regressed.

    Args:
        recipe: Recipe name (a file in recipes/) or path.
        replica: Scaled-down replica to run (small is sized for a nightly).
        backend: Where the stage jobs run; empty: `[backends] default` of openlab.toml (local when unset).
        git_ref: Commit to test; main by default: a branch that tracks a remote one is fetched first and its
            remote head tested (origin/main), not this server's checkout as it was last pulled.
        issue: Experiment issue owner/repo#N to post the lineage card to.
    """
    from flows.gitref import latest_ref
    from orchestrator.errors import OpenlabError
    from orchestrator.lineage.models import PipelineRun
    from orchestrator.lineage.store import LineageStore
    from orchestrator.nightly import NightlyRegression
    from orchestrator.pipeline.dag import REPO_ROOT
    from orchestrator.pipeline.execute import StageCancelled, StageFailed

    try:
        # main as the remote has it now, not as this server's checkout last pulled it
        tested = latest_ref(REPO_ROOT, git_ref, get_run_logger())
        summary = run_replica(
            recipe=recipe,
            replica=replica,
            backend=backend,
            issue=issue,
            git_ref=tested,
            force=False,
            dry_run=False,
            trigger=None,
        )
        # the verdict's task run is found by the same tags as the stages' (the recipe's name, not its file)
        with LineageStore.open() as store:
            ran = store.require(PipelineRun, summary["pipeline_run_id"])
        tags = run_tags(ran.recipe, ran.replica)
        # judged by the tolerances of the recipe that ran: at git_ref, not the server's own copy
        verdict = nightly_verdict.with_options(tags=tags)(summary["pipeline_run_id"], summary["recipe_path"], replica)
    except NightlyRegression as exc:  # the verdict task logged it at ERROR: the flow run fails with that line
        return failed_run(exc, logged=True)
    except StageCancelled as exc:  # stopped on purpose: no verdict
        return failed_run(exc)
    except StageFailed as exc:  # the pipeline ran and failed: a verdict all the same, so it pages someone
        _verdict_of_failure(exc)
        return failed_run(exc)
    except OpenlabError as exc:  # a mistyped replica, a recipe that does not resolve: one line, no traceback
        return failed_run(exc)
    return {**summary, "verdict": verdict}


def _verdict_of_failure(exc: Any) -> None:
    """Record the regressed verdict of a nightly whose stage failed (:func:`orchestrator.nightly.failed_nightly`),
    then report it as any verdict: the event an Automation pages on, the regression issue, the commit status."""
    from orchestrator.lineage.models import StageRun
    from orchestrator.lineage.store import LineageStore
    from orchestrator.nightly import failed_nightly

    logger = get_run_logger()
    stage_run_id = getattr(getattr(exc, "result", None), "stage_run_id", None)
    try:
        with LineageStore.open() as store:
            stage_run = store.get(StageRun, stage_run_id) if stage_run_id else None
            if stage_run is None or not stage_run.pipeline_run_id:
                return
            verdict = failed_nightly(store, stage_run.pipeline_run_id, str(exc))
    except Exception as failure:  # noqa: BLE001 - the run's failure is recorded already; this only reports it
        logger.warning("could not record the failed nightly's verdict: %s", failure)
        return
    _announce(verdict)


def _announce(verdict: Any) -> None:
    """A recorded verdict, said everywhere a person or an Automation looks: the run's card again (now
    with the verdict), the regression issue and the commit's status, then the ``openlab.nightly.*``
    event, which carries the issue's URL so an Automation's message can link it."""
    _republish_card(verdict.pipeline_run_id)
    issue_url = _report_on_github(verdict.pipeline_run_id)
    payload = verdict.to_dict()
    if issue_url:
        payload["regression_issue"] = issue_url
    events.nightly_verdict(verdict.pipeline_run_id, payload)


def _republish_card(pipeline_run_id: str) -> None:
    """The run's lineage card again, now with its verdict: the ``lineage-pipeline`` artifact and the
    experiment issue's card were published when the pipeline ended, before the verdict was decided,
    and nothing published them again, so neither ever showed a nightly's verdict."""
    from prefect.artifacts import create_markdown_artifact

    from orchestrator.cards import pipeline_card
    from orchestrator.lineage.store import LineageStore
    from orchestrator.links.github import publish_card

    try:
        with LineageStore.open() as store:
            create_markdown_artifact(
                key="lineage-pipeline",
                markdown=pipeline_card(store, pipeline_run_id),
                description=f"openlab lineage of pipeline run {pipeline_run_id}, with its nightly verdict",
            )
            publish_card(store, pipeline_run_id)  # its issues' card; GitHub problems queued, never raised
    except Exception as exc:  # noqa: BLE001 - the verdict is recorded; the card is a courtesy
        get_run_logger().warning("could not publish the card with the verdict: %s", exc)


def accept_run_name() -> str:
    """``accept prun_… as baseline``: the run list says which nightly was accepted."""
    from prefect.runtime import flow_run

    return f"accept {(flow_run.parameters or {}).get('pipeline_run_id') or '?'} as baseline"


@flow(
    name="nightly-accept",
    description="Make a regressed nightly the baseline its kind is judged against, keeping why; close its issue.",
    flow_run_name=accept_run_name,
)
def nightly_accept(pipeline_run_id: str, reason: str) -> dict[str, Any] | State[Any]:
    """Accept the regressed nightly ``pipeline_run_id`` as the new normal (what ``openlab nightly accept``
    does): the next nightly of its recipe, replica, backend and git ref is judged against it; its verdict
    stays regressed, with who accepted it, when and why; its regression issue is closed as not planned.

    Args:
        pipeline_run_id: The regressed nightly's pipeline run (prun_…: its flow run's log and artifacts name it).
        reason: Why the new numbers are right (an issue, a change): kept on the verdict and posted on the issue.
    """
    from prefect.runtime import flow_run

    from orchestrator.errors import OpenlabError
    from orchestrator.lineage.store import LineageStore
    from orchestrator.links.regressions import accept_and_report
    from orchestrator.nightly import short_commit
    from orchestrator.provenance.invocation import user_at_host

    logger = get_run_logger()
    by = f"{user_at_host()} (Prefect flow run {flow_run.name or flow_run.id})"  # the UI names no person
    try:
        with LineageStore.open() as store:
            verdict, report = accept_and_report(store, pipeline_run_id, reason=reason, by=by)
    except OpenlabError as exc:  # a run that cannot be the baseline, an empty reason: one line, nothing recorded
        return failed_run(exc)
    logger.info(
        "%s at commit %s is the baseline of its nightly from now on (accepted: %s)",
        verdict.pipeline_run_id,
        short_commit(verdict.commit),
        (verdict.accepted or {}).get("reason"),
    )
    (logger.warning if report.action in ("queued", "failed") else logger.info)("%s", report.line())
    return {"verdict": verdict.to_dict(), "regression_issue": report.action, "issue": report.issue_id}


__all__ = ["nightly_accept", "nightly_replica", "nightly_verdict"]
