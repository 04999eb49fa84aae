"""W&B runs as lineage nodes: deterministic run ids, lineage ids in W&B, summaries read back.

Both directions:

- *W&B → lineage*: :func:`stage_wandb_settings` builds the ``wandb:`` section a stage job
  starts its run with; its ``config.openlab`` holds the lineage ids (pipeline run, stage,
  stage identity, commit, snapshot, issue), and its tags make the run findable in the UI.
- *lineage → W&B*: :func:`record_wandb_run` reads back what the job wrote (run path, mode,
  local directory, summary metrics) and records a
  :class:`~orchestrator.lineage.models.WandbRun` related to the stage run;
  :func:`sync_offline_runs` uploads offline runs and records their URLs.

The run id is a hash of the stage identity, never of where or when it ran, so a retried
or requeued attempt (``resume="allow"``) continues the same W&B run (Marin derives it
from the output path for the same reason, and suffered when that path moved: #5216).

Offline runs write no ``wandb-summary.json``; their record log (``run-<id>.wandb``, a
32 KiB-block log of ``wandb_internal_pb2.Record`` messages) is read in-process with wandb's
own protobuf classes (milliseconds). If that fails (a future format change), the W&B CLI's
reader ``wandb leet inspect --summary --json`` is used instead (about a second per run, a
subprocess). The tests check that the two agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.errors import OpenlabError
from orchestrator.lineage.models import StageRun, WandbRun, utcnow
from orchestrator.lineage.store import LineageStore
from orchestrator.links.wandb_init import wandb_logged_in
from orchestrator.settings import Settings, load_settings

log = logging.getLogger(__name__)

#: Characters W&B does not allow in project (and entity) names.
_FORBIDDEN = set("/\\#?%:")
_MAX_NAME = 128
_MAX_TAG = 64
_RUN_DIR = re.compile(r"^(?P<kind>offline-run|run)-(?P<time>\d{8}_\d{6})-(?P<id>[A-Za-z0-9_-]+)$")


class WandbLinkError(OpenlabError):
    """A W&B link cannot be made: bad project name, no run files, not logged in."""


# -- the section a job starts its run with ------------------------------------------------------
def wandb_run_id(stage_identity: str) -> str:
    """16 hex characters derived from the stage identity only (so every attempt shares it)."""
    if not stage_identity:
        raise WandbLinkError("a W&B run id needs the stage identity, which is empty")
    return hashlib.sha256(f"openlab-wandb:{stage_identity}".encode()).hexdigest()[:16]


def validate_name(what: str, name: str | None) -> str | None:
    """Check a W&B project or entity name; one clear line when W&B would reject it."""
    if name is None:
        return None
    bad = sorted(_FORBIDDEN & set(name))
    if not name.strip() or bad or len(name) > _MAX_NAME or name != name.strip():
        why = (
            f"contains {' '.join(bad)}"
            if bad
            else ("is too long" if len(name) > _MAX_NAME else "is empty or has surrounding spaces")
        )
        raise WandbLinkError(
            f"invalid W&B {what} name {name!r}: it {why}; use at most {_MAX_NAME} characters without / \\ # ? % :"
        )
    return name


def _tag(value: str) -> str:
    return value[:_MAX_TAG]


def stage_wandb_settings(
    stage_identity: str,
    *,
    pipeline_run_id: str,
    stage: str,
    project: str | None = None,
    entity: str | None = None,
    commit_sha: str | None = None,
    issue_number: int | None = None,
    snapshot_id: str | None = None,
    backend: str | None = None,
    replica: str | None = None,
    trigger: str | None = None,
    sweep: str | None = None,
    lineage_ids: Mapping[str, Any] | None = None,
    redo_of: str | None = None,
    include_mode: bool = False,
    settings: Settings | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ``wandb:`` section of a stage job's config (``wandb.init(**section)``).

    ``project``/``entity`` default to ``[wandb] project``/``entity``. ``config.openlab``
    carries ``lineage_ids`` plus the pipeline run, stage and stage identity. The tags name the
    commit, issue, data snapshot, backend, replica, how the run was started
    (``trigger-schedule``: a W&B workspace filtered on it shows the nightlies alone) and the sweep
    it is one of (``sweep-swp_…``: the sweep's runs side by side in W&B's runs table).

    The run id derives from the stage identity, so every attempt of a stage (a retry, a resume after
    preemption, a later run going on from its checkpoint) continues one W&B run; ``redo_of`` (the
    stage run id, given when this identity completed before) makes the re-run a W&B run of its own.
    The run is named ``replica/stage pipeline_run`` (W&B's random names say nothing in a runs table).

    ``mode`` is left to the job by default (offline unless ``WANDB_API_KEY`` is set *in the
    job*, see :func:`orchestrator.links.wandb_init.wandb_mode`): the MoE workload's tracker
    accepts exactly the other keys and applies the same rule. ``include_mode=True`` adds
    the orchestrator's view of it for jobs that take ``mode`` from the section.
    """
    section_cfg = (settings or load_settings()).section("wandb") if (project is None or entity is None) else {}
    if project is None:
        project = section_cfg.get("project")
    if entity is None:
        entity = section_cfg.get("entity") or None
    if project is None:
        raise WandbLinkError("no W&B project: give one in the recipe or set [wandb] project")
    validate_name("project", project)
    validate_name("entity", entity)
    tags = []
    if commit_sha:
        tags.append(_tag(commit_sha[:8]))
    if issue_number is not None:
        tags.append(f"issue-{int(issue_number)}")
    if snapshot_id:
        tags.append(_tag(f"snap-{snapshot_id[:12]}"))
    if backend:
        tags.append(_tag(backend))
    if replica:
        tags.append(_tag(replica))
    if trigger:
        tags.append(_tag(f"trigger-{trigger}"))
    if sweep:
        tags.append(_tag(f"sweep-{sweep}"))
    openlab_ids = {
        **{k: v for k, v in (lineage_ids or {}).items() if v is not None},
        "pipeline_run_id": pipeline_run_id,
        "stage": stage,
        "stage_identity": stage_identity,
    }
    section: dict[str, Any] = {
        # a stage's re-run after its identity completed (forced, or its outputs no longer verified)
        # is a run of its own: continuing the completed one would log its steps again over it
        "id": wandb_run_id(f"{stage_identity}:{redo_of}" if redo_of else stage_identity),
        "name": f"{replica}/{stage} {pipeline_run_id}" if replica else f"{stage} {pipeline_run_id}",
        "project": project,
        "entity": entity,
        "group": pipeline_run_id,
        "job_type": stage,
        "tags": tags,
        "config": {"openlab": openlab_ids},
        "resume": "allow",
    }
    if include_mode:
        from orchestrator.links.wandb_init import wandb_mode

        section["mode"] = wandb_mode(environ)
    return section


