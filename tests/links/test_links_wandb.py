"""W&B links with the real wandb library in offline mode: a subprocess job per attempt."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from orchestrator.cli.wandb import app as wandb_app
from orchestrator.lineage.models import Relation, StageRun, WandbRun
from orchestrator.lineage.trace import trace
from orchestrator.links.wandb import (
    WandbLinkError,
    find_run_dirs,
    is_synced,
    read_run_dir,
    record_wandb_run,
    run_dir_id,
    stage_wandb_settings,
    sync_offline_runs,
    wandb_run_id,
)
from orchestrator.links.wandb_init import init_kwargs

IDENTITY = "c0ffee" * 10 + "abcd"

JOB = r"""
import json, sys
from orchestrator.links.wandb_init import init_run
section, out, steps = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
run = init_run(section, dir=out, config={"lr": 0.003})
for step, metrics in steps:
    run.log(metrics, step=step)
run.summary["attempt_id"] = run.id
print(json.dumps({"id": run.id, "path": run.path, "mode": run.settings.mode, "dir": run.dir}))
run.finish()
"""


def _section(**extra: Any) -> dict[str, Any]:
    return stage_wandb_settings(
        IDENTITY,
        pipeline_run_id="prun_w1",
        stage="pretrain",
        project="openlab-moe",
        entity="lab",
        commit_sha="abc1234def567890",
        issue_number=7,
        snapshot_id="b3snapshot0123456789",
        backend="slurm",
        replica="olmoe",
        trigger="schedule",
        lineage_ids={"stage_run_id": "srun_w1", "commit": "abc1234def567890", "issue": "lab/exp#7"},
        **extra,
    )


def _job_env(wandb_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    return env


def _run_job(
    out: Path,
    section: dict[str, Any],
    steps: list[tuple[int, dict[str, float]]],
    *,
    code: str = JOB,
    exit_code: int = 0,
) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(section), str(out), json.dumps(steps)],
        env=_job_env(out.parent),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == exit_code, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


ATTEMPT1 = [
    (0, {"loss": 4.0, "tokens": 100.0}),
    (1, {"loss": 3.25, "tokens": 200.0}),
    (2, {"loss": 2.5, "tokens": 300.0}),
]
ATTEMPT2 = [(3, {"loss": 2.125, "tokens": 400.0}), (4, {"loss": 1.75, "tokens": 500.0})]


@pytest.fixture(scope="module")
def job_out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One stage's output dir after two attempts (the second a retry of the first), run once."""
    out = tmp_path_factory.mktemp("stage") / "out"
    first = _run_job(out, _section(), ATTEMPT1)
    second = _run_job(out, _section(), ATTEMPT2)
    return out, [first, second]


@pytest.fixture
def stage(store) -> StageRun:
    with store.transaction() as tx:
        return tx.add(StageRun(id="srun_w1", stage="pretrain", identity=IDENTITY, state="RUNNING"))


def test_a_run_whose_job_died_unheard_is_recorded_crashed(tmp_path: Path, store, stage) -> None:
    """A job killed outright (out of memory, SIGKILL) never tells W&B it ended: once the job is
    over, its run is recorded ``crashed``, not left looking like it is still going."""
    killed = JOB.replace("run.finish()", "import os; sys.stdout.flush(); os._exit(137)")
    out = tmp_path / "out"
    _run_job(out, _section(), ATTEMPT1, code=killed, exit_code=137)
    assert record_wandb_run(store, stage, out).state == "running"  # asked while the job may still run
    assert record_wandb_run(store, stage, out, job_ended=True).state == "crashed"


def test_section_carries_lineage_ids_deterministic_id_and_tags() -> None:
    s = _section()
    assert s["id"] == wandb_run_id(IDENTITY) and len(s["id"]) >= 8
    assert s["id"] == _section()["id"] and s["id"] != wandb_run_id(IDENTITY + "x")
    assert (s["project"], s["entity"], s["group"], s["job_type"], s["resume"]) == (
        "openlab-moe",
        "lab",
        "prun_w1",
        "pretrain",
        "allow",
    )
    assert s["tags"] == ["abc1234d", "issue-7", "snap-b3snapshot01", "slurm", "olmoe", "trigger-schedule"]
    swept = _section(sweep="swp_0123456789abcdef0123")["tags"]  # one run of a sweep: W&B filters on it
    assert swept[-1] == "sweep-swp_0123456789abcdef0123"
    assert s["config"] == {
        "openlab": {
            "stage_run_id": "srun_w1",
            "commit": "abc1234def567890",
            "issue": "lab/exp#7",
            "pipeline_run_id": "prun_w1",
            "stage": "pretrain",
            "stage_identity": IDENTITY,
        }
    }
    assert "mode" not in s
    assert _section(include_mode=True, environ={})["mode"] == "offline"
    assert _section(include_mode=True, environ={"WANDB_API_KEY": "k"})["mode"] == "online"
    assert init_kwargs(s, environ={})["mode"] == "offline"
    assert init_kwargs(s, environ={"WANDB_API_KEY": "k"})["mode"] == "online"


