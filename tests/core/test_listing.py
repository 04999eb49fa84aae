"""`openlab lineage list` filters: the audit questions people ask of a store with many runs.

The library is checked on real SQLite and PostgreSQL (the `store` fixture); the command as a
subprocess, on the same records, for what a user types and reads.
"""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest

from orchestrator.errors import ConfigError
from orchestrator.lineage import (
    Attempt,
    Commit,
    DataSnapshot,
    GithubIssue,
    LineageStore,
    PipelineRun,
    StageRun,
    utcnow,
)
from orchestrator.lineage.listing import RecordFilter, list_records, parse_when

NOW = utcnow()
OLD = NOW - dt.timedelta(days=10)


def _history(store: LineageStore) -> dict[str, str]:
    """Two recipes' runs on two backends, ten days apart; one failed pretrain job in each week."""
    ids: dict[str, str] = {}
    with store.transaction() as tx:
        old = tx.add(
            PipelineRun(
                recipe="marin",
                replica="tiny",
                backend="local",
                state="FAILED",
                started_at=OLD,
                user="ada",
                trigger="terminal",
            )
        )
        old_pre = tx.add(
            StageRun(pipeline_run_id=old.id, stage="pretrain", identity="i1", state="FAILED", started_at=OLD)
        )
        old_job = tx.add(
            Attempt(
                stage_run_id=old_pre.id,
                backend="local",
                job_id="101",
                state="FAILED",
                submitted_at=OLD,
                host="n[01-03]",  # a job on three nodes records Slurm's NodeList
                cluster="west",
                user="ada",
            )
        )
        new = tx.add(
            PipelineRun(
                recipe="marin",
                replica="drops",
                backend="slurm",
                state="FAILED",
                started_at=NOW,
                user="bob",
                trigger="schedule",
                params={"sweep": {"id": "swp_" + "1" * 20, "run": 1, "of": 2}},
            )
        )
        new_data = tx.add(
            StageRun(pipeline_run_id=new.id, stage="data", identity="i2", state="COMPLETED", started_at=NOW)
        )
        new_pre = tx.add(
            StageRun(pipeline_run_id=new.id, stage="pretrain", identity="i3", state="FAILED", started_at=NOW)
        )
        retry1 = tx.add(
            Attempt(
                stage_run_id=new_pre.id,
                backend="slurm",
                job_id="7",
                state="FAILED",
                submitted_at=NOW - dt.timedelta(minutes=5),
                host="gpu1",
                tasks={"0": {"state": "FAILED", "host": "gpu1"}, "1": {"state": "FAILED", "host": "n02"}},
                cluster="east",
                user="bob",
            )
        )
        retry2 = tx.add(
            Attempt(
                stage_run_id=new_pre.id,
                number=2,
                backend="slurm",
                job_id="8",
                state="FAILED",
                submitted_at=NOW,
                host="n20",
                cluster="east",
                user="svc",  # resubmitted by the account serving the flows
            )
        )
        other = tx.add(
            PipelineRun(
                recipe="llama",
                replica="tiny",
                backend="local",
                state="COMPLETED",
                started_at=NOW - dt.timedelta(hours=1),
                params={"sweep": {"id": "swp_" + "2" * 20, "run": 1, "of": 1}},
            )
        )
        snap = tx.add(DataSnapshot(id="snap_" + "a" * 20, path="/data", files=1, bytes=1, manifest_path="/m.json"))
        at_a = tx.add(Commit(id="a1b2c3d" + "0" * 33, sha="a1b2c3d" + "0" * 33))
        at_b = tx.add(Commit(id="b1b2c3d" + "0" * 33, sha="b1b2c3d" + "0" * 33))
        tx.relate("wasAssociatedWith", old, at_a, role="code")
        tx.relate("wasAssociatedWith", new, at_b, role="code")
        tx.relate("wasAssociatedWith", other, at_b, role="code")
        issue = tx.add(GithubIssue(id="lab/exp#42", repo="lab/exp", number=42))
        tx.relate("wasAssociatedWith", new, issue)
    for name, rec in locals().items():
        if isinstance(rec, PipelineRun | StageRun | Attempt | DataSnapshot):
            ids[name] = rec.id
    return ids


def _ids(store: LineageStore, kinds: list[str], **flt: object) -> set[str]:
    return {r.id for r in list_records(store, kinds, RecordFilter(**flt), limit=100).records}  # type: ignore[arg-type]


