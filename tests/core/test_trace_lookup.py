"""What `lineage show`, `trace` and `diff` take to name a record, and where a trace from a job goes.

People start an audit from what they have in hand: the job id the run summary, `squeue` or `docker
ps` printed, a job's log file, a short commit sha, the W&B run's path, an issue number, a file. The
store's lookup (:meth:`LineageStore.find`) is checked on real SQLite and PostgreSQL (the `store`
fixture), on records built directly; the command, as a subprocess, for what a user types and reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.errors import NotFoundError
from orchestrator.lineage import (
    Artifact,
    Attempt,
    Commit,
    DataSnapshot,
    GithubIssue,
    LineageStore,
    PipelineRun,
    StageRun,
    WandbRun,
)
from orchestrator.lineage.trace import TraceNode, describe, trace

SHA = "5d723e1" + "0" * 33  # recorded from a clean tree and from a dirty one
ONLY_DIRTY = "7e8f9a0" + "1" * 33  # recorded only from dirty trees, two of them
RUN_ID = "67316d5f2916853f"  # a W&B run recorded offline: its entity is unknown
LOCAL_JOB = "local-5f21cecd4c23"


@dataclass
class Lab:
    run: PipelineRun
    pre: StageRun
    first: Attempt  # slurm job 4711 on cluster east, failed
    second: Attempt  # the local job that completed it, with its log file
    west: Attempt  # slurm job 4711 on cluster west: another job of the same number
    clean: Commit
    dirty: Commit
    dirty_run: PipelineRun
    only_dirty: list[Commit]
    only_dirty_runs: list[PipelineRun]
    data: DataSnapshot
    out: Artifact
    wandb: WandbRun
    log: Path


def _lab(store: LineageStore, tmp_path: Path) -> Lab:
    """A pretrain stage run twice (a failed Slurm job, then a local one), at a commit recorded clean
    and dirty, on a snapshot, logging to a W&B run, for an issue; another run on cluster west."""
    log = tmp_path / "logs" / f"{LOCAL_JOB}.log"
    log.parent.mkdir(parents=True)
    log.write_text("step 1/1\n")
    with store.transaction() as tx:
        clean = tx.add(Commit(id=SHA, sha=SHA, branch="main", message="pretrain: warmup"))
        dirty = tx.add(Commit(id=f"{SHA}+6c543c33aaaaaaaa", sha=SHA, dirty=True, patch_hash="6c543c33" + "a" * 56))
        run = tx.add(PipelineRun(recipe="marin", replica="tiny", backend="slurm", state="COMPLETED"))
        pre = tx.add(StageRun(pipeline_run_id=run.id, stage="pretrain", identity="i-pre", state="COMPLETED"))
        first = tx.add(
            Attempt(stage_run_id=pre.id, backend="slurm", cluster="east", job_id="4711", state="FAILED", host="n17")
        )
        second = tx.add(
            Attempt(
                stage_run_id=pre.id,
                number=2,
                backend="local",
                cluster="box",
                job_id=LOCAL_JOB,
                state="COMPLETED",
                log_path=str(log),
            )
        )
        data = tx.add(DataSnapshot(id="d" * 64, path="/data/tokens", files=3, bytes=30, manifest_path="/m.json"))
        out = tx.add(Artifact(name="pretrain/out", uri="/runs/pretrain/out", content_hash="c" * 64))
        wandb = tx.add(WandbRun(id=f"/openlab-replicas/{RUN_ID}", run_id=RUN_ID, project="openlab-replicas"))
        issue = tx.add(GithubIssue(id="lab/exp#42", repo="lab/exp", number=42))
        tx.relate("wasAssociatedWith", run, clean, role="code")
        tx.relate("wasAssociatedWith", run, issue)
        tx.relate("wasAssociatedWith", pre, clean, role="code")
        tx.relate("used", pre, data, role="tokens")
        tx.relate("wasGeneratedBy", out, pre, role="out")
        tx.relate("wasAssociatedWith", pre, wandb)
        dirty_run = tx.add(PipelineRun(recipe="marin", replica="tiny", backend="local", state="COMPLETED"))
        tx.relate("wasAssociatedWith", dirty_run, dirty, role="code")
        other = tx.add(PipelineRun(recipe="marin", replica="small", backend="slurm", state="RUNNING"))
        other_pre = tx.add(StageRun(pipeline_run_id=other.id, stage="pretrain", identity="i-west", state="RUNNING"))
        west = tx.add(Attempt(stage_run_id=other_pre.id, backend="slurm", cluster="west", job_id="4711"))
        only_dirty, only_dirty_runs = [], []
        for patch in ("1111111111111111", "2222222222222222"):
            tree = tx.add(Commit(id=f"{ONLY_DIRTY}+{patch}", sha=ONLY_DIRTY, dirty=True, patch_hash=patch * 4))
            made = tx.add(PipelineRun(recipe="llama", replica="tiny", backend="local", state="FAILED"))
            tx.relate("wasAssociatedWith", made, tree, role="code")
            only_dirty.append(tree)
            only_dirty_runs.append(made)
    return Lab(
        run, pre, first, second, west, clean, dirty, dirty_run, only_dirty, only_dirty_runs, data, out, wandb, log
    )


def _ids(node: TraceNode) -> set[str]:
    return {n.id for n in node.walk()}


def _under(node: TraceNode, record_id: str) -> TraceNode:
    return next(n for n in node.walk() if n.id == record_id and not n.repeated)


# -- 1. a trace from a job goes through the stage run it ran ------------------------------------------


def test_tracing_up_from_a_job_is_its_stage_runs_trace_with_the_job_shown(store: LineageStore, tmp_path: Path) -> None:
    """`lineage trace att_…` printed the attempt alone (JSON `"children": []`): an attempt leads up
    to the stage run it ran, and from there to everything the stage run came from."""
    lab = _lab(store, tmp_path)
    from_job = trace(store, lab.second.id)
    assert (from_job.kind, from_job.id) == ("attempt", lab.second.id)
    assert [(c.relation, c.role, c.id) for c in from_job.children] == [("jobOf", "stage", lab.pre.id)]
    from_stage = trace(store, lab.pre.id)
    assert _ids(from_job) == _ids(from_stage)  # the same answer as tracing the stage run
    assert {lab.clean.id, lab.data.id, lab.wandb.id, "lab/exp#42", lab.run.id, lab.first.id} <= _ids(from_job)
    stage = _under(from_job, lab.pre.id)
    # the stage run's jobs: the other one in full, this one pointing back at the top of the tree
    jobs = [(c.id, c.repeated) for c in stage.children if c.kind == "attempt"]
    assert jobs == [(lab.first.id, False), (lab.second.id, True)]
    # a job reached from its stage run does not point back at it (a line per job of every trace)
    assert all(not c.children for c in from_stage.children if c.kind == "attempt")
    assert from_job.to_dict()["children"][0]["id"] == lab.pre.id
    # --depth 1 from a stage run: its jobs are leaves with nothing more above them
    shallow = trace(store, lab.pre.id, depth=1)
    assert [c.truncated for c in shallow.children if c.kind == "attempt"] == [False, False]


def test_tracing_down_from_a_job_reaches_what_its_stage_run_made(store: LineageStore, tmp_path: Path) -> None:
    lab = _lab(store, tmp_path)
    down = trace(store, lab.first.id, direction="down")
    assert [(c.relation, c.id) for c in down.children] == [("jobOf", lab.pre.id)]
    assert lab.out.id in _ids(down)


def test_a_jobs_log_file_traces_like_the_job(store: LineageStore, tmp_path: Path) -> None:
    """README: trace takes a job's log file; it found the attempt and stopped there."""
    lab = _lab(store, tmp_path)
    from_log = trace(store, str(lab.log))
    assert from_log.id == lab.second.id
    assert {lab.pre.id, lab.clean.id, lab.data.id, lab.run.id} <= _ids(from_log)