def test_a_job_goes_online_where_the_user_logged_in_or_said_so(tmp_path: Path) -> None:
    """``wandb login`` keeps the key in ~/.netrc, not in the environment: a job with that file (or
    ``WANDB_MODE=online``) streams to W&B, as wandb itself would, instead of writing offline runs."""
    from orchestrator.links.wandb_init import wandb_mode

    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    nowhere = str(tmp_path / "none")
    assert wandb_mode({"NETRC": str(netrc)}) == "online"
    assert wandb_mode({"HOME": str(tmp_path), "NETRC": nowhere}) == "offline"
    (tmp_path / ".netrc").write_bytes(netrc.read_bytes())
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_mode({"HOME": str(tmp_path)}) == "online", "the netrc wandb login writes, in the job's HOME"
    assert wandb_mode({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.lab.internal"}) == "offline"
    assert wandb_mode({"NETRC": nowhere, "WANDB_MODE": "online"}) == "online", "asked for: wandb says if it cannot"
    assert wandb_mode({"NETRC": str(netrc), "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "disabled"}) == "disabled"
    # wandb's older names: dryrun asked for offline, and a key at hand made it online
    assert wandb_mode({"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "dryrun"}) == "offline"
    assert wandb_mode({"NETRC": nowhere, "WANDB_MODE": "run"}) == "online"


REFUSED_ONLINE = r"""
import json, sys, wandb
real = wandb.init
def refusing(**kwargs):  # W&B's servers, as they answer for a run id whose run was deleted in the UI
    if kwargs.get("mode") == "online":
        raise wandb.errors.CommError("run lab/openlab-moe/x was previously created and deleted; try a new run name")
    return real(**kwargs)
wandb.init = refusing
from orchestrator.links.wandb_init import init_run
section, out = json.loads(sys.argv[1]), sys.argv[2]
run = init_run({**section, "mode": "online"}, dir=out)
run.log({"loss": 3.0}, step=0)
print(json.dumps({"id": run.id, "mode": run.settings.mode, "dir": run.dir}))
run.finish()
"""


def _run_section_job(code: str, out: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """``code`` run as a job is: its own Python, given the W&B section and its output folder."""
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(_section()), str(out)],
        env=_job_env(home),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_a_run_w_and_b_refuses_online_trains_on_logging_offline(tmp_path: Path) -> None:
    """A run of this stage's id deleted in the W&B UI, a project the key may not write, no network:
    `wandb.init` raised, the stage failed, and every retry of the same run id failed again."""
    out = tmp_path / "out"
    proc = _run_section_job(REFUSED_ONLINE, out, tmp_path)
    ran = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ran["mode"] == "offline" and Path(ran["dir"]).is_relative_to(out), ran
    assert (
        "openlab: W&B did not start the run online (run lab/openlab-moe/x was previously created and deleted; "
        "try a new run name); logging it offline instead"
    ) in proc.stderr


@pytest.mark.parametrize("name", ["lab/moe", "moe#1", "a:b", "what?", "x" * 129, "", " moe"])
def test_invalid_project_name_is_one_clear_line(name: str) -> None:
    with pytest.raises(WandbLinkError) as err:
        stage_wandb_settings(IDENTITY, pipeline_run_id="p", stage="s", project=name, entity="lab")
    text = str(err.value)
    assert text.startswith("invalid W&B project name") and "\n" not in text


def test_project_from_config_or_a_clear_error(openlab_env: Path) -> None:
    with pytest.raises(WandbLinkError, match=r"no W&B project"):
        stage_wandb_settings(IDENTITY, pipeline_run_id="p", stage="s")
    openlab_env.write_text('[wandb]\nproject = "from-config"\nentity = "team"\n')
    s = stage_wandb_settings(IDENTITY, pipeline_run_id="p", stage="s")
    assert (s["project"], s["entity"]) == ("from-config", "team")


def test_metrics_read_back_from_offline_files_match_what_the_job_logged(job_out, store, stage) -> None:
    out, attempts = job_out
    first = attempts[0]
    assert first["mode"] == "offline" and first["id"] == wandb_run_id(IDENTITY)
    [d1, d2] = find_run_dirs(out, first["id"])
    one = read_run_dir(d1)
    assert one.mode == "offline" and one.run_id == first["id"] and one.project == "openlab-moe"
    assert {k: one.summary[k] for k in ("loss", "tokens", "_step")} == {"loss": 2.5, "tokens": 300.0, "_step": 2}
    assert one.config["openlab"]["stage_identity"] == IDENTITY and one.config["lr"] == 0.003
    assert "issue-7" in one.tags

    run = record_wandb_run(store, stage, out)
    assert run.id == f"lab/openlab-moe/{first['id']}" and run.mode == "offline" and run.url is None
    assert Path(run.local_dir) == d2.resolve()
    last_step, last = ATTEMPT2[-1]
    assert {k: run.summary[k] for k in ("loss", "tokens", "_step")} == {**last, "_step": last_step}
    assert run.summary["attempt_id"] == first["id"]
    assert run.state == "finished"  # how the run ended, as its last attempt's files say
    [rel] = store.list(Relation, relation="wasAssociatedWith", subject_id=stage.id, object_kind=WandbRun.kind)
    assert rel.object_id == run.id
    assert store.get(WandbRun, run.id).summary == run.summary

    # From the id the W&B UI shows back to the stage run that logged it (and so to its data and commit)
    traced = trace(store, first["id"])
    assert (traced.kind, traced.id) == ("wandb_run", run.id)
    assert [(c.relation, c.id) for c in traced.children] == [("recordOf", stage.id)]


def test_retried_attempt_resumes_the_same_run_id(job_out) -> None:
    out, (first, second) = job_out
    assert first["id"] == second["id"] == wandb_run_id(IDENTITY)
    assert first["path"] == second["path"] == f"lab/openlab-moe/{first['id']}"
    dirs = find_run_dirs(out)
    assert len(dirs) == 2 and all(run_dir_id(d) == first["id"] for d in dirs)
    assert read_run_dir(dirs[1]).summary["_step"] == 4


def test_attempts_started_within_one_second_are_found_in_order(job_out, tmp_path: Path) -> None:
    """W&B names a run's directory by the second it started; a retry within the same second gets
    ``-1``, ``-2``... appended. Those are the same run, and ``-10`` comes after ``-2``."""
    out, (first, _) = job_out
    [d1, _] = find_run_dirs(out, first["id"])
    copy = tmp_path / "wandb"
    names = [d1.name, f"{d1.name}-1", f"{d1.name}-2", f"{d1.name}-10"]
    for name in reversed(names):
        shutil.copytree(d1, copy / name)
    found = find_run_dirs(tmp_path, first["id"])
    assert [d.name for d in found] == names
    assert {run_dir_id(d) for d in found} == {first["id"]}
    assert read_run_dir(found[-1]).run_id == first["id"]


def test_both_readers_agree(job_out) -> None:
    out, _ = job_out
    for d in find_run_dirs(out):
        leet, raw = read_run_dir(d, reader="leet"), read_run_dir(d, reader="protobuf")
        user = [k for k in leet.summary if not k.startswith("_")]
        assert user and {k: raw.summary[k] for k in user} == {k: leet.summary[k] for k in user}
        assert raw.config == leet.config and raw.tags == leet.tags
        assert (raw.run_id, raw.project, raw.entity) == (leet.run_id, leet.project, leet.entity)


def test_record_without_run_files_is_a_clear_error(tmp_path: Path, store, stage) -> None:
    with pytest.raises(WandbLinkError, match="no W&B run directory"):
        record_wandb_run(store, stage, tmp_path)


def test_moe_workload_tracker_accepts_the_section(tmp_path: Path) -> None:
    """The MoE workload's own tracker starts its run from our section: the formats agree."""
    pytest.importorskip("workloads.moe.tracking")
    code = (
        "import json, sys; from pathlib import Path; from workloads.moe.tracking import open_tracker\n"
        "with open_tracker(Path(sys.argv[2]), 'pretrain', {'lr': 1}, json.loads(sys.argv[1])) as tr:\n"
        "    tr.log({'loss': 1.5}, step=0); print(tr.run_id)\n"
    )
    out = tmp_path / "moe"
    out.mkdir()
    proc = _run_section_job(code, out, tmp_path)
    assert proc.stdout.strip().splitlines()[-1] == wandb_run_id(IDENTITY)
    [d] = find_run_dirs(out)
    back = read_run_dir(d, reader="protobuf")
    assert back.summary["loss"] == 1.5 and back.config["openlab"]["stage_identity"] == IDENTITY


# -- sync -------------------------------------------------------------------------------------------
def test_sync_without_login_is_one_line_exit_2(openlab_env: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    result = CliRunner().invoke(wandb_app, ["sync"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: not logged in to W&B: run `wandb login` (or set WANDB_API_KEY), then sync again"
    )


def test_sync_uploads_every_attempt_and_records_the_url(job_out, store, stage, tmp_path: Path) -> None:
    out, (first, _) = job_out
    out = Path(shutil.copytree(out, tmp_path / "out"))  # sync marks what it uploaded: the module's copy stays as run
    record_wandb_run(store, stage, out)
    calls: list[list[str]] = []

    def fake_wandb(cmd):  # as wandb 0.31's sync does it: each run's mark beside its .wandb file, once uploaded
        calls.append(list(cmd))
        for run_dir in cmd[8:]:
            for log in Path(run_dir).glob("run-*.wandb"):
                log.with_suffix(".wandb.synced").touch()
        url = f"https://wandb.ai/lab/openlab-moe/runs/{first['id']}"
        return subprocess.CompletedProcess(cmd, 0, stdout=f"Syncing: {url} ... done.\n", stderr="")

    [run] = sync_offline_runs(store, runner=fake_wandb, environ={"WANDB_API_KEY": "k"})
    assert run.mode == "synced" and run.url == f"https://wandb.ai/lab/openlab-moe/runs/{first['id']}"
    [cmd] = calls
    assert cmd[1:8] == ["sync", "--id", first["id"], "-p", "openlab-moe", "-e", "lab"]
    assert [Path(p).name for p in cmd[8:]] == [d.name for d in find_run_dirs(out)]
    assert sync_offline_runs(store, runner=fake_wandb, environ={"WANDB_API_KEY": "k"}) == []  # nothing left
    assert all(is_synced(d) for d in find_run_dirs(out)), "marked as wandb marks what it uploaded"

    # the stage is preempted and resumed: a third attempt of the same run, written after the sync
    third = _run_job(out, _section(), [(5, {"loss": 1.5, "tokens": 600.0})])
    assert third["id"] == first["id"]
    again = record_wandb_run(store, stage, out, job_ended=True)
    assert again.mode == "offline", "the new attempt is not uploaded: sync must see it"
    calls.clear()
    [run] = sync_offline_runs(store, runner=fake_wandb, environ={"WANDB_API_KEY": "k"})
    [cmd] = calls
    assert [Path(p).name for p in cmd[8:]] == [find_run_dirs(out)[-1].name], "only what was not uploaded"
    assert run.mode == "synced" and run.url == f"https://wandb.ai/lab/openlab-moe/runs/{first['id']}"
    assert record_wandb_run(store, stage, out, job_ended=True).mode == "synced"


def test_sync_failure_is_reported(job_out, store, stage) -> None:
    out, _ = job_out
    record_wandb_run(store, stage, out)

    def failing(cmd):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="wandb: ERROR permission denied\n")

    with pytest.raises(WandbLinkError, match="wandb sync failed: wandb: ERROR permission denied"):
        sync_offline_runs(store, runner=failing, environ={"WANDB_API_KEY": "k"})
    assert store.list(WandbRun)[0].mode == "offline"

    # wandb 0.31 prints an upload's error and exits 0, writing no mark: not synced, and gc keeps its folder
    def refused(cmd):
        said = "wandb: ERROR run lab/openlab-moe/abc was previously created and deleted; try a new run name\n"
        return subprocess.CompletedProcess(cmd, 0, stdout="Syncing 1 run(s):\n", stderr=said)

    def stuck(cmd):  # an upload that never ends: `_run`'s timeout, as subprocess.run raises it
        raise subprocess.TimeoutExpired(cmd, 3600)

    with pytest.raises(WandbLinkError, match="wandb sync did not finish within 3600 s; run it again"):
        sync_offline_runs(store, runner=stuck, environ={"WANDB_API_KEY": "k"})
    with pytest.raises(WandbLinkError, match="was previously created and deleted; try a new run name"):
        sync_offline_runs(store, runner=refused, environ={"WANDB_API_KEY": "k"})
    assert store.list(WandbRun)[0].mode == "offline"
    assert not any(is_synced(d) for d in find_run_dirs(out)), "no mark wandb did not write"
