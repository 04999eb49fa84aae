"""Entry point of the ``openlab`` command.

Every command group lives in its own module and is mounted here. User errors
(:class:`~orchestrator.errors.OpenlabError`) become one line on stderr and exit code 2
(1 for integrity failures); no traceback reaches the user for a problem they can fix.
"""

from __future__ import annotations

import sys

import click
import typer

from orchestrator.cli import adopt, backends, core, deploy, gc, github, job, lineage, run, server, wandb
from orchestrator.errors import OpenlabError

app = typer.Typer(
    name="openlab",
    help="Experiment orchestration and provenance for training foundation models in the open.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("snapshot")(core.snapshot_cmd)
app.command("provenance")(core.provenance_cmd)
app.command("run")(run.run)
app.command("explain")(run.explain)
app.command("adopt")(adopt.adopt_cmd)
app.command("gc")(gc.gc_cmd)
app.add_typer(lineage.app, name="lineage")
app.add_typer(job.app, name="job")
app.add_typer(backends.app, name="backends")
app.add_typer(github.app, name="github")
app.add_typer(wandb.app, name="wandb")
app.add_typer(server.app, name="server")
app.add_typer(deploy.app, name="deploy")


def reflow(text: str | None) -> str | None:
    """A command's help with each paragraph on one line, for the terminal to wrap: the docstrings
    are wrapped at 120 columns in the source, and typer printed those breaks as they were, so
    every help in an 80-column terminal came out ragged. Lists and indented lines are kept."""
    if not text:
        return text
    paragraphs = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.splitlines()
        kept = any(line.startswith((" ", "\b")) or line.lstrip().startswith(("- ", "* ", "|")) for line in lines)
        paragraphs.append(paragraph if kept else " ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


def _reflow_all(command: click.Command) -> click.Command:
    command.help = reflow(command.help)
    for sub in getattr(command, "commands", {}).values():
        _reflow_all(sub)
    return command


def main(argv: list[str] | None = None) -> None:
    """Run the CLI, turning user errors into one clear line and a non-zero exit."""
    try:
        _reflow_all(typer.main.get_command(app))(args=argv, prog_name="openlab", standalone_mode=True)
    except OpenlabError as exc:
        from orchestrator.cli.output import print_error

        print_error(exc)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)


if __name__ == "__main__":
    main()