# -- 2. a backend job id names its attempt ------------------------------------------------------------


def test_a_backend_job_id_finds_its_attempt(store: LineageStore, tmp_path: Path) -> None:
    """The run summary prints `job local-5f21cecd4c23 on vm`; `lineage show` said it names nothing."""
    lab = _lab(store, tmp_path)
    assert store.find(LOCAL_JOB).id == lab.second.id
    assert store.find(f"attempt:{LOCAL_JOB}").id == lab.second.id
    assert store.find_job(LOCAL_JOB).id == lab.second.id
    assert store.find_job("no-such-job") is None
    assert trace(store, LOCAL_JOB).children[0].id == lab.pre.id


def test_a_job_id_on_two_clusters_is_refused_naming_each(store: LineageStore, tmp_path: Path) -> None:
    """Slurm numbers jobs per cluster: job 4711 on east and on west are two jobs, and picking one
    would answer for the other."""
    lab = _lab(store, tmp_path)
    with pytest.raises(NotFoundError) as refused:
        store.find("4711")
    message = str(refused.value)
    assert "\n" not in message and "more characters" not in message
    assert f"{lab.first.id} (slurm job on cluster 'east'" in message, message
    assert f"{lab.west.id} (slurm job on cluster 'west'" in message, message
    assert "give the attempt id" in message
    with pytest.raises(NotFoundError, match="east"):
        store.find_job("4711", backend="slurm")


