"""User-facing errors.

An :class:`OpenlabError` is a problem the user can fix (bad input, a service that is
down, an unknown id). The CLI prints its message as one line and exits with
:attr:`OpenlabError.exit_code`, without a traceback; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations


class OpenlabError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""

    exit_code: int = 2


class ConfigError(OpenlabError):
    """A configuration file, recipe or flag is invalid."""


class StoreError(OpenlabError):
    """The lineage database cannot be opened, migrated or written."""


class NotFoundError(OpenlabError):
    """An id names no record."""


class IntegrityError(OpenlabError):
    """Recorded lineage does not match what it claims (used by ``verify``)."""

    exit_code = 1
