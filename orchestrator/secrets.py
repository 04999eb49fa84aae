"""Keep secrets out of lineage, logs, artifacts and exports.

A variable is secret when its name contains TOKEN, KEY, SECRET, PASSWORD, PASSWD or
CREDENTIAL (``GITHUB_TOKEN``, ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``...). Secret
values are passed to jobs through their environment but never recorded: records keep
the names with ``***``, and text that is stored or shown (job logs, error messages,
comments) has any secret value that appears in it replaced. Log records are masked as they
are made (:func:`mask_secrets_in_logs`), so no handler, ours or a library's, prints one.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import traceback
from collections.abc import Iterable, Mapping, Sequence

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


#: A password written into a URL, ``scheme://user:PASSWORD@host``: a secret whatever variable (or
#: none) it came from (``--db postgresql://bob:pw@db/x`` in a job's command was recorded and exported).
_URL_PASSWORD = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@")
#: A token written as a web URL's user (``https://ghp_…@github.com/o/r.git``, as GitHub documents for
#: cloning): the whole user part of an http(s) URL is masked, as ``strip_credentials`` drops it.
_URL_TOKEN_USER = re.compile(r"(?i)(\bhttps?://)[^/\s:@]+@")


def scrub(text: str, values: Iterable[str] | None = None) -> str:
    """``text`` with every secret value replaced by ``***`` (default: this process's secrets), and the
    password of any URL that carries one (``postgresql://bob:***@db/x``)."""
    for value in secret_values() if values is None else values:
        if value and value in text:
            text = text.replace(value, MASK)
    if "://" not in text:
        return text
    return _URL_TOKEN_USER.sub(rf"\g<1>{MASK}@", _URL_PASSWORD.sub(rf"\g<1>{MASK}@", text))


#: Words that make a record key a credential (``wandb_api_key``, ``githubToken``, ``db-password``).
#: Whole words, not substrings: a training config's ``tokenizer`` or ``max_tokens`` is no secret.
CREDENTIAL_WORDS = frozenset({"token", "key", "apikey", "secret", "password", "passwd", "credential", "credentials"})
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def is_credential_key(name: str) -> bool:
    """Whether a key in recorded data (params, configs, metadata) names a credential."""
    return any(word.lower() in CREDENTIAL_WORDS for word in _WORDS.findall(name))


def is_secret_option(name: str) -> bool:
    """Whether a command-line option or ``NAME=value`` argument names a secret: an environment
    variable's name (all capitals) by :func:`is_secret_name` (``MY_TOKEN``, ``APIKEY``); an option's
    or config key's by its last word (``--wandb-key``, ``db_password=``), so the shapes
    ``--tokenizer``, ``max_tokens=`` and ``--key-dim`` are kept. On a command line every value is
    text, so the type cannot tell a shape from a secret as it does in records."""
    name = name.lstrip("-")
    if not name:
        return False
    if name.isupper():
        return is_secret_name(name)
    words = _WORDS.findall(name)
    return bool(words) and words[-1].lower() in CREDENTIAL_WORDS


#: ``NAME=value`` inside a shell script given as one argument (``bash -c 'echo token=$T; train'``): the
#: value ends at the next space, quote or shell operator, so the rest of the script is kept.
_SCRIPT_ASSIGNMENT = re.compile(r"(?<![^\s;&|(`'\"])(-{0,2}[A-Za-z_][\w.-]*)=([^\s;&|()`'\"]+)")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _not_a_value(value: str) -> bool:
    """A number (``max_token=4096``: a shape) or a variable or command reference (``$MY_TOKEN``,
    ``$(cat key)``), which the command line shows without the secret it stands for."""
    return bool(_NUMBER.fullmatch(value)) or value.startswith("$")


def _mask_script(script: str) -> str:
    return _SCRIPT_ASSIGNMENT.sub(
        lambda m: m[0] if not is_secret_option(m[1]) or _not_a_value(m[2]) else f"{m[1]}={MASK}", script
    )


def redact_argv(args: Sequence[str], values: Iterable[str] | None = None) -> list[str]:
    """``args`` with the values of secret options and ``NAME=value`` secrets masked, and any
    secret value (``values``; default: this process's environment's) scrubbed wherever it appears.
    The one rule for a command line that is recorded: what ``openlab run`` was typed as, and the
    command a job runs (``env DB_PASSWORD=x train.py``, ``train.py --db-password x``).

    ``--token X`` and ``--token=X`` hide X; ``-e WANDB_API_KEY=X`` and ``--env=GITHUB_TOKEN=X``
    hide X (the first secret-looking name in a chain of ``=`` hides all after it). A number or a
    ``$reference`` is no secret value (``data.max_token=4096``). In a shell script given as one
    argument (it has spaces: ``bash -c '...'``) each ``NAME=value`` is masked alone, up to the next
    space or shell operator: the whole rest of the script was masked, ``echo token=***``.
    """
    found = secret_values() if values is None else list(values)
    out: list[str] = []
    mask_next = False
    for arg in args:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        if any(c.isspace() for c in arg):
            out.append(scrub(_mask_script(arg), found))
            continue
        parts = arg.split("=")
        secret_at = next((i for i, part in enumerate(parts[:-1]) if is_secret_option(part)), None)
        if secret_at is not None and _not_a_value("=".join(parts[secret_at + 1 :])):
            out.append(scrub(arg, found))
        elif secret_at is not None:
            out.append("=".join([*parts[: secret_at + 1], MASK]))
        elif arg.startswith("--") and len(parts) == 1 and is_secret_option(arg):
            out.append(arg)
            mask_next = True  # its value is the next word
        else:
            out.append(scrub(arg, found))
    return out


def redact_value(value: object, values: Iterable[str] | None = None) -> object:
    """``value`` made safe to record: credential-named string entries masked, secret values scrubbed.

    Applied by the lineage store to every record it writes, so a secret passed as a flow
    parameter or left in a config never reaches lineage (and so never an export).
    Non-string values under credential-like keys (``key_dim: 64``) are kept: they are shapes, not secrets.
    """
    found = secret_values() if values is None else list(values)
    return _redact(value, found)


def credential_values(value: object) -> list[str]:
    """String values found under credential-named keys anywhere in ``value``.

    A token given as ``params["github_token"]`` may also appear in another field's text
    (a command line, an error); scrubbing these too closes that path.
    """
    found: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, str) and len(v) >= MIN_SECRET_LENGTH and is_credential_key(str(k)):
                found.append(v)
            else:
                found.extend(credential_values(v))
    elif isinstance(value, list):
        for v in value:
            found.extend(credential_values(v))
    return found


def _redact(value: object, found: list[str]) -> object:
    if isinstance(value, str):
        return scrub(value, found)
    if isinstance(value, dict):
        return {
            k: (MASK if isinstance(v, str) and v and is_credential_key(str(k)) else _redact(v, found))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redact(v, found) for v in value]
    return value


def _masked(record: logging.LogRecord) -> logging.LogRecord:
    """``record`` with every secret value in its message and traceback replaced, in place."""
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a bad format string is the handler's to report, as before
        return record
    found = secret_values()
    clean = scrub(message, found)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[0] is not None:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        clean = scrub(text, found)
        if clean != text:  # handlers print exc_text when there is no exc_info left to format
            record.exc_info, record.exc_text = None, clean
    return record


_mask_lock = threading.Lock()
_masking_installed = False


def mask_secrets_in_logs() -> None:
    """Mask secret values in every log record this process creates, whoever logs it and wherever
    it goes (stderr, a file, Prefect's API): a warning quoting a database URL or a backend's
    error text must not carry a password out of the process. Installed once, when
    :mod:`orchestrator` is imported, by wrapping the current log record factory (so a factory
    installed before, Prefect's or a test runner's, still applies).

    Records are made only for levels that will be handled, so the eager formatting costs nothing
    for suppressed debug lines.
    """
    global _masking_installed
    with _mask_lock:
        if _masking_installed:
            return
        make = logging.getLogRecordFactory()

        def factory(*args: object, **kwargs: object) -> logging.LogRecord:
            return _masked(make(*args, **kwargs))

        logging.setLogRecordFactory(factory)
        _masking_installed = True
