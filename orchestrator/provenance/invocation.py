"""Who started a run, and with what command: the agent and the plan a lineage record names.

Marin's provenance record has the user and the command line beside the commit, and PROV's
``wasAssociatedWith`` wants an agent: "which commit produced this" is half an answer when
nobody can say who ran it. The user is the login account of the process that records the run
or submits the job: the person at the terminal for ``openlab run``, the account serving the
Prefect flows for a run started from the UI or a schedule (Prefect's open-source server has no
user identity of its own). It is also the account a Slurm job is submitted as, so it is what
squeue's USER column shows.

The command is what the person typed (``openlab run marin-535b-a23b tiny -b slurm``), with
any value that looks like a secret masked: an option whose name says token/key/password
(``--wandb-key X``, ``--token=X``) or a ``NAME=value`` pair with a secret-looking name
(:func:`orchestrator.secrets.redact_argv`, the rule a job's recorded command follows too).
"""

from __future__ import annotations

import getpass
import os
import socket
import sys
from collections.abc import Sequence

from orchestrator.secrets import redact_argv


def current_user() -> str | None:
    """The login name this process runs as, or None where there is none (a container's uid
    with no passwd entry and no ``USER`` set): a missing name beats a made-up one."""
    try:
        return getpass.getuser() or None
    except (KeyError, OSError):
        return None


def user_at_host() -> str:
    """``user@host`` of this process: who deleted (gc) or adopted something, in the record that
    says so. A uid with no name is given as the number, so the record still tells accounts apart."""
    return f"{current_user() or os.getuid()}@{socket.gethostname()}"


def command_line(args: Sequence[str] | None = None) -> list[str]:
    """The ``openlab`` command that does it again: ``args`` (default: this process's, after the
    program) with secrets masked. The program is ``openlab`` however it was reached (the console
    script, ``python -m orchestrator.cli.main``), so the record reads as a person would type it."""
    return ["openlab", *redact_argv(sys.argv[1:] if args is None else args)]


__all__ = ["command_line", "current_user", "redact_argv", "user_at_host"]
