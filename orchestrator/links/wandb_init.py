"""Start a stage's W&B run from the ``wandb:`` section the orchestrator put in its config.

This module is imported inside jobs (containers, Slurm, Kubernetes pods), so it imports
nothing but the standard library and ``wandb`` itself: no Prefect, no database.

The section comes from :func:`orchestrator.links.wandb.stage_wandb_settings`. Its run id
is derived from the stage identity and ``resume`` is ``"allow"``, so a retried or
requeued attempt continues the same W&B run instead of starting an unlinked one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Keys :func:`init_run` passes to ``wandb.init``; the same set the MoE workload's tracker accepts, plus mode.
SECTION_KEYS = ("id", "project", "entity", "group", "job_type", "tags", "config", "resume", "name", "notes", "mode")


def wandb_mode(environ: Mapping[str, str] | None = None) -> str:
    """``WANDB_MODE`` where it says ``online``, ``offline`` or ``disabled``; else ``online`` where a
    key is at hand (``WANDB_API_KEY``, or the netrc entry ``wandb login`` writes), ``offline`` where not.

    Decided in the job, because the job's environment, not the orchestrator's, holds the key.
    """
    env = os.environ if environ is None else environ
    forced = (env.get("WANDB_MODE") or "").strip().lower()
    # wandb's own older names: `dryrun` is offline and `run` online; passed as the mode, anything
    # else was read as "online where a key is at hand" and beat the variable asking for offline
    forced = {"dryrun": "offline", "run": "online"}.get(forced, forced)
    if forced in ("offline", "disabled", "online", "shared"):
        return forced
    return "online" if wandb_logged_in(env) else "offline"


def wandb_logged_in(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an API key is available: ``WANDB_API_KEY``, or a netrc entry for the W&B host
    (``WANDB_BASE_URL``'s, else api.wandb.ai) in ``NETRC`` or ``$HOME/.netrc``, as ``wandb login`` leaves."""
    import netrc
    import urllib.parse

    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    home = env.get("HOME") or str(Path.home())
    path = Path(env.get("NETRC") or Path(home) / ".netrc").expanduser()
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def init_kwargs(
    section: Mapping[str, Any],
    *,
    dir: str | Path | None = None,  # noqa: A002 - wandb.init's own name
    config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ``wandb.init`` keyword arguments for a section (pure; see :func:`init_run`)."""
    unknown = set(section) - set(SECTION_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) in the wandb section: {', '.join(sorted(unknown))}")
    kwargs = {k: v for k, v in section.items() if v is not None}
    kwargs.setdefault("resume", "allow")
    kwargs.setdefault("mode", wandb_mode(environ))
    if config:
        kwargs["config"] = {**dict(config), **dict(kwargs.get("config") or {})}  # lineage ids win
    if dir is not None:
        Path(dir).mkdir(parents=True, exist_ok=True)
        kwargs["dir"] = str(dir)
    return kwargs


def init_run(
    section: Mapping[str, Any],
    *,
    dir: str | Path | None = None,  # noqa: A002 - wandb.init's own name
    config: Mapping[str, Any] | None = None,
) -> Any:
    """``wandb.init(**section)``: run files go to ``dir/wandb/`` (default ``$WANDB_DIR``), quietly.

    ``config`` (the stage's own config) is merged under the section's ``config``, which
    carries ``{"openlab": {...lineage ids...}}`` so a W&B run always leads back to lineage.
    Console capture is off: the launcher already keeps the job's stdout and stderr, and a
    second copy in W&B would send whatever a job prints to W&B's servers.
    """
    import sys

    import wandb

    kwargs = init_kwargs(section, dir=dir, config=config)
    kwargs.setdefault("settings", wandb.Settings(silent=True, console="off"))
    try:
        return wandb.init(**kwargs)
    except Exception as exc:  # noqa: BLE001 - W&B is optional: the stage trains without its servers
        if kwargs.get("mode") not in ("online", "shared"):
            raise
        # W&B's servers refused or did not answer (a run of this id deleted in the UI, a project the key
        # may not write, no network): the training failed with it, and every retry of the same run id
        # again. The run goes on offline, its files kept for `openlab wandb sync`, which says why.
        said = " ".join(str(exc).split())[:300]
        sys.stderr.write(f"openlab: W&B did not start the run online ({said}); logging it offline instead\n")
        return wandb.init(**{**kwargs, "mode": "offline"})


__all__ = ["SECTION_KEYS", "init_kwargs", "init_run", "wandb_mode"]
