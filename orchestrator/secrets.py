"""Keep secrets out of lineage, logs, artifacts and exports.

A variable is secret when its name contains TOKEN, KEY, SECRET, PASSWORD, PASSWD or
CREDENTIAL (``GITHUB_TOKEN``, ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``...). Secret
values are passed to jobs through their environment but never recorded: records keep
the names with ``***``, and text that is stored or shown (job logs, error messages,
comments) has any secret value that appears in it replaced.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MASK = "***"
#: Values shorter than this are not scrubbed from text: masking "1" everywhere helps nobody.
MIN_SECRET_LENGTH = 6


def is_secret_name(name: str) -> bool:
    """Whether a variable or config key with this name holds a secret."""
    return bool(SECRET_NAME.search(name))


def redact_mapping(values: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``values`` with every secret-named entry's value masked."""
    return {k: (MASK if is_secret_name(k) else v) for k, v in values.items()}


def secret_values(*sources: Mapping[str, str]) -> list[str]:
    """The values of secret-named variables in ``sources`` (default: this process's environment)."""
    found: set[str] = set()
    for source in sources or (os.environ,):
        for name, value in source.items():
            if value and len(value) >= MIN_SECRET_LENGTH and is_secret_name(name):
                found.add(value)
    return sorted(found, key=len, reverse=True)


def scrub(text: str, values: Iterable[str] | None = None) -> str:
    """``text`` with every secret value replaced by ``***`` (default: this process's secrets)."""
    for value in secret_values() if values is None else values:
        if value and value in text:
            text = text.replace(value, MASK)
    return text