def test_a_job_recorded_twice_for_one_stage_run_is_its_last_attempt(store: LineageStore) -> None:
    """One job id recorded twice on one cluster for one stage run is that job (a requeued job): its
    last attempt. For two stage runs it is two jobs (ids start again after a controller's state is
    lost), and refused."""
    with store.transaction() as tx:
        stage = tx.add(StageRun(stage="pretrain", identity="i-requeue"))
        first = tx.add(Attempt(stage_run_id=stage.id, backend="slurm", cluster="east", job_id="9001"))
        last = tx.add(Attempt(stage_run_id=stage.id, number=2, backend="slurm", cluster="east", job_id="9001"))
    assert store.find("9001").id == last.id != first.id
    with store.transaction() as tx:
        later = tx.add(StageRun(stage="eval", identity="i-reused-number"))
        again = tx.add(Attempt(stage_run_id=later.id, backend="slurm", cluster="east", job_id="9001"))
    with pytest.raises(NotFoundError, match=rf"{again.id} \(slurm job on cluster 'east', stage eval"):
        store.find("9001")


# -- 3. a commit sha is the commit, every tree of it ----------------------------------------------------


def test_a_short_sha_is_the_commit_not_an_ambiguous_prefix(store: LineageStore, tmp_path: Path) -> None:
    """`trace 5d723e1 --down` said the prefix is ambiguous between `5d723e1…` and `5d723e1…+6c543c33…`,
    and more characters could not help: the full sha still matched both."""
    lab = _lab(store, tmp_path)
    assert store.find(SHA[:7]).id == lab.clean.id
    assert store.find(SHA).id == lab.clean.id
    assert store.find(lab.dirty.id).id == lab.dirty.id  # a tree given whole is that tree
    assert store.find(f"commit:{SHA[:7]}").id == lab.clean.id


def test_down_from_a_commit_covers_its_dirty_trees(store: LineageStore, tmp_path: Path) -> None:
    """`trace SHA --down` showed only the clean tree's run: "what was made at this commit" is every
    run at it, the dirty trees' under their tree, marked dirty."""
    lab = _lab(store, tmp_path)
    for asked in (SHA[:7], SHA):
        down = trace(store, asked, direction="down")
        assert down.id == SHA
        assert {lab.run.id, lab.pre.id, lab.dirty_run.id} <= _ids(down), asked
        tree = next(c for c in down.children if c.id == lab.dirty.id)
        assert (tree.relation, tree.role) == ("wasDerivedFrom", "dirty")
        assert describe(tree.record).startswith("dirty")
        assert [c.id for c in tree.children] == [lab.dirty_run.id]
    just_the_tree = trace(store, lab.dirty.id, direction="down")
    assert _ids(just_the_tree) == {lab.dirty.id, lab.dirty_run.id}  # an exact sha+patch id: that tree only
    assert lab.dirty.id not in _ids(trace(store, SHA[:7]))  # up from a commit: nothing it came from