KINDS = ["pipeline_run", "stage_run", "attempt", "snapshot"]


def test_user_filter_is_who_started_a_run_and_who_submitted_a_job(store: LineageStore) -> None:
    """`--user` (squeue's -u): a run and its stage runs by the account that started it, a job by
    the one that submitted it, which for a resubmission may be another."""
    h = _history(store)
    assert _ids(store, KINDS, user="ada") == {h["old"], h["old_pre"], h["old_job"]}
    assert _ids(store, KINDS, user="bob") == {h["new"], h["new_data"], h["new_pre"], h["retry1"]}
    assert _ids(store, ["attempt"], user="svc", stage=("pretrain",)) == {h["retry2"]}
    # an account that never started a run nor submitted a job is refused with the one meant, not an
    # empty list that reads as "she ran nothing"; one that matches nothing of a kind is no error
    with pytest.raises(ConfigError, match=r"--user 'ada ': no run or job in lineage is that account's"):
        _ids(store, KINDS, user="ada ")
    with pytest.raises(ConfigError, match=r"--user 'bbo': .*did you mean 'bob'"):
        _ids(store, KINDS, user="bbo")
    assert _ids(store, ["attempt"], user="ada", stage=("midtrain",)) == set()
    # --trigger: what the schedule started (the nightlies), through the run for stage runs and jobs
    nightly = {h["new"], h["new_data"], h["new_pre"], h["retry1"], h["retry2"]}
    assert _ids(store, KINDS, trigger="schedule") == nightly
    assert _ids(store, ["attempt"], trigger="terminal") == {h["old_job"]}
    with pytest.raises(ConfigError, match="--trigger 'shedule': not a trigger; did you mean 'schedule'"):
        RecordFilter.from_options(trigger="shedule")
    with pytest.raises(ConfigError, match="--user cannot be answered by snapshot records"):
        list_records(store, ["snapshot"], RecordFilter.from_options(user="ada"), strict=True)


def test_filters_reach_through_runs_on_both_databases(store: LineageStore) -> None:
    h = _history(store)
    # "which pretrain jobs failed": stage runs by their field, attempts through their stage run
    assert _ids(store, KINDS, stage=("pretrain",), state=("failed",)) == {
        h["old_pre"],
        h["new_pre"],
        h["old_job"],
        h["retry1"],
        h["retry2"],
    }
    # "this week": the ten-day-old failures drop out, and the state filter is case-blind
    week = NOW - dt.timedelta(days=7)
    assert _ids(store, KINDS, stage=("pretrain",), state=("FAILED",), since=week) == {
        h["new_pre"],
        h["retry1"],
        h["retry2"],
    }
    # a recipe reaches stage runs and attempts through their pipeline run
    assert _ids(store, ["stage_run", "attempt"], recipe="marin", replica="drops") == {
        h["new_data"],
        h["new_pre"],
        h["retry1"],
        h["retry2"],
    }
    # backend: the attempt's own, a stage run's pipeline run's
    assert _ids(store, KINDS, backend="slurm") == {h["new"], h["new_data"], h["new_pre"], h["retry1"], h["retry2"]}
    assert _ids(store, ["pipeline_run"], until=NOW - dt.timedelta(minutes=30)) == {h["old"], h["other"]}
    # "what ran at this commit", "every run of experiment #42": through the pipeline run's relations
    assert _ids(store, ["pipeline_run"], commit="b1b2c3d") == {h["new"], h["other"]}
    assert _ids(store, ["attempt"], commit="a1b2c3d") == {h["old_job"]}
    assert _ids(store, KINDS, issue="#42") == {h["new"], h["new_data"], h["new_pre"], h["retry1"], h["retry2"]}
    assert _ids(store, ["pipeline_run"], issue="lab/exp#42") == {h["new"]}
    assert _ids(store, ["pipeline_run"], issue="#4") == set()  # #4 is not #42
    # "what did node n02 (the bad GPU) touch": a node of a NodeList, or any task's host; the runs
    # and stage runs through their jobs; n2 is not n02, nor n20
    assert _ids(store, ["attempt"], host="n02") == {h["old_job"], h["retry1"]}
    assert _ids(store, ["stage_run"], host="n02") == {h["old_pre"], h["new_pre"]}
    assert _ids(store, ["pipeline_run"], host="n02") == {h["old"], h["new"]}
    assert _ids(store, ["attempt"], host="n20") == {h["retry2"]}
    # n2 is no host any job ran on: an error naming those there are, not an empty list ("nothing ran there")
    with pytest.raises(ConfigError) as typo:
        _ids(store, ["attempt"], host="n2")
    assert str(typo.value) == (  # every node of a NodeList, every task's host
        "--host 'n2': no job in lineage ran on such a host; did you mean 'n20'? "
        "hosts jobs ran on: gpu1, n01, n02, n03, n20"
    )
    assert _ids(store, ["attempt"], host="n02", since=NOW + dt.timedelta(days=1)) == set()  # known, not then
    assert _ids(store, ["attempt", "pipeline_run"], cluster="west") == {h["old_job"], h["old"]}
    assert _ids(store, ["attempt"], cluster="east", host="n20") == {h["retry2"]}
    # no filter: every kind, snapshots included
    assert h["snap"] in _ids(store, KINDS)


