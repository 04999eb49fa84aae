"""Shared output helpers: JSON for scripts, rich tables for people, one-line errors."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def given_path(value: str | Path) -> Path:
    """A path argument as typed, refusing an empty one: ``Path("")`` is the current directory, so
    a variable that expanded to nothing (``openlab adopt ... "$OUT"``) would adopt, snapshot or
    overwrite whatever folder the command ran in. For ``typer``'s ``parser=``."""
    if isinstance(value, Path):
        return value
    if not value.strip():
        import typer

        raise typer.BadParameter("an empty path: give a file or folder (. for this one)")
    if value.startswith("~"):  # quoted past the shell: ~ and ~user mean what the shell would make them
        from orchestrator.settings import expand_user

        return expand_user(value)  # ~nosuchuser: said in one line, where a literal folder was made here
    return Path(value)


def print_json(data: Any) -> None:
    """Print one JSON document on stdout (no colour, no wrapping: scripts parse it; strict JSON, a
    diverged loss as ``"NaN"``: ``jq`` refuses a bare ``NaN``)."""
    from orchestrator.lineage.export import dumps

    sys.stdout.write(dumps(data, indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()


def say(text: str) -> None:
    """Print recorded text as it was recorded: not read as rich markup (``[rank 3]`` stays), not
    highlighted, and not wrapped inside (an id or a path is copied whole)."""
    console.print(text, highlight=False, markup=False, soft_wrap=True)


def print_error(message: object) -> None:
    """One ``error: ...`` line on stderr: never wrapped at the terminal's width, and the text is not
    read as rich markup (``[prefect] nightly_cron`` in a message must print as written)."""
    from rich.markup import escape

    from orchestrator.secrets import scrub

    # a secret's value that an error quotes back (`--stage-run x-$TOKEN`) is masked, as in every log
    err_console.print(f"[bold red]error:[/] {escape(scrub(str(message)))}", highlight=False, soft_wrap=True)


#: Below this many columns (an 80-column terminal, or a pipe, which rich takes as 80) tables with
#: several columns of ids and prose cut the ids in two: the commands print tighter tables or one
#: block per row instead.
NARROW_BELOW = 110


def narrow() -> bool:
    """Whether stdout is narrower than :data:`NARROW_BELOW` columns."""
    return console.width < NARROW_BELOW


def compact_table(title: str) -> Table:
    """A table for many columns: a rule under the header and none between columns, and no
    padding beside them when :func:`narrow`, so it fits 80 columns before anything has to wrap.
    Callers keep what is copied or compared (ids, numbers) on one line with ``no_wrap`` or a
    ``min_width``, and let prose wrap."""
    from rich import box

    return Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0 if narrow() else 1))


def fit_last_column(table: Table) -> Table:
    """Cap a :func:`compact_table`'s last (wrapping) column to the room the others leave.

    Rich collapses wrapping columns to fit the terminal, but not below their minimum widths (the
    ids': copied whole); the table then came out a few columns too wide and the console cropped
    the last words of the summaries (``backend=local COMPLET``). A column that may fold (overflow
    ``fold`` with a ``min_width``) is counted at that minimum. Call after the rows are added."""
    from rich.cells import cell_len

    columns = table.columns
    if len(columns) < 2:
        return table
    used = 0
    for column in columns[:-1]:
        widest = max([cell_len(str(cell)) for cell in column.cells] + [cell_len(str(column.header))])
        # a column that may fold (a 40-digit commit sha) gives up what is beyond its minimum width
        minimum = column.min_width or 0
        folds = not column.no_wrap and column.overflow == "fold" and minimum > 0
        used += min(widest, minimum) if folds else max(widest, minimum)
    left, right = table.padding[3], table.padding[1]
    gaps = (len(columns) - 1) * (1 + left + right)  # one separator and the padding between each two columns
    columns[-1].max_width = max(console.width - used - gaps, 12)
    return table


#: The colour of each state of a stage or run, the same in every command that prints one.
STATE_STYLE = {
    "CHECKING": "cyan",
    "WAITING": "yellow",
    "RUNNING": "blue",
    "REUSED": "green",
    "COMPLETED": "bold green",
    "FAILED": "bold red",
    "RETRYING": "yellow",
    "PREEMPTED": "yellow",
    "CANCELLED": "red",
    "SKIPPED": "dim",
    "PENDING": "dim",
}
#: The colour of each dry-run action: ``openlab explain`` and ``openlab sweep --dry-run``.
ACTION_STYLE = {"reuse": "green", "run": "bold blue", "wait": "yellow", "depends": "cyan", "shared": "cyan"}


