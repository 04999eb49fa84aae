"""User-facing errors.

An :class:`OpenlabError` is a problem the user can fix (bad input, a service that is
down, an unknown id). The CLI prints its message as one line and exits with
:attr:`OpenlabError.exit_code`, without a traceback; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class OpenlabError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""

    exit_code: int = 2


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken as Ctrl-C is: ``kill``, ``timeout``, systemd, a CI runner and the end of an enclosing
    Slurm job all stop a command with it. By default it killed ``openlab job run`` or ``openlab run`` on
    the spot, and the job it had submitted ran on, its attempt PENDING or RUNNING for good; as an
    interrupt the job is cancelled and recorded CANCELLED on the way out (:mod:`orchestrator.cli.main`)."""


class ProvenanceWarning(UserWarning):
    """Provenance could only be captured partially (the folder is not a git repo, an untracked file
    too large for the patch). Here, with the errors, so the CLI can show it as one line without
    importing git to name it."""


class ConfigError(OpenlabError):
    """A configuration file, recipe or flag is invalid."""


class StoreError(OpenlabError):
    """The lineage database cannot be opened, migrated or written."""


class NotFoundError(OpenlabError):
    """An id names no record."""


class IntegrityError(OpenlabError):
    """Recorded lineage does not match what it claims (used by ``verify``)."""

    exit_code = 1


def choices(name: object, known: Iterable[str], *, label: str = "known") -> str:
    """The end of a message that refuses an unknown name: ``did you mean 'slurm'? known: local,
    docker, slurm, kubernetes``, or only the known names when none is close. One wording for
    every backend, stage, replica, state, key and format openlab refuses, so a typo always
    comes back with the name meant (compared without case: ``Slurm``, ``completd``)."""
    names = [str(k) for k in known]
    if not names:  # "columns: " read as if the list had been cut off
        return f"{label}: none"
    by_lower = {n.lower(): n for n in names}
    typed = str(name).strip().lower()
    close = difflib.get_close_matches(typed, list(by_lower), n=1)
    if not close and typed:  # the start of one name: `marin` for marin-535b-a23b
        close = [n for n in by_lower if n.startswith(typed)]
        close = close if len(close) == 1 else []
    listed = f"{label}: {', '.join(names)}"
    return f"did you mean {by_lower[close[0]]!r}? {listed}" if close else listed