def test_a_sweeps_runs_their_stage_runs_and_jobs_on_both_databases(store: LineageStore) -> None:
    """`--sweep swp_…` (or a prefix): the runs that recorded that sweep, and through them their stage
    runs and jobs (what `lineage usage --sweep` sums: what a sweep cost); `%` and `_` match themselves."""
    h = _history(store)
    sweep = {h["new"], h["new_data"], h["new_pre"], h["retry1"], h["retry2"]}
    assert _ids(store, KINDS, sweep="swp_" + "1" * 20) == sweep
    assert _ids(store, ["pipeline_run"], sweep="swp_111") == {h["new"]}
    assert _ids(store, ["attempt"], sweep="swp_2") == set()  # the other sweep's run had no job
    assert _ids(store, KINDS, sweep="swp%") == set() and _ids(store, KINDS, sweep="swp_1_") == set()


def test_newest_first_across_kinds_with_the_count_before_the_limit(store: LineageStore) -> None:
    h = _history(store)
    listing = list_records(store, ["attempt"], RecordFilter(state=("FAILED",)), limit=2)
    assert [r.id for r in listing.records] == [h["retry2"], h["retry1"]]
    assert listing.matched == 3


def test_a_filter_no_kind_can_answer_is_an_error_not_an_empty_list(store: LineageStore) -> None:
    _history(store)
    with pytest.raises(ConfigError, match="--stage cannot be answered by snapshot.*stage_run"):
        list_records(store, ["snapshot"], RecordFilter(stage=("pretrain",)))
    # named kinds must each answer; the default kinds quietly leave out those that cannot
    with pytest.raises(ConfigError, match="snapshot"):
        list_records(store, ["stage_run", "snapshot"], RecordFilter(state=("FAILED",)), strict=True)
    with pytest.raises(ConfigError, match="unknown record kind 'bogus'"):
        list_records(store, ["bogus"])


def test_a_misspelt_stage_recipe_or_replica_is_an_error_naming_the_one_meant(store: LineageStore) -> None:
    """`--stage pretrian` listed nothing (and `job cancel --stage pretrian` cancelled nothing), which
    reads as "nothing ran"; a name a record or a recipe has is no error, even when nothing matches."""
    _history(store)
    for flt, said in (
        (
            RecordFilter(stage=("pretrian",)),
            "--stage 'pretrian': no record or recipe has such a stage; did you mean 'pretrain'?",
        ),
        (RecordFilter(recipe="lama"), "--recipe 'lama': no record or recipe has such a recipe; did you mean 'llama'?"),
        (RecordFilter(replica="tny"), "--replica 'tny': no record or recipe has such a replica; did you mean 'tiny'?"),
        (RecordFilter(recipe="marin-535"), "did you mean 'marin-535b-a23b'?"),  # the start of a shipped recipe's name
    ):
        with pytest.raises(ConfigError) as raised:
            list_records(store, ["stage_run", "attempt"], flt)
        assert str(raised.value).startswith(said) or said in str(raised.value), raised.value
    # known names that match nothing: an empty listing, as before
    for flt in (
        RecordFilter(stage=("posttrain",)),  # no record has it; the recipes do
        RecordFilter(replica="small"),
        RecordFilter(recipe="marin", replica="drops", stage=("eval",)),
    ):
        assert list_records(store, ["stage_run"], flt).matched == 0


