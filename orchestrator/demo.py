"""``make demo``: the scaled-down replica pipeline end to end on the embedded defaults.

Starts (or reuses) a local Prefect server, registers the openlab deployments so they
appear in the UI (the scheduled ones paused where no runner serves them, as on the server
the demo starts: tagged ``paused-by-demo``, the next ``openlab server`` resumes them; on a
server an ``openlab server`` is serving they are left as they are), runs the ``tiny``
replica of the Marin recipe as a Prefect flow on the local backend with the SQLite
lineage store, then prints where to look. The Prefect server is left running so the UI
can be opened afterwards; the demo prints how to stop it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from orchestrator.errors import OpenlabError

if TYPE_CHECKING:
    from flows.deployments import Registration
    from orchestrator.settings import Settings

console = Console()

RECIPE = os.environ.get("OPENLAB_DEMO_RECIPE", "marin-535b-a23b")
REPLICA = os.environ.get("OPENLAB_DEMO_REPLICA", "tiny")


def _server(home: Path):  # type: ignore[no-untyped-def]
    """A healthy local Prefect server: the one already up on the configured port, or a new one."""
    from orchestrator.prefect_server import PrefectServer, free_port, health_ok, port_in_use

    server = PrefectServer.from_settings()
    if health_ok(server.api_url):
        console.print(f"[green]✓[/] reusing the Prefect server at {server.ui_url}")
        return server, False
    if port_in_use(server.host, server.port):
        server.port = free_port(server.host)
    with console.status(f"starting a local Prefect server on {server.ui_url} (telemetry off)…"):
        server.start()
    (home / "prefect").mkdir(parents=True, exist_ok=True)
    (home / "prefect" / "server.pid").write_text(f"{server.process.pid}\n")  # type: ignore[union-attr]
    console.print(f"[green]✓[/] Prefect server at {server.ui_url} (log: {server.log_path})")
    return server, True


def register_deployments(settings: Settings) -> Registration:
    """Register the deployments so they show in the UI (the API of :func:`use_api`). The demo serves
    nothing, so a scheduled deployment no runner polls is registered paused, tagged ``paused-by-demo``
    (the next ``openlab server`` or ``openlab deploy`` resumes it); on a server that an ``openlab
    server`` serves they are left as they are, and so is anything a person paused."""
    from flows.deployments import apply_deployments, build_deployments, in_repo_root

    with in_repo_root():
        return apply_deployments(build_deployments(settings), pause_unserved=True)


def main() -> int:
    from orchestrator.lineage.store import open_store
    from orchestrator.lineage.verify import anchor_of
    from orchestrator.prefect_server import use_api
    from orchestrator.settings import load_settings

    settings = load_settings()
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    console.rule(f"openlab demo: {RECIPE} / {REPLICA} replica, local backend")
    store = open_store(settings)
    console.print(f"[green]✓[/] lineage store {store.url}")
    server, started = _server(settings.home)
    with use_api(server.api_url):
        from flows.pipeline import replica_pipeline

        done = register_deployments(settings)
        console.print(f"[green]✓[/] deployments registered: {', '.join(sorted(done.ids))}")
        for line in done.kept.lines("openlab deploy"):
            console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
        console.print(f"running the {REPLICA} replica (six stages; a few minutes on 2 CPU cores)…")
        state = replica_pipeline(recipe=RECIPE, replica=REPLICA, backend="local", return_state=True)
    result = state.result(raise_on_failure=False) if state.is_completed() else None
    pipeline_run_id = (result or {}).get("pipeline_run_id") if isinstance(result, dict) else None
    console.rule("where to look")

    def where(label: str, text: str) -> None:  # one line each, never wrapped: the commands are copied whole
        console.print(f"{label:<22}{text}", soft_wrap=True, highlight=False)

    where("Prefect UI", f"{server.ui_url}  (flow runs, stage logs, progress bars, lineage cards)")
    if pipeline_run_id:
        where("this run's lineage", f"openlab lineage show {pipeline_run_id}")
        where("everything it made", f"openlab lineage trace {pipeline_run_id} --down  (an output id: up)")
    stages = (result or {}).get("stages") if isinstance(result, dict) else None
    checkpoint = _checkpoint_of(stages)
    if checkpoint is not None:
        where("what made this file", f"openlab lineage trace {checkpoint}")
        where("draw it", f"openlab lineage trace {checkpoint} --dot | dot -Tsvg > lineage.svg  (Graphviz)")
    where("all runs", "openlab lineage list")
    where("jobs out now", "openlab job list  (a stage's log: openlab job logs SRUN_ID)")
    where("prove nothing changed", "openlab lineage verify")
    anchor = anchor_of(store, pipeline_run_id) if pipeline_run_id else None
    if anchor is not None:  # what its card publishes; with an experiment issue, on GitHub too
        where("not rewritten since", f"openlab lineage verify --anchor {anchor}")
    where("what would re-run", "openlab explain marin-535b-a23b --replica tiny")
    where("try a value", "openlab explain marin-535b-a23b --replica tiny --set pretrain.lr=0.02  (then: run)")
    where(
        "sweep values",
        "openlab sweep marin-535b-a23b --replica tiny --until pretrain --grid pretrain.lr=0.005,0.01,0.02"
        f"  (or {server.ui_url}/deployments: replica-sweep/sweep)",
    )
    if pipeline_run_id:
        where("run it again", f"openlab rerun {pipeline_run_id} --force-stage eval  (recorded as its retry)")
        where("export (Marquez/PROV)", f"openlab lineage export {pipeline_run_id} --format openlineage")
    where("lineage store", str(store.url))
    if shutil.which("openlab") is None:
        console.print("`openlab` is .venv/bin/openlab: `source .venv/bin/activate` puts it on PATH", highlight=False)
    if started:
        pid = server.process.pid  # type: ignore[union-attr]
        where("stop the server", f"kill {pid}  (trigger runs from the UI: openlab server)")
    if not state.is_completed():
        console.print(f"[bold red]the pipeline ended {state.type.value}: {state.message}[/]")
        return 1
    return 0


def _checkpoint_of(stages: object) -> Path | None:
    """The post-trained checkpoint the demo made, if it is there: a file to ask "what made this?" of."""
    if not isinstance(stages, dict):
        return None
    out = (stages.get("posttrain") or {}).get("out_dir")
    found = sorted(Path(out).glob("checkpoint/*.pt")) if out else []
    return found[0] if found else None


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OpenlabError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        sys.exit(exc.exit_code)