def describe_task(end: Mapping[str, Any]) -> str:
    """One array task in a few words, ``FAILED exit 7 on node1 (reason)``: the same line for a live
    ``openlab job status`` and for the attempt's record in ``openlab lineage show``."""
    exit_code = "" if end.get("exit_code") is None else f" exit {end['exit_code']}"
    where = f" on {end['host']}" if end.get("host") else ""
    why = f" ({end['reason']})" if end.get("reason") else ""
    return f"{end.get('state')}{exit_code}{where}{why}"


def describe_asks(resources: dict[str, object]) -> str:
    """``cpus=2 mem=4G gpus=1 time=30m`` for a stage's requested resources (``-``: the backend's defaults)."""
    from orchestrator.recipes import BACKEND_OPTIONS

    if not resources:
        return "-"
    names = {"nodes": "nodes", "tasks_per_node": "tasks/node", "cpus": "cpus", "memory": "mem", "gpus": "gpus"}
    parts = [f"on {resources['backend']}"] if resources.get("backend") else []
    parts += [f"{names[k]}={resources[k]}" for k in names if k in resources]
    if "time_limit" in resources:
        minutes, seconds = divmod(int(resources["time_limit"]), 60)  # type: ignore[call-overload]
        parts.append(f"time={minutes}m" + (f"{seconds}s" if seconds else ""))
    for backend in BACKEND_OPTIONS:  # each used when the stage runs there
        options = resources.get(backend)
        if isinstance(options, dict) and options:
            parts.append(backend + " " + " ".join(f"{k}={_backend_option(v)}" for k, v in options.items()))
    return " ".join(parts)


def _backend_option(value: object) -> str:
    """A backend option in one short word: ``pool=gpu,zone=a`` for a mapping, ``2 items`` for a list."""
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list) and value and not all(isinstance(v, str) for v in value):
        return f"{len(value)} item{'s' if len(value) != 1 else ''}"
    return " ".join(value) if isinstance(value, list) else str(value)


def describe_usage(used: Mapping[str, Any]) -> str:
    """What a job used as a person reads it, ``peak memory 0.34 GiB, 3.7 CPU-seconds``: the same
    words in ``openlab job status`` and ``openlab lineage show`` of its attempt."""
    parts = []
    if used.get("max_rss_bytes") is not None:
        parts.append(f"peak memory {used['max_rss_bytes'] / 2**30:.2f} GiB")
    if used.get("cpu_seconds") is not None:
        parts.append(f"{used['cpu_seconds']:.1f} CPU-seconds")
    return ", ".join(parts)


def _scalar(value: Any) -> str:
    """A leaf value as people read it: floats to six significant digits (the JSON keeps them whole)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, ".6g")
    return str(value)


def _flat(value: Any) -> bool:
    """Whether ``value`` is a leaf, or a mapping or list of leaves only."""
    if isinstance(value, Mapping):
        value = list(value.values())
    elif not isinstance(value, list | tuple):
        return True
    return not any(isinstance(v, Mapping | list | tuple) for v in value)


def _inline(value: Any) -> str:
    """A leaf, a list of leaves (``a, b``) or a mapping of leaves (``k=v, k=v``) on one line."""
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_scalar(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(_scalar(v) for v in value)
    return _scalar(value)


def print_fields(fields: Mapping[str, Any], indent: int = 2, min_key: int = 16) -> None:
    """Print a record's fields for an auditor: one ``key  value`` line per plain field first, then
    each nested one (a recipe, a stage's identity fields, its metrics) as an indented block, one
    line per leaf, where ``str(dict)`` made one line of a thousand characters.

    A mapping or list whose leaves fit on the rest of the line is printed there (``k=v, k=v``).
    Empty values are left out. Text is printed as recorded, never read as rich markup; the
    ``--json`` form keeps every value exactly.
    """
    shown = {k: v for k, v in fields.items() if v not in (None, {}, [], ())}
    if not shown:
        return
    width = max(min_key, min(max(len(str(k)) for k in shown) + 2, 52))
    room = max(console.width - indent - width, 20)
    plain = [(k, v) for k, v in shown.items() if not isinstance(v, Mapping | list | tuple)]
    nested = [(k, v) for k, v in shown.items() if isinstance(v, Mapping | list | tuple)]
    for key, value in plain + nested:
        head = f"{' ' * indent}{str(key):<{width - 1}} "
        if not isinstance(value, Mapping | list | tuple) or (_flat(value) and len(_inline(value)) <= room):
            say(f"{head}{_inline(value)}".rstrip())
        elif isinstance(value, Mapping):
            say(f"{' ' * indent}{key}")
            print_fields(value, indent + 2, min_key=0)
        else:
            say(f"{' ' * indent}{key}")
            print_fields({f"[{i}]": item for i, item in enumerate(value)}, indent + 2, min_key=0)


def byte_progress() -> Progress:
    """A transient bar for work measured in bytes (hashing or copying a large folder)."""
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