def test_every_state_a_job_or_run_can_be_in_can_be_asked_for() -> None:
    from orchestrator.launchers import JobState
    from orchestrator.lineage.listing import KNOWN_STATES

    assert {s.value for s in JobState} <= set(KNOWN_STATES)
    # SUCCEEDED is how a job says it ended well (`job status`); lineage records it COMPLETED
    assert RecordFilter.from_options(state=["succeeded", "Failed"]).state == ("COMPLETED", "Failed")


def test_asking_for_succeeded_jobs_finds_the_jobs_lineage_records_completed(store: LineageStore) -> None:
    """`job status` says SUCCEEDED, `lineage list --state SUCCEEDED` was accepted and said "no records
    match": attempts are recorded COMPLETED."""
    h = _history(store)
    with store.transaction() as tx:
        done = tx.add(Attempt(stage_run_id=h["new_data"], backend="slurm", job_id="6", state="COMPLETED"))
    for asked in ("SUCCEEDED", "succeeded", "COMPLETED"):
        found = list_records(store, ["attempt"], RecordFilter.from_options(state=[asked])).records
        assert [r.id for r in found] == [done.id], asked


def test_parse_when_forms() -> None:
    assert parse_when("7d", now=NOW) == NOW - dt.timedelta(days=7)
    assert parse_when("90m", now=NOW) == NOW - dt.timedelta(minutes=90)
    assert parse_when("2026-12-01") == dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    assert parse_when("2026-12-01T14:00+01:00") == dt.datetime(2026, 12, 1, 13, tzinfo=dt.UTC)
    with pytest.raises(ConfigError, match="12h"):
        parse_when("yesterday")


