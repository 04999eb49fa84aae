"""``openlab backends check``: is each configured backend reachable, and if not, why.

Run before a long pipeline: it asks each backend the cheapest question that proves it
can take jobs (docker: engine info and the job image; slurm: ``scontrol ping`` and
partitions; kubernetes: list Jobs in the namespace, then whether it grants what the
launcher needs, asked as ``kubectl auth can-i`` does; local: the state folder is writable). A
backend whose settings name an option it does not have is unreachable, naming the one meant; a
``[backends]`` key that names no backend (``default = "slurmm"``, ``[backends.kubernets]``) is
an error before any backend is asked.
Backends are those under ``[backends]`` in the config, else all four.
"""

from __future__ import annotations

import typer

app = typer.Typer(help="Check the job backends (local, docker, slurm, kubernetes).", no_args_is_help=True)


@app.command("check")
def check_cmd(
    backend: list[str] = typer.Argument(None, help="backends to check (default: the configured ones)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 when any backend is unreachable"),
) -> None:
    """Say for each backend whether it is reachable and, if not, why."""
    from orchestrator.cli.output import console, print_json
    from orchestrator.errors import OpenlabError
    from orchestrator.launchers import configured_backends, get_launcher
    from orchestrator.settings import load_settings

    settings = load_settings()  # a misspelt [backends] key is the answer there, not one row per backend
    default = settings.default_backend.strip().lower()  # where a job without --backend goes
    names = backend or configured_backends(settings)
    results = []
    for name in names:
        cluster = None
        try:
            launcher = get_launcher(name, settings)
            ok, detail = launcher.check()
            cluster = launcher.cluster if ok else None  # the name its attempts will record
        except OpenlabError as exc:
            if name not in configured_backends(settings) and "unknown backend" in str(exc):
                raise
            ok, detail = False, str(exc)
        except Exception as exc:  # noqa: BLE001 - one broken backend must not hide the others
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results.append(
            {"backend": name, "default": name == default, "reachable": ok, "cluster": cluster, "detail": detail}
        )
    if as_json:
        print_json(results)
    else:
        from rich.markup import escape
        from rich.table import Table

        table = Table("backend", "reachable", "cluster", "detail")
        for row in results:
            name = f"{row['backend']} (default)" if row["default"] else row["backend"]
            reachable = "[green]yes[/]" if row["reachable"] else "[red]no[/]"
            table.add_row(name, reachable, escape(row["cluster"] or ""), escape(row["detail"]))
        console.print(table)
    if strict and not all(r["reachable"] for r in results):
        raise typer.Exit(1)
