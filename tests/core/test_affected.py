"""`lineage affected`: what a bad node touched, from the jobs that ran there down to the runs."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from orchestrator.errors import ConfigError
from orchestrator.lineage import Artifact, Attempt, LineageStore, PipelineRun, StageRun, WandbRun, utcnow
from orchestrator.lineage.affected import affected
from orchestrator.lineage.listing import RecordFilter, list_records

T0 = utcnow() - dt.timedelta(days=3)


def _at(hours: float) -> dt.datetime:
    return T0 + dt.timedelta(hours=hours)


def _history(store: LineageStore) -> dict[str, Any]:
    """A pretrain whose first attempt ran on n17 (the bad node) and whose retry finished on n18; a
    midtrain made from its checkpoint; a later run that reused it; a stage that read the same
    checkpoint content before the bad job existed; a run that never touched n17."""
    with store.transaction() as tx:
        early_run = tx.add(PipelineRun(recipe="r", replica="tiny", backend="slurm", started_at=_at(0)))
        run = tx.add(PipelineRun(recipe="r", replica="tiny", backend="slurm", started_at=_at(10)))
        later = tx.add(PipelineRun(recipe="r", replica="tiny", backend="slurm", started_at=_at(20)))
        clean = tx.add(PipelineRun(recipe="r", replica="small", backend="slurm", started_at=_at(30)))

        def stage(owner: PipelineRun, name: str, hours: float, **kw: Any) -> StageRun:
            return tx.add(
                StageRun(pipeline_run_id=owner.id, stage=name, identity=f"{name}-{hours}", started_at=_at(hours), **kw)
            )

        def job(srun: StageRun, hours: float, host: str, number: int = 1, state: str = "COMPLETED") -> Attempt:
            kw = {"backend": "slurm", "cluster": "west", "host": host, "state": state}
            return tx.add(
                Attempt(stage_run_id=srun.id, number=number, job_id=f"{number}{hours}", submitted_at=_at(hours), **kw)
            )

        early = stage(early_run, "eval", 1)
        pre = stage(run, "pretrain", 10)
        job(pre, 10, "n17", state="FAILED")
        job(pre, 11, "n18", number=2)  # resumed from what the first attempt wrote on n17
        ckpt = tx.add(Artifact(name="pretrain/out", artifact_type="folder", uri="/ckpt/pre", content_hash="c" * 64))
        tx.relate("wasGeneratedBy", ckpt, pre)
        tx.relate("used", early, ckpt, role="checkpoint")  # the same content, read before the bad job ran
        mid = stage(run, "midtrain", 12)
        job(mid, 12, "n18")
        tx.relate("used", mid, ckpt, role="checkpoint")
        mid_out = tx.add(  # gc has since removed it: no file left to distrust, and the list says so
            Artifact(
                name="midtrain/out",
                artifact_type="folder",
                uri="/ckpt/mid",
                content_hash="d" * 64,
                removed_at=dt.datetime(2026, 11, 30, tzinfo=dt.UTC),
                removed_reason="openlab gc by ada@vm",
            )
        )
        tx.relate("wasGeneratedBy", mid_out, mid)
        reused = stage(later, "pretrain", 20, state="REUSED", reused_from=pre.id)
        tx.relate("wasInformedBy", reused, pre, role="reused")  # as a run records a reuse
        other = stage(clean, "pretrain", 30)
        job(other, 30, "n[18-19]")
        charts = tx.add(  # the midtrain's W&B run: its loss curve was drawn from a bad checkpoint
            WandbRun(id="lab/moe/mid1", run_id="mid1", project="moe", url="https://wandb.ai/lab/moe/runs/mid1")
        )
        tx.relate("wasAssociatedWith", mid, charts)
        clean_charts = tx.add(WandbRun(id="lab/moe/pre9", run_id="pre9", project="moe", state="finished"))
        tx.relate("wasAssociatedWith", other, clean_charts)
    return {k: v.id for k, v in locals().items() if isinstance(v, PipelineRun | StageRun | Artifact | WandbRun)}


def test_what_a_bad_node_touched_is_every_output_made_from_its_jobs_and_the_runs_that_used_them(
    store: LineageStore,
) -> None:
    h = _history(store)
    report = affected(store, RecordFilter.from_options(host="n17"))
    assert [t.record.id for t in report.made_there] == [h["pre"]]
    assert "ran on n17 of west" in report.made_there[0].why and "FAILED" in report.made_there[0].why
    assert [t.record.id for t in report.outputs] == [h["ckpt"], h["mid_out"]]
    assert {t.record.id: t.why for t in report.stage_runs} == {
        h["mid"]: f"used {h['ckpt']}",
        h["reused"]: f"reused {h['pre']}",  # a later run took the checkpoint as it was
    }
    # the run that read the same checkpoint content before the bad job was submitted is not affected
    assert {t.record.id for t in report.pipeline_runs} == {h["run"], h["later"]}
    # redone with what came from there forced: their identities are unchanged, a plain rerun would reuse them
    assert report.rerun_command(h["run"]) == f"openlab rerun {h['run']} --force-stage pretrain --force-stage midtrain"
    assert report.rerun_command(h["later"]) == f"openlab rerun {h['later']} --force-stage pretrain"
    # the charts people compared against: the W&B runs those stages logged to, not the clean run's
    assert [(t.record.id, t.why) for t in report.wandb_runs] == [(h["charts"], f"logged by midtrain {h['mid']}")]
    assert affected(store, RecordFilter.from_options(host="n19")).made_there[0].record.id == h["other"]
    assert affected(store, RecordFilter.from_options(host="n17", since="1h")).made_there == []


def test_the_command(run_cli, openlab_home) -> None:
    from orchestrator.lineage import open_store

    with open_store() as store:
        h = _history(store)
    shown = run_cli("lineage", "affected", "--host", "n17", env={"COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    assert f"  {h['ckpt']}  pretrain/out /ckpt/pre  (made by {h['pre']})\n" in shown.stdout, shown.stdout
    assert f"  {h['mid_out']}  midtrain/out /ckpt/mid  (made by {h['mid']}; removed 2026-11-30)" in shown.stdout
    assert "pipeline runs affected (2), each with the command that redoes it:" in shown.stdout
    assert f"\n    openlab rerun {h['later']} --force-stage pretrain\n" in shown.stdout, shown.stdout
    assert f"W&B runs logged by them (1):\n  https://wandb.ai/lab/moe/runs/mid1  (logged by midtrain {h['mid']})" in (
        shown.stdout
    )
    data = json.loads(run_cli("lineage", "affected", "--cluster", "west", "--json").stdout)
    assert {o["id"] for o in data["outputs"]} == {h["ckpt"], h["mid_out"]}
    assert {r["id"]: r["rerun"] for r in data["pipeline_runs"]}[
        h["later"]
    ] == f"openlab rerun {h['later']} --force-stage pretrain"
    # a host no job ever ran on is a typo (n177 for n17), not "nothing to distrust": one line, the hosts known
    nowhere = run_cli("lineage", "affected", "--host", "n177")
    assert nowhere.returncode == 2 and nowhere.stdout == "", nowhere.stdout
    assert nowhere.stderr.strip() == (
        "error: --host 'n177': no job in lineage ran on such a host; did you mean 'n17'? "
        "hosts jobs ran on: n17, n18, n19"
    ), nowhere.stderr
    # and so is a cluster no job ran on and none is configured as ("wset" for "west")
    typo = run_cli("lineage", "affected", "--cluster", "wset")
    assert typo.returncode == 2 and typo.stdout == "", typo.stdout
    assert typo.stderr.strip().startswith(
        "error: --cluster 'wset': no job in lineage ran on such a cluster; did you mean 'west'?"
    ), typo.stderr
    configured = run_cli("lineage", "affected", "--cluster", "east", env={"OPENLAB_BACKENDS__SLURM__CLUSTER": "east"})
    assert configured.returncode == 0, configured.stderr  # configured, no job there yet: an answer
    listed = run_cli("lineage", "list", "--host", "vn")
    assert listed.returncode == 2 and "--host 'vn': no job in lineage ran on such a host" in listed.stderr
    assert len(listed.stderr.strip().splitlines()) == 1, listed.stderr
    # a host jobs ran on, but not in that time: an answer, not an error
    not_then = run_cli("lineage", "affected", "--host", "n17", "--since", "1h")
    assert not_then.returncode == 0 and not_then.stdout.strip() == "no stage run had a job there in that time"
    unsaid = run_cli("lineage", "affected")
    assert unsaid.returncode == 2 and unsaid.stderr.strip() == (
        "error: say where: --host (a machine) or --cluster; see openlab lineage affected --help"
    )


def test_a_stage_reached_first_through_an_older_reader_is_still_followed(store: LineageStore) -> None:
    """Two jobs on the bad node: pretrain, then an eval of its checkpoint. A stage run that read
    the same checkpoint content before the bad job (``old``) is left out, and so is what it made;
    but a stage that used ``old``'s output *and* the bad eval's (``report``) is affected through
    the eval, however the walk met it first."""
    with store.transaction() as tx:
        run = tx.add(PipelineRun(recipe="r", replica="tiny", backend="slurm", started_at=_at(10)))

        def stage(name: str, hours: float) -> StageRun:
            return tx.add(StageRun(pipeline_run_id=run.id, stage=name, identity=name, started_at=_at(hours)))

        def output(srun: StageRun, name: str) -> Artifact:
            art = tx.add(Artifact(name=name, uri=f"/{name}", content_hash=name * 8))
            tx.relate("wasGeneratedBy", art, srun)
            return art

        pre = stage("pretrain", 10)
        tx.add(Attempt(stage_run_id=pre.id, backend="slurm", job_id="1", host="n17", submitted_at=_at(10)))
        ckpt = output(pre, "ckpt")
        old = stage("old-eval", 5)  # read the same checkpoint content before the bad job existed
        tx.relate("used", old, ckpt)  # met first: its relation is older
        old_out = output(old, "oldscores")
        bad_eval = stage("eval", 11)
        tx.add(Attempt(stage_run_id=bad_eval.id, backend="slurm", job_id="2", host="n17", submitted_at=_at(11)))
        tx.relate("used", bad_eval, ckpt)
        scores = output(bad_eval, "scores")
        report = stage("report", 12)
        tx.relate("used", report, old_out)
        tx.relate("used", report, scores)
    found = affected(store, RecordFilter.from_options(host="n17"))
    assert [t.record.id for t in found.made_there] == [pre.id, bad_eval.id]
    assert {t.record.id for t in found.stage_runs} == {report.id}, "the report used the bad eval's scores"
    assert old.id not in {t.record.id for t in found.stage_runs} and old_out.id not in {
        t.record.id for t in found.outputs
    }


def test_lists_longer_than_one_in_list_are_read_in_parts(store: LineageStore, monkeypatch) -> None:
    """A bad cluster's jobs over a year are more ids than one ``IN (...)`` takes (PostgreSQL: 65,535
    parameters). Read one id a list, the walk and the report are the same as in one list each."""
    import orchestrator.lineage.store as store_module
    from orchestrator.lineage.trace import trace

    h = _history(store)
    whole = affected(store, RecordFilter.from_options(cluster="west")).to_dict()
    up = trace(store, h["mid_out"], direction="up").to_dict()
    monkeypatch.setattr(store_module, "IN_CHUNK", 1)
    assert affected(store, RecordFilter.from_options(cluster="west")).to_dict() == whole
    assert trace(store, h["mid_out"], direction="up").to_dict() == up
    assert len(whole["made_there"]) == 3 and len(whole["wandb_runs"]) == 2, whole  # the chunks had work to do


@pytest.mark.parametrize("store", ["postgresql"], indirect=True)
def test_a_node_with_more_jobs_than_postgresql_binds_is_still_listed(store: LineageStore) -> None:
    """PostgreSQL takes at most 65,535 bound parameters a statement; `--host n17` once bound one
    per job that ran there, and failed for a node with more (a year of a busy cluster)."""
    import sqlalchemy as sa

    now = utcnow()
    rows = [
        {
            "id": f"att_{i:020d}",
            "number": 1,
            "backend": "slurm",
            "state": "COMPLETED",
            "host": "n17",
            "submitted_at": now,
        }
        for i in range(66_000)
    ]
    with store.engine.begin() as conn:  # bulk, not through the event chain: this is about the query
        conn.execute(sa.insert(Attempt.__table__), rows)  # type: ignore[attr-defined]
    found = list_records(store, ["attempt"], RecordFilter.from_options(host="n17"), limit=None, strict=True)
    assert len(found.records) == 66_000
    assert affected(store, RecordFilter.from_options(host="n17")).made_there == []  # no stage runs behind them


def test_a_host_is_named_as_dns_names_it_whatever_the_case_and_by_its_short_name(store: LineageStore) -> None:
    """``--host N17`` is n17, and ``--host gpu3`` is the machine a local job recorded by its full name
    (``os.uname().nodename``): a person types the name ``squeue`` or their monitoring shows them."""
    h = _history(store)
    with store.transaction() as tx:
        srun = tx.add(StageRun(stage="eval", identity="e-fq", started_at=_at(40)))
        tx.add(Attempt(stage_run_id=srun.id, number=1, backend="local", host="gpu3.West.Lab", submitted_at=_at(40)))
    by_case = affected(store, RecordFilter.from_options(host="N17"))
    assert [t.record.id for t in by_case.made_there] == [h["pre"]]
    by_full_name = affected(store, RecordFilter.from_options(host="n17.west.lab"))  # NodeList says n17
    assert [t.record.id for t in by_full_name.made_there] == [h["pre"]]
    for name in ("gpu3", "GPU3", "gpu3.west.lab"):
        there = affected(store, RecordFilter.from_options(host=name)).made_there
        assert [t.record.id for t in there] == [srun.id], name
    for name in ("gpu", "gpu3.east.lab"):  # a prefix is not a name, nor is another domain's machine
        with pytest.raises(ConfigError, match="no job in lineage ran on such a host"):
            list_records(store, ["attempt"], RecordFilter.from_options(host=name))