# -- finding and reading what a job wrote --------------------------------------------------------------
def run_dir_id(run_dir: Path) -> str:
    """The run id of a W&B run directory, from the ``run-<id>.wandb`` file inside it.

    The directory name is ``<kind>-<time>-<id>``, plus ``-<n>`` when a run of the same id started
    within the same second (a quick retry: W&B de-duplicates the name), and an id may itself hold
    ``-``; the record file's name is the id alone.
    """
    for record in sorted(run_dir.glob("run-*.wandb")):
        return record.name[len("run-") : -len(".wandb")]
    m = _RUN_DIR.match(run_dir.name)
    return m.group("id") if m else ""


def _dir_order(run_dir: Path) -> tuple[str, int, str]:
    """Oldest first: the start second, then W&B's same-second suffix as a number (-2 before -10)."""
    m = _RUN_DIR.match(run_dir.name)
    time = m.group("time") if m else ""
    rest = run_dir.name.rsplit(f"-{run_dir_id(run_dir)}", 1)[-1] if m else ""
    suffix = int(rest[1:]) if rest[1:].isdigit() else 0
    return (time, suffix, run_dir.name)


def find_run_dirs(path: str | Path, run_id: str | None = None) -> list[Path]:
    """W&B run directories under ``path`` (itself, ``path/wandb/*`` or deeper), oldest first.

    With ``run_id``, only that run's directories: a resumed run has one per attempt.
    """
    root = Path(path)
    if not root.exists():
        raise WandbLinkError(f"no W&B run files: {root} does not exist")
    if _RUN_DIR.match(root.name) and any(root.glob("run-*.wandb")):
        candidates = [root]
    else:
        candidates = sorted({p.parent for p in root.rglob("run-*.wandb") if _RUN_DIR.match(p.parent.name)})
    if run_id is not None:
        candidates = [d for d in candidates if run_dir_id(d) == run_id]
    return sorted(candidates, key=_dir_order)


@dataclass
class RunReadback:
    """What one run directory says about its run."""

    run_id: str
    project: str | None
    entity: str | None
    mode: str
    local_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    state: str | None = None
    #: The run's name, as W&B's runs table shows it
    name: str | None = None


