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
(``--wandb-key X``, ``--token=X``) or a ``NAME=value`` pair with a secret-looking name.
"""

from __future__ import annotations

import getpass
import os
import socket
import sys
from collections.abc import Sequence

from orchestrator.secrets import MASK, is_secret_option, scrub


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


def redact_argv(args: Sequence[str]) -> list[str]:
    """``args`` with the values of secret options and ``NAME=value`` secrets masked, and any
    secret value of this process's environment scrubbed wherever it appears.

    ``--token X`` and ``--token=X`` hide X; ``-e WANDB_API_KEY=X`` and ``--env=GITHUB_TOKEN=X``
    hide X (the first secret-looking name in a chain of ``=`` hides all after it).
    """
    out: list[str] = []
    mask_next = False
    for arg in args:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        parts = arg.split("=")
        secret_at = next((i for i, part in enumerate(parts[:-1]) if is_secret_option(part)), None)
        if secret_at is not None:
            out.append("=".join([*parts[: secret_at + 1], MASK]))
        elif arg.startswith("--") and len(parts) == 1 and is_secret_option(arg):
            out.append(arg)
            mask_next = True  # its value is the next word
        else:
            out.append(scrub(arg))
    return out