def test_a_commit_recorded_only_from_dirty_trees(store: LineageStore, tmp_path: Path) -> None:
    """No clean tree to stand for the sha: `show` says which trees there are (more characters of the
    sha would not choose one), `trace --down` covers them all."""
    lab = _lab(store, tmp_path)
    for asked in (ONLY_DIRTY[:7], ONLY_DIRTY):
        with pytest.raises(NotFoundError) as refused:
            store.find(asked)
        message = str(refused.value)
        assert "more characters" not in message and "\n" not in message
        assert all(tree.id in message for tree in lab.only_dirty), message
        assert f"openlab lineage trace {ONLY_DIRTY[:12]} --down" in message, message
        down = trace(store, asked, direction="down")
        assert (down.kind, down.id) == ("commit", ONLY_DIRTY)
        assert "uncommitted changes" in describe(down.record)
        assert [(c.relation, c.id) for c in down.children] == [("wasDerivedFrom", t.id) for t in lab.only_dirty]
        assert {r.id for r in lab.only_dirty_runs} <= _ids(down)
    with store.transaction() as tx:  # a second sha of the same start: now more characters do help
        tx.add(Commit(id=ONLY_DIRTY[:7] + "f" * 33, sha=ONLY_DIRTY[:7] + "f" * 33))
    with pytest.raises(NotFoundError, match="ambiguous.*give more characters"):
        store.find(ONLY_DIRTY[:7])


# -- 4. a W&B run by the names W&B gives it ------------------------------------------------------------


def test_a_wandb_run_is_found_by_its_wandb_names(store: LineageStore, tmp_path: Path) -> None:
    """An offline run is keyed `/project/run_id` (no entity): its W&B path `project/run_id` and an
    8-character prefix of its run id found nothing."""
    lab = _lab(store, tmp_path)
    for asked in (
        f"openlab-replicas/{RUN_ID}",
        RUN_ID,
        RUN_ID[:8],
        RUN_ID[:6],
        f"/openlab-replicas/{RUN_ID}",
        f"lab/openlab-replicas/{RUN_ID}",  # the entity it was synced to, which the record never learnt
        f"https://wandb.ai/lab/openlab-replicas/runs/{RUN_ID}",
        f"wandb_run:{RUN_ID[:8]}",
    ):
        assert store.find(asked).id == lab.wandb.id, asked
    with pytest.raises(NotFoundError, match="at least 6 characters"):
        store.find(RUN_ID[:5])
    with pytest.raises(NotFoundError, match="^no lineage record"):
        store.find(f"other-project/{RUN_ID}")


def test_one_run_id_in_two_projects_asks_for_the_project(store: LineageStore, tmp_path: Path) -> None:
    lab = _lab(store, tmp_path)
    with store.transaction() as tx:
        twin = tx.add(WandbRun(id=f"lab/ablations/{RUN_ID}", run_id=RUN_ID, project="ablations", entity="lab"))
    for asked in (RUN_ID, RUN_ID[:8]):
        with pytest.raises(NotFoundError) as refused:
            store.find(asked)
        message = str(refused.value)
        assert lab.wandb.id in message and twin.id in message, message
        assert "project/run_id" in message and "more characters" not in message, message
    assert store.find(f"openlab-replicas/{RUN_ID}").id == lab.wandb.id
    assert store.find(f"ablations/{RUN_ID}").id == twin.id
    assert store.find(f"lab/ablations/{RUN_ID}").id == twin.id


