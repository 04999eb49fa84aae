"""Entry point of the ``openlab`` command.

Every command group lives in its own module and is mounted here. User errors
(:class:`~orchestrator.errors.OpenlabError`) become one line on stderr and exit code 2
(1 for integrity failures); no traceback reaches the user for a problem they can fix.
"""

from __future__ import annotations

import signal
import sys
import warnings
from types import FrameType

import typer

# typer carries its own copy of click (pyproject asks for a typer that does): its commands and
# the exceptions they raise are that copy's, not the click package's
from typer._click import Command
from typer._click import exceptions as click_errors

from orchestrator.cli import adopt, backends, core, deploy, gc, github, job, lineage, nightly, run, server, sweep, wandb
from orchestrator.errors import OpenlabError, ProvenanceWarning, Terminated

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
app.command("rerun")(run.rerun)
app.command("explain")(run.explain)
app.command("sweep")(sweep.sweep)
app.command("adopt")(adopt.adopt_cmd)
app.command("gc")(gc.gc_cmd)
app.add_typer(lineage.app, name="lineage")
app.add_typer(job.app, name="job")
app.add_typer(backends.app, name="backends")
app.add_typer(github.app, name="github")
app.add_typer(nightly.app, name="nightly")
app.add_typer(wandb.app, name="wandb")
# one command each, not a group: a group's help said "COMMAND [ARGS]..." of commands it has none of
app.command("server")(server.server)
app.command("deploy")(deploy.deploy)


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


def _reflow_all(command: Command) -> Command:
    """Every command's help reflowed, and its own and its options' help taken as plain text: rich
    reads ``[backends]`` as a style tag and drops it, so "default: [backends] default" lost the
    config section it names. No help here is meant as markup."""
    from rich.markup import escape

    command.help = reflow(escape(command.help)) if command.help else command.help
    for param in command.params:
        if getattr(param, "help", None):
            param.help = escape(param.help)  # type: ignore[attr-defined]
    for sub in getattr(command, "commands", {}).values():
        _reflow_all(sub)
    return command


def usage_line(exc: click_errors.UsageError) -> str:
    """A misspelt option, a missing argument or an unknown command as one line that names the
    command and where its help is: ``openlab run: No such option: --dry-run; see openlab run
    --help``. Typer printed these as a usage line, a hint line and a box of four more, unlike
    every other error of openlab's, and a script's log kept only the box."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    if exc.ctx is None:
        return message
    path = exc.ctx.command_path
    return f"{path}: {message}; see {path} --help"


#: Set once SIGTERM arrived: typer turns the interrupt it raises into exit code 130, as for Ctrl-C.
_TERMINATED: list[int] = []


def _terminate(signum: int, _frame: FrameType | None) -> None:
    _TERMINATED.append(signum)
    raise Terminated


def main(argv: list[str] | None = None) -> None:
    """Run the CLI, turning user errors into one clear line and a non-zero exit."""
    from orchestrator.cli.output import print_error

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # not where the caller chose (SIG_IGN, its own)
        signal.signal(signal.SIGTERM, _terminate)  # a stop, as Ctrl-C: see Terminated

    # A provenance warning is logged too, and the terminal shows that line; Python's own warning
    # format said it again above it, with a source file and line that mean nothing to a user.
    warnings.filterwarnings("ignore", category=ProvenanceWarning)
    try:
        code = _reflow_all(typer.main.get_command(app))(args=argv, prog_name="openlab", standalone_mode=False)
    except OpenlabError as exc:
        print_error(exc)
        sys.exit(exc.exit_code)
    except click_errors.NoArgsIsHelpError as exc:  # `openlab lineage`: its help was printed as it was raised
        sys.exit(exc.exit_code)
    except click_errors.UsageError as exc:
        print_error(usage_line(exc))
        sys.exit(exc.exit_code)
    except click_errors.ClickException as exc:  # a bad file argument and the like: click's own one line
        print_error(" ".join(exc.format_message().split()))
        sys.exit(exc.exit_code)
    except typer.Abort:  # a prompt answered with end-of-input
        print_error("aborted")
        sys.exit(1)
    except KeyboardInterrupt as exc:  # outside a command (typer turns one inside into exit code 130)
        sys.stderr.write("terminated\n" if isinstance(exc, Terminated) else "interrupted\n")
        sys.exit(128 + signal.SIGTERM if isinstance(exc, Terminated) else 130)
    except SystemExit as exc:
        # The reader of the output went away (`openlab lineage verify | head -1`): rich and typer
        # both turn that into exit status 1, which for verify means "problems found". Exit as a
        # command the shell's SIGPIPE stopped does (141, what `set -o pipefail` reports for cat),
        # saying nothing: the closed pipe is the reader's choice, not an error to explain.
        if isinstance(exc.__context__, BrokenPipeError):
            sys.exit(128 + signal.SIGPIPE)
        raise
    except OSError as exc:  # the file system refused (a home that cannot be made, a full disk): said, not traced
        if exc.filename:
            print_error(f"{exc.filename}: {exc.strerror or exc}; check OPENLAB_HOME and the paths given")
        else:  # a connection refused and the like: its own words, without a hint about paths
            print_error(" ".join(str(exc).split()) or type(exc).__name__)
        sys.exit(1)
    if _TERMINATED and code == 130:  # the interrupt was SIGTERM's: said, and exited as a shell says it
        sys.stderr.write("terminated\n")
        sys.exit(128 + signal.SIGTERM)
    # without standalone mode click returns what stopped a command early (typer.Exit(code)) as
    # its code, and a command that ran to its end returns None
    sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)


if __name__ == "__main__":
    main()