def _wandb_cli() -> list[str]:
    beside = Path(sys.executable).parent / "wandb"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("wandb")
    return [found] if found else [sys.executable, "-m", "wandb"]


def _read_with_leet(run_dir: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [*_wandb_cli(), "leet", "inspect", "--summary", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr or proc.stdout).strip().splitlines()[-1:] or f"exit {proc.returncode}")
    return json.loads(proc.stdout)


def _log_records(path: Path) -> list[bytes]:
    """Payloads of W&B's record log: a 7-byte header, then LevelDB-style 32 KiB blocks of chunks."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B record log")
    out: list[bytes] = []
    pending = b""
    pos, block = 7, 32 * 1024
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room  # block trailer padding
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:  # full
            out.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            out.append(pending + chunk)
            pending = b""
    return out


def _read_with_protobuf(run_dir: Path) -> dict[str, Any]:
    """The same fields as ``leet inspect --summary --json``, from the record log itself."""
    from wandb.proto import wandb_internal_pb2 as pb

    [log_file] = sorted(run_dir.glob("run-*.wandb"))[-1:]
    out: dict[str, Any] = {"summary": {}, "config": {}, "tags": [], "state": "running"}

    def put(target: dict[str, Any], item: Any) -> None:
        keys = list(item.nested_key) or [item.key]
        node = target
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = json.loads(item.value_json)

    for payload in _log_records(log_file):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.update(run_id=rec.run.run_id, project=rec.run.project, entity=rec.run.entity)
            out["name"] = rec.run.display_name or None
            out["tags"] = list(rec.run.tags)
            for item in rec.run.config.update:
                put(out["config"], item)
        elif kind == "config":
            for item in rec.config.update:
                put(out["config"], item)
        elif kind == "history":
            for item in rec.history.item:
                put(out["summary"], item)
        elif kind == "summary":
            for item in rec.summary.update:
                put(out["summary"], item)
            for item in rec.summary.remove:
                out["summary"].pop(item.key, None)
        elif kind == "preempting":  # run.mark_preempting(): stopped from outside, to be resumed
            out["preempting"] = True
        elif kind == "exit":
            failed = "preempted" if out.get("preempting") else "failed"
            out["state"] = "finished" if rec.exit.exit_code == 0 else failed
    return out


def read_run_dir(run_dir: str | Path, *, reader: str = "auto") -> RunReadback:
    """Read run path, mode, summary, config and tags from a run directory (no network).

    ``reader``: ``protobuf`` (the record log, in-process), ``leet`` (the W&B CLI) or ``auto``
    (protobuf, falling back to leet if the log cannot be parsed).
    """
    run_dir = Path(run_dir)
    m = _RUN_DIR.match(run_dir.name)
    if not m or not any(run_dir.glob("run-*.wandb")):
        raise WandbLinkError(f"{run_dir} is not a W&B run directory (no run-<id>.wandb inside)")
    if reader not in ("auto", "protobuf", "leet"):
        raise ValueError(f"unknown reader {reader!r}")
    data: dict[str, Any] | None = None
    if reader in ("auto", "protobuf"):
        try:
            data = _read_with_protobuf(run_dir)
        except Exception as exc:  # noqa: BLE001 - any parse problem means: ask the W&B CLI instead
            if reader == "protobuf":
                raise WandbLinkError(f"cannot parse the W&B record log in {run_dir}: {exc}") from None
            log.info("reading %s directly failed (%s); using `wandb leet inspect`", run_dir, exc)
    if data is None:
        try:
            data = _read_with_leet(run_dir)
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            raise WandbLinkError(f"`wandb leet inspect` could not read {run_dir}: {exc}") from None
    config = data.get("config") or {}
    config.pop("_wandb", None)
    return RunReadback(
        run_id=data.get("run_id") or run_dir_id(run_dir),
        project=data.get("project") or None,
        entity=data.get("entity") or None,
        mode="offline" if m.group("kind") == "offline-run" else "online",
        local_dir=run_dir.resolve(),
        summary=data.get("summary") or {},
        config=config,
        tags=list(data.get("tags") or []),
        state=data.get("state"),
        name=data.get("name") or None,
    )


def _scalar_summary(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Scalar metrics only (histograms and tables stay in W&B); W&B's clock fields dropped."""
    return {
        k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool)) and k not in ("_timestamp", "_wandb")
    }


