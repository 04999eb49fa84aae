"""Shared output helpers: JSON for scripts, rich tables for people, one-line errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def print_json(data: Any) -> None:
    """Print one JSON document on stdout (no colour, no wrapping: scripts parse it)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def print_error(message: object) -> None:
    """One ``error: ...`` line on stderr: never wrapped at the terminal's width, and the text is not
    read as rich markup (``[prefect] nightly_cron`` in a message must print as written)."""
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(str(message))}", highlight=False, soft_wrap=True)


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


def describe_task(end: Mapping[str, Any]) -> str:
    """One array task in a few words, ``FAILED exit 7 on node1 (reason)``: the same line for a live
    ``openlab job status`` and for the attempt's record in ``openlab lineage show``."""
    exit_code = "" if end.get("exit_code") is None else f" exit {end['exit_code']}"
    where = f" on {end['host']}" if end.get("host") else ""
    why = f" ({end['reason']})" if end.get("reason") else ""
    return f"{end.get('state')}{exit_code}{where}{why}"


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
