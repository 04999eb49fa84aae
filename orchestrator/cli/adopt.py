"""``openlab adopt``: record a corpus or checkpoint made outside openlab as a stage's output.

See :mod:`orchestrator.pipeline.adopt` for what the claim means and what is refused. This
command checks everything it can before recording anything (the source, the dry run: the
stages before the adopted one must be completed here, the adopted one must not be), then
records one pipeline run with trigger ``adopt`` that reuses those stages and adopts the folder.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from orchestrator.cli.output import byte_progress, console, given_path, print_json
from orchestrator.cli.run import JsonFlag, RecipeArg, ReplicaOpt, SetOpt


def adopt_cmd(
    recipe: RecipeArg,
    source: Annotated[
        Path,
        typer.Argument(parser=given_path, help="The folder to adopt (a built corpus, token shards, a checkpoint)."),
    ],
    stage: Annotated[str, typer.Option("--stage", "-s", help="The stage whose output it is (e.g. tokenize).")],
    replica: ReplicaOpt = None,
    move: Annotated[
        bool, typer.Option("--move", help="Move the folder instead of copying it (one filesystem; instant).")
    ] = False,
    backend: Annotated[
        str | None, typer.Option("--backend", "-b", help="The backend later runs use (containers: the image).")
    ] = None,
    set_values: SetOpt = None,
    json_out: JsonFlag = False,
) -> None:
    """Adopt SOURCE as the output of --stage of RECIPE's replica: later runs reuse it instead of running it.

    `openlab adopt marin-535b-a23b --replica small --stage tokenize /data/tokenized` records the
    folder as what tokenize would produce here (the stages before it must be completed here, run or
    adopted), copies it into openlab's outputs, and says it was adopted, from where and by whom.
    """
    from orchestrator.pipeline import explain_recipe
    from orchestrator.pipeline.adopt import AdoptError, adopt_stage, check_source, plan_adoption
    from orchestrator.pipeline.execute import RunOptions, execute_stage, finish_pipeline, start_recipe, would_reuse
    from orchestrator.provenance.invocation import command_line, user_at_host
    from orchestrator.recipes import parse_sets, resolve
    from orchestrator.settings import load_settings

    settings = load_settings()
    path = check_source(source, settings.artifacts_dir)
    resolved = resolve(recipe, replica, sets=parse_sets(set_values or [])).until(stage, "--stage")
    asked_backend = backend
    backend = backend or settings.default_backend
    plan_adoption(explain_recipe(resolved, backend=backend, settings=settings), stage)
    params = {"adopt": {"stage": stage, "source": str(path), "by": user_at_host(), "move": move}}
    ctx = start_recipe(
        resolved,
        options=RunOptions(backend=backend, trigger="adopt", command=command_line(), params=params),
        settings=settings,
    )
    try:
        for name in ctx.pipeline.order[:-1]:
            if not would_reuse(ctx, name):  # completed a moment ago in the dry run; gone since
                raise AdoptError(f"stage {name} no longer has completed outputs here: run it first, then adopt")
            execute_stage(ctx, name)
        if json_out or not console.is_terminal:
            result = adopt_stage(ctx, stage, path, move=move)
        else:
            with byte_progress() as bar:
                task = bar.add_task(f"copying {source}", total=None)
                result = adopt_stage(
                    ctx,
                    stage,
                    path,
                    move=move,
                    progress=lambda done, total: bar.update(task, completed=done, total=total),
                )
    except BaseException as exc:
        finish_pipeline(ctx, "FAILED", f"{type(exc).__name__}: {exc}")
        raise
    run = finish_pipeline(ctx)
    out = result.outputs["out"]
    # the run that reuses it is asked as the adoption was: the values set and the backend decide the identity
    from orchestrator.recipes import set_words
    from orchestrator.secrets import scrub

    again = ["openlab", "run", recipe, *(["--replica", replica] if replica else [])]
    again += ["--backend", asked_backend] if asked_backend else []
    again += [word for value in set_words(resolved.run_set) for word in ("--set", value)]
    next_command = scrub(shlex.join(again))
    if json_out:
        print_json(
            {
                "pipeline_run_id": run.id,
                "stage_run_id": result.stage_run_id,
                "stage": stage,
                "identity": result.identity,
                "path": out["path"],
                "content_hash": out["content_hash"],
                "files": out["files"],
                "bytes": out["bytes"],
                "adopted_from": out["adopted_from"],
                "adopted_by": out["adopted_by"],
                "next": next_command,
            }
        )
        return
    console.print(f"[bold]adopted[/] {source} as stage {stage} of {resolved.name}", highlight=False)
    console.print(f"  identity   {result.identity[:16]}", markup=False)
    console.print(f"  stored at  {out['path']} ({out['files']} files, {out['bytes']} bytes)", markup=False)
    console.print(f"  recorded   stage run {result.stage_run_id} in pipeline run {run.id}", markup=False)
    console.print(f"  next       `{next_command}` reuses it", markup=False, highlight=False)