def app_url(environ: Mapping[str, str] | None = None) -> str:
    """The W&B web app for ``WANDB_BASE_URL`` (``https://api.wandb.ai`` → ``https://wandb.ai``)."""
    env = os.environ if environ is None else environ
    base = (env.get("WANDB_BASE_URL") or "https://api.wandb.ai").rstrip("/")
    return base.replace("://api.", "://", 1)


def record_wandb_run(
    store: LineageStore,
    stage_run: StageRun | str,
    run_dir_or_out_dir: str | Path,
    *,
    reader: str = "auto",
    job_ended: bool = False,
) -> WandbRun:
    """Read back the stage's W&B run and record it (``stage_run --wasAssociatedWith--> wandb_run``).

    Looks for the run id derived from the stage identity first (every attempt's directory,
    merged oldest to newest), else the newest run found. Warns when the run's
    ``config.openlab`` names another stage identity: the two directions must agree.

    The record keeps how the run ended (``state``); with ``job_ended`` (its job is over), a run
    whose files never say it ended is ``crashed``, W&B's word for a process that died unheard.
    """
    stage = stage_run if isinstance(stage_run, StageRun) else store.require(StageRun, stage_run)
    expected = None
    dirs: list[Path] = []
    for candidate in (f"{stage.identity}:{stage.id}", stage.identity) if stage.identity else ():
        expected = wandb_run_id(candidate)  # a re-run's own run first (``redo_of``), else the identity's
        dirs = find_run_dirs(run_dir_or_out_dir, expected)
        if dirs:
            break
    if not dirs:
        found = find_run_dirs(run_dir_or_out_dir)
        if not found:
            raise WandbLinkError(
                f"no W&B run directory (wandb/offline-run-*/ or wandb/run-*/) under {run_dir_or_out_dir}"
            )
        latest_id = run_dir_id(found[-1])
        dirs = [d for d in found if run_dir_id(d) == latest_id]
        if expected:
            log.warning(
                "W&B run %s under %s is not the id derived from stage %s (%s)",
                latest_id,
                run_dir_or_out_dir,
                stage.id,
                expected,
            )
    reads = [read_run_dir(d, reader=reader) for d in dirs]
    last = reads[-1]
    summary: dict[str, Any] = {}
    for r in reads:
        summary.update(_scalar_summary(r.summary))
    ids = (last.config or {}).get("openlab") or {}
    if ids.get("stage_identity") and ids["stage_identity"] != stage.identity:
        log.warning("W&B run %s carries stage identity %s, not %s", last.run_id, ids["stage_identity"], stage.identity)
    project = last.project or "uncategorized"
    offline = [d for d, r in zip(dirs, reads, strict=True) if r.mode == "offline"]
    # uploaded where every offline attempt carries wandb's mark; one written after the last sync
    # (a retry, a resume after preemption) is not uploaded yet, whatever an earlier sync did
    mode = "online" if not offline else "synced" if all(is_synced(d) for d in offline) else "offline"
    url = f"{app_url()}/{last.entity}/{project}/runs/{last.run_id}" if mode == "online" and last.entity else None
    record_id = f"{last.entity or ''}/{project}/{last.run_id}"
    with store.transaction() as tx:
        existing = tx.get(WandbRun, record_id)
        fields = {
            "run_id": last.run_id,
            "project": project,
            "entity": last.entity,
            "mode": mode,
            "url": url or (existing.url if existing is not None else None),
            "local_dir": str(last.local_dir),
            "summary": summary,
            "state": "crashed" if job_ended and last.state in (None, "running") else last.state,
        }
        if existing is None:
            run = tx.add(WandbRun(id=record_id, **fields))
        elif any(getattr(existing, k) != v for k, v in fields.items()):
            run = tx.update(existing, updated_at=utcnow(), **fields)
        else:
            run = existing
        tx.relate("wasAssociatedWith", tx.get(StageRun, stage.id) or stage, run)
    return run