def test_the_command_answers_which_pretrain_jobs_failed_this_week(run_cli, openlab_home) -> None:
    from orchestrator.lineage import open_store

    with open_store() as store:
        h = _history(store)
    of_issue = run_cli("lineage", "list", "-k", "pipeline_run", "--issue", "#42", "--json")
    assert [r["id"] for r in json.loads(of_issue.stdout)] == [h["new"]], of_issue.stderr
    on_node = run_cli("lineage", "list", "-k", "pipeline_run", "--host", "n02", "--json")  # what a bad node touched
    assert [r["id"] for r in json.loads(on_node.stdout)] == [h["new"], h["old"]], on_node.stderr
    on_west = run_cli("lineage", "usage", "--cluster", "west", "--json")
    assert json.loads(on_west.stdout)["total"]["attempts"] == 1, on_west.stdout + on_west.stderr
    out = run_cli("lineage", "list", "--stage", "pretrain", "--state", "FAILED", "--since", "7d", "--json")
    assert out.returncode == 0, out.stderr
    assert {(r["kind"], r["id"]) for r in json.loads(out.stdout)} == {
        ("stage_run", h["new_pre"]),
        ("attempt", h["retry1"]),
        ("attempt", h["retry2"]),
    }
    table = run_cli("lineage", "list", "--state", "FAILED", "-n", "2", env={"COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    assert "2 of 7 matching records shown" in table.stdout, table.stdout
    # ids are copied from here into `lineage show`: each whole on its line, even 80 columns wide
    whole = re.findall(r"\b(?:prun|srun|att)_[0-9a-f]{20}\b", table.stdout)
    assert len(whole) == 2 and set(whole) <= set(h.values()), table.stdout
    none = run_cli("lineage", "list", "--recipe", "llama", "--replica", "drops")  # names there are, together nowhere
    assert none.returncode == 0 and none.stdout.strip() == "no records match", none.stdout
    typo = run_cli("lineage", "list", "--recipe", "lama")
    assert typo.returncode == 2 and "did you mean 'llama'?" in typo.stderr, typo.stderr
    for args, needle in (
        (("--since", "last tuesday"), "cannot read 'last tuesday' as a time"),
        (("--kind", "snapshot", "--state", "FAILED"), "--state cannot be answered by snapshot"),
        (("--commit", "a1b2"), "--commit 'a1b2': give at least 7 characters"),
        # a misspelt state listed nothing, which reads as "nothing failed"
        (("--state", "FAILD"), "--state 'FAILD': not a state; did you mean 'FAILED'? states: PENDING, RUNNING"),
        (("--since", "2026-12-02", "--until", "2026-12-01"), "--since '2026-12-02' is not before --until"),
        # a misspelt backend listed nothing, which reads as "nothing ran on slurm"
        (("--backend", "slurmm"), "--backend 'slurmm': not a backend; did you mean 'slurm'? known backends: local"),
    ):
        bad = run_cli("lineage", "list", *args)
        assert bad.returncode == 2, bad.stdout
        assert needle in bad.stderr and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_the_list_says_why_an_attempt_did_not_complete_and_nothing_it_does_not_know(run_cli, openlab_home) -> None:
    """An auditor reading ``lineage list`` wants the reason a job failed beside it; an attempt refused
    before it had a job printed ``job=None ... exit=None`` instead of why."""
    from orchestrator.lineage import open_store
    from orchestrator.lineage.trace import describe

    with open_store() as store, store.transaction() as tx:
        srun = tx.add(StageRun(stage="pretrain", identity="i1", state="FAILED"))
        refused = "submit failed: LauncherError: working directory /nonexistent does not exist"
        tx.add(Attempt(stage_run_id=srun.id, backend="local", state="FAILED", reason=refused))
        missing = "exit code 127: cannot run 'no-such-trainer': No such file or directory"
        kw = {"backend": "slurm", "host": "n1", "stage_run_id": srun.id}
        tx.add(Attempt(number=2, job_id="71", state="FAILED", exit_code=127, reason=missing, **kw))
        tx.add(
            Attempt(number=3, job_id="72", state="COMPLETED", exit_code=0, reason="requeued once", cluster="west", **kw)
        )
    out = run_cli("lineage", "list", "-k", "attempt", env={"COLUMNS": "250"})
    assert out.returncode == 0, out.stderr
    lines = [" ".join(line.split()[4:]) for line in out.stdout.splitlines() if line.startswith("attempt ")]
    assert sorted(lines) == [
        f"#1 local FAILED: {refused}",
        f"#2 slurm job=71 FAILED exit=127 host=n1: {missing}",
        "#3 slurm@west job=72 COMPLETED exit=0 host=n1",  # which job on which cluster
    ], out.stdout

    with store.transaction() as tx:
        tx.add(PipelineRun(recipe="marin-535b-a23b", replica="tiny", backend="local", state="COMPLETED"))
    kinds = ("-k", "attempt", "-k", "stage_run", "-k", "pipeline_run")
    listed = json.loads(run_cli("lineage", "list", *kinds, "--json").stdout)
    summaries = [" ".join(describe(store.find(r["id"])).split()) for r in listed]

    # 80 columns (and a pipe): a block per record, its kind and id whole on the first line, its summary
    # wrapped by word under it, nothing cropped at the edge
    narrow = run_cli("lineage", "list", *kinds, env={"COLUMNS": "80"})
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, narrow.stdout
    blocks: list[tuple[str, list[str]]] = []
    for line in lines[1:]:
        if line.startswith("    "):
            blocks[-1][1].append(line.strip())
        else:
            blocks.append((line, []))
    assert [tuple(head.split()[:2]) for head, _ in blocks] == [(r["kind"], r["id"]) for r in listed], narrow.stdout
    assert [" ".join(words) for _, words in blocks] == summaries, narrow.stdout

    # a wide terminal: the table, whose summary column wraps and is not cropped at the edge either
    wide = run_cli("lineage", "list", *kinds, env={"COLUMNS": "120"})
    table = wide.stdout.splitlines()
    assert max(len(line) for line in table) <= 120, wide.stdout
    start = next(line for line in table if line.lstrip().startswith("kind")).index("summary")
    assert "".join("".join(line[start:].split()) for line in table[3:]) == "".join(summaries).replace(" ", "")


def test_export_takes_the_same_filters_and_never_reads_no_match_as_everything(run_cli, openlab_home, tmp_path) -> None:
    from orchestrator.lineage import open_store

    with open_store() as store:
        h = _history(store)
    out = run_cli("lineage", "export", "-f", "prov", "--replica", "drops")
    assert out.returncode == 0, out.stderr
    assert h["new"] in out.stdout and h["new_pre"] in out.stdout
    assert h["old"] not in out.stdout and h["other"] not in out.stdout
    week = run_cli("lineage", "export", "-f", "prov", "--since", "7d", "--state", "completed")
    assert h["other"] in week.stdout and h["new"] not in week.stdout and h["old"] not in week.stdout
    target = tmp_path / "archive.json"
    none = run_cli("lineage", "export", "--recipe", "llama", "--replica", "drops", "-o", str(target))
    assert none.returncode == 2 and "no pipeline run matches" in none.stderr, none.stderr
    assert len(none.stderr.strip().splitlines()) == 1 and not target.exists()


def test_a_span_back_past_year_one_means_since_the_beginning_and_an_empty_one_is_refused() -> None:
    """`--since 800000d` was `OverflowError: date value out of range`, `--since 1e22h` in digits
    `Python int too large to convert to C int`; `--since ''` was read as no --since at all."""
    from orchestrator.lineage.listing import EARLIEST, LATEST

    for span in ("800000d", "99999999d", "9999999999999999999999h", "9" * 400 + "w"):
        assert parse_when(span, now=NOW) == EARLIEST, span
    # a zone east of UTC on 0001-01-01 is still year 0 in UTC; one west of it on 9999-12-31, year 10000
    assert parse_when("0001-01-01T00:00+05:00") == EARLIEST
    assert parse_when("9999-12-31T23:00-05:00") == LATEST
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match="no time given.*7d"):
            parse_when(empty)
    for option, value in (("since", ""), ("until", " "), ("user", ""), ("recipe", ""), ("host", " ")):
        with pytest.raises(ConfigError, match=f"^--{option} is empty: "):
            RecordFilter.from_options(**{option: value})
    with pytest.raises(ConfigError, match="^--stage is empty: "):
        RecordFilter.from_options(stage=["pretrain", ""])


def test_a_filter_from_the_beginning_keeps_every_record_on_both_databases(store: LineageStore) -> None:
    h = _history(store)
    everything = _ids(store, KINDS)
    assert _ids(store, KINDS, since=parse_when("800000d")) == everything
    assert _ids(store, KINDS, until=parse_when("800000d")) == set()
    assert _ids(store, KINDS, since=parse_when("0001-01-01T00:00+05:00"), until=parse_when("9999-12-31T23:00-05:00"))
    assert h["new"] in everything


def test_a_commit_or_issue_with_like_wildcards_matches_those_characters_not_everything(store: LineageStore) -> None:
    """`--commit %%%%%%%` (or `_______`) matched every run with a commit, `--issue #%` every linked run."""
    h = _history(store)
    assert _ids(store, ["pipeline_run"], commit="a1b2c3d") == {h["old"]}
    for wild in ("%%%%%%%", "_______", "a1b2c3%"):
        assert _ids(store, ["pipeline_run"], commit=wild) == set(), wild
    assert _ids(store, ["pipeline_run"], issue="#42") == {h["new"]}
    assert _ids(store, ["pipeline_run"], issue="#%") == set()
    assert _ids(store, ["pipeline_run"], issue="#_2") == set()


def test_every_command_that_takes_a_time_span_takes_one_back_past_year_one(run_cli, openlab_home) -> None:
    from orchestrator.lineage import open_store

    with open_store() as store:
        h = _history(store)
    every = run_cli("lineage", "list", "-k", "pipeline_run", "--since", "800000d", "--json")
    assert every.returncode == 0, every.stderr
    assert {r["id"] for r in json.loads(every.stdout)} == {h["old"], h["new"], h["other"]}
    none = run_cli("lineage", "list", "--until", "99999999d")
    assert none.returncode == 0 and none.stdout.strip() == "no records match", none.stdout + none.stderr
    for args in (
        ("lineage", "list", "--since", "9999999999999999999999h"),
        ("lineage", "usage", "--since", "800000d"),
        ("lineage", "compare", "--since", "800000d"),
        ("lineage", "export", "-f", "prov", "--since", "800000d"),
        ("lineage", "affected", "--host", "n02", "--since", "99999999d"),
        ("gc", "--dry-run", "--unused-for", "99999999d"),
        ("github", "digest", "--since", "99999999d", "--dry-run"),
    ):
        out = run_cli(*args, timeout=120)
        assert out.returncode == 0, (args, out.stderr)
        assert "Traceback" not in out.stderr and "Error" not in out.stderr, (args, out.stderr)
        if args[0] == "gc":  # the rule it applied, with the year in four digits (`%Y` wrote "1-01-01")
            assert "used since 0001-01-01 00:00 UTC" in " ".join(out.stdout.split()), out.stdout
    for args in (
        ("lineage", "list", "--since", ""),
        ("lineage", "list", "--user", ""),
        ("lineage", "usage", "--until", ""),
        ("github", "digest", "--since", "", "--dry-run"),
        ("gc", "--dry-run", "--unused-for", ""),
    ):
        bad = run_cli(*args, timeout=120)
        assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
        assert "is empty" in bad.stderr or "no time given" in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr, (args, bad.stderr)