# -- 5. a path that is no output, an issue reference ---------------------------------------------------


def test_a_file_nothing_was_recorded_at_points_to_which(store: LineageStore, tmp_path: Path) -> None:
    copy = tmp_path / "copy.pt"
    copy.write_bytes(b"weights")
    with pytest.raises(NotFoundError) as refused:
        store.find(str(copy))
    message = str(refused.value)
    assert "not a recorded output" in message and f"openlab lineage which {copy}" in message, message
    assert "6 characters" not in message


def test_an_issue_is_looked_up_as_an_issue(store: LineageStore, tmp_path: Path) -> None:
    """`show '#42'` said an id prefix needs 6 characters."""
    _lab(store, tmp_path)
    for asked in ("#42", "lab/exp#42", "https://github.com/lab/exp/issues/42", "github_issue:#42"):
        assert store.find(asked).id == "lab/exp#42", asked
    with pytest.raises(NotFoundError, match=r"^no issue #43 in lineage"):
        store.find("#43")
    with pytest.raises(NotFoundError, match=r"^no issue lab/exp#4 in lineage"):
        store.find("lab/exp#4")  # not a prefix of lab/exp#42: another issue
    for malformed in ("#", "#x1", "lab#42", "42#"):
        with pytest.raises(NotFoundError, match=r"owner/repo#N or #N"):
            store.find(malformed)
    with store.transaction() as tx:
        tx.add(GithubIssue(id="lab/other#42", repo="lab/other", number=42))
    with pytest.raises(NotFoundError, match=r"#42 is an issue in 2 repositories: lab/exp#42, lab/other#42"):
        store.find("#42")


def test_an_id_prefix_is_still_refused_below_six_characters(store: LineageStore, tmp_path: Path) -> None:
    lab = _lab(store, tmp_path)
    assert store.find(lab.run.id[:10]).id == lab.run.id
    with pytest.raises(NotFoundError, match="an id prefix needs at least 6 characters"):
        store.find(lab.run.id[:4])
    with store.transaction() as tx:
        for n in (1, 2):
            tx.add(PipelineRun(id=f"prun_abcdef{n}", recipe="marin"))
    with pytest.raises(NotFoundError, match=r"is ambiguous \(prun_abcdef1, prun_abcdef2\): give more characters"):
        store.find("prun_abcdef")  # more characters do tell these apart


# -- the commands ----------------------------------------------------------------------------------------


def test_the_commands_take_what_a_user_has_in_hand(run_cli, openlab_home: Path, tmp_path: Path) -> None:
    """The store's lookup is what `show`, `trace` and `diff` use (checked above on both databases);
    here, what a user types and reads: a refusal is one line."""
    from orchestrator.lineage import open_store

    with open_store() as store:
        lab = _lab(store, tmp_path)
    traced = run_cli("lineage", "trace", lab.second.id, "--json")
    assert traced.returncode == 0, traced.stderr
    assert [c["id"] for c in json.loads(traced.stdout)["children"]] == [lab.pre.id]
    shown = run_cli("lineage", "show", LOCAL_JOB, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["record"]["id"] == lab.second.id
    both = run_cli("lineage", "show", "4711")
    assert both.returncode == 2 and len(both.stderr.strip().splitlines()) == 1, both.stderr
    assert "'east'" in both.stderr and "'west'" in both.stderr, both.stderr
    made = run_cli("lineage", "trace", SHA[:7], "--down")
    assert made.returncode == 0, made.stderr
    assert f"wasDerivedFrom (dirty) commit {lab.dirty.id} dirty" in made.stdout, made.stdout
    assert lab.dirty_run.id in made.stdout and lab.run.id in made.stdout, made.stdout
    copy = tmp_path / "copy.pt"
    copy.write_bytes(b"weights")
    stray = run_cli("lineage", "show", str(copy))
    assert stray.returncode == 2 and f"openlab lineage which {copy}" in stray.stderr, stray.stderr