# -- uploading offline runs -----------------------------------------------------------------------------
def keep_unsynced(store: LineageStore, out_dir: Path, keep_dir: Path) -> list[Path]:
    """Move the offline W&B runs under ``out_dir`` that were never uploaded to ``keep_dir``, and point
    their records there: a forced re-run deletes the folder, and with it the only copy of the earlier
    run's curves (``openlab wandb sync`` uploads them from their new place). Returns where they went."""
    moved: dict[str, str] = {}
    for run_dir in find_run_dirs(out_dir):
        if not run_dir.name.startswith("offline-run") or is_synced(run_dir):
            continue
        target = keep_dir / run_dir.name
        keep_dir.mkdir(parents=True, exist_ok=True)
        moved[str(run_dir.resolve())] = str(target.resolve())
        shutil.move(run_dir, target)
    records = [run for run in store.list(WandbRun) if run.local_dir and str(Path(run.local_dir).resolve()) in moved]
    if records:
        with store.transaction() as tx:
            for run in records:
                new_dir = moved[str(Path(str(run.local_dir)).resolve())]
                tx.update(tx.get(WandbRun, run.id) or run, local_dir=new_dir, updated_at=utcnow())
    return [Path(p) for p in moved.values()]


#: The file wandb puts beside a run's ``run-<id>.wandb`` once it is uploaded.
SYNCED_SUFFIX = ".wandb.synced"


def is_synced(run_dir: Path) -> bool:
    """Whether an offline run directory was uploaded (wandb's ``run-<id>.wandb.synced`` mark in it)."""
    return any(run_dir.glob(f"run-*{SYNCED_SUFFIX}"))


_URL_IN_OUTPUT = re.compile(r"https?://\S+/runs/[A-Za-z0-9_-]+")

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=3600, check=False)


def sync_offline_runs(
    store: LineageStore, *, runner: Runner | None = None, environ: Mapping[str, str] | None = None
) -> list[WandbRun]:
    """Upload every recorded offline run (all attempts' directories) and record its URL.

    Raises :class:`WandbLinkError` when not logged in (nothing is attempted) or when an
    upload fails (after the others were tried).
    """
    if not wandb_logged_in(environ):
        raise WandbLinkError("not logged in to W&B: run `wandb login` (or set WANDB_API_KEY), then sync again")
    runner = runner or _run
    synced: list[WandbRun] = []
    failures: list[str] = []
    for run in store.list(WandbRun, mode="offline"):
        if not run.local_dir or not Path(run.local_dir).is_dir():
            failures.append(f"{run.id}: its files are gone ({run.local_dir})")
            continue
        every = find_run_dirs(Path(run.local_dir).parent, run.run_id) or [Path(run.local_dir)]
        dirs = [d for d in every if not is_synced(d)] or every  # what an earlier sync uploaded, not again
        cmd = [*_wandb_cli(), "sync", "--id", run.run_id, "-p", run.project]
        if run.entity:
            cmd += ["-e", run.entity]
        try:
            proc = runner([*cmd, *map(str, dirs)])
        except subprocess.TimeoutExpired as exc:  # one stuck upload: said, and the other runs still tried
            failures.append(f"{run.id}: wandb sync did not finish within {exc.timeout:g} s; run it again")
            continue
        except OSError as exc:  # no wandb command to run
            failures.append(f"{run.id}: cannot run {cmd[0]}: {exc.strerror or exc}")
            continue
        output = f"{proc.stdout or ''}\n{proc.stderr or ''}"
        # wandb (0.30 on) prints an upload's errors (a run deleted on the server, a project the key may
        # not write) and exits 0; only its own mark beside each run's .wandb file, written once the upload
        # went through, says it did. openlab wrote that mark itself after any exit 0, recorded the run
        # synced, and gc then deleted the only copy of a run that never reached W&B.
        if proc.returncode != 0 or "Not authenticated" in output or not all(is_synced(d) for d in dirs):
            lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
            said = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else None)
            unmarked = "" if proc.returncode else " (wandb marked no upload as done)"
            failures.append(f"{run.id}: wandb sync failed: {said or f'exit {proc.returncode}'}{unmarked}")
            continue
        m = _URL_IN_OUTPUT.search(output)
        url = m.group(0) if m else None
        if url is None and run.entity:
            url = f"{app_url(environ)}/{run.entity}/{run.project}/runs/{run.run_id}"
        with store.transaction() as tx:
            url = url or run.url
            synced.append(tx.update(tx.get(WandbRun, run.id) or run, mode="synced", url=url, updated_at=utcnow()))
    if failures:
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        raise WandbLinkError(f"{len(synced)} W&B run(s) synced; {failures[0]}{more}")
    return synced


__all__ = [
    "RunReadback",
    "WandbLinkError",
    "app_url",
    "find_run_dirs",
    "is_synced",
    "keep_unsynced",
    "read_run_dir",
    "record_wandb_run",
    "stage_wandb_settings",
    "sync_offline_runs",
    "validate_name",
    "wandb_logged_in",
    "wandb_run_id",
]
