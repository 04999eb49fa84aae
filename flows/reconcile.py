"""The reaper as a deployment: close what dead orchestrators left RUNNING, on a schedule or from the UI.

A flow process killed outright (SIGKILL, OOM, a lost node) cannot cancel its Slurm job,
container or Kubernetes Job, and nothing records its runs' end. Every pipeline start
reconciles (:func:`orchestrator.pipeline.reconcile.reconcile_all`), but a lab that starts
nothing for a day would keep paying for an orphaned job until then; this flow runs the
same pass on its own schedule (``[prefect] reconcile_every_s``, 10 min by default) and
can be triggered from the UI, with ``dry_run`` to see first. It only touches runs whose
lease has expired, so the runs of live orchestrators are never cut short.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger


def reconcile_run_name() -> str:
    """``reconcile`` (``reconcile (dry run)``): the run list says what ran every 10 minutes, not
    two random words (``rainbow-malkoha``) a person has to open to tell from a pipeline's."""
    from prefect.runtime import flow_run

    return "reconcile" + (" (dry run)" if (flow_run.parameters or {}).get("dry_run") else "")


@flow(
    name="lineage-reconcile",
    description="Close runs whose orchestrator died (lease expired) and cancel their orphaned backend jobs.",
    flow_run_name=reconcile_run_name,
)
def reconcile_lineage(dry_run: bool = False) -> dict[str, Any]:
    """Close stale stage and pipeline runs and cancel their jobs; report each in the log and an artifact.

    Args:
        dry_run: Only ask the backends and say what would be closed; change nothing.
    """
    from prefect.artifacts import create_markdown_artifact

    from orchestrator.lineage.store import LineageStore
    from orchestrator.pipeline.reconcile import reconcile_all

    logger = get_run_logger()
    with LineageStore.open() as store:
        report = reconcile_all(store, dry_run=dry_run)
    if not report:
        logger.info("nothing to reconcile: every RUNNING run has a live orchestrator")
        return report.to_dict()
    for line in report.lines():
        logger.warning(line)
    create_markdown_artifact(key="lineage-reconcile", markdown=report.markdown(), description=report.headline)
    return report.to_dict()


__all__ = ["reconcile_lineage", "reconcile_run_name"]
