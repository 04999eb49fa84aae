"""The lineage store on real SQLite and real PostgreSQL: transactions, the event chain, tampering."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from orchestrator.errors import OpenlabError, StoreError
from orchestrator.lineage import (
    Experiment,
    LineageStore,
    PipelineRun,
    StageRun,
)
from orchestrator.lineage.verify import verify
from orchestrator.settings import load_settings


def _populate(store: LineageStore) -> tuple[PipelineRun, StageRun]:
    with store.transaction() as tx:
        exp = tx.add(Experiment(name="moe-drops"))
        run = tx.add(PipelineRun(experiment_id=exp.id, recipe="marin-535b-a23b", replica="tiny", params={"lr": 1.0}))
        stage = tx.add(StageRun(pipeline_run_id=run.id, stage="tokenize", identity="a" * 64))
        tx.relate("wasInformedBy", stage, run)
    with store.transaction() as tx:
        tx.update(stage, state="COMPLETED", metrics={"loss": 2.5})
    return run, stage


def test_writes_are_logged_and_verify_clean(store: LineageStore) -> None:
    run, stage = _populate(store)
    events = store.events()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[0].prev_hash == "0" * 64
    assert all(b.prev_hash == a.hash for a, b in zip(events, events[1:], strict=False))
    assert [e.action for e in store.events(stage.id)] == ["create", "update"]
    assert store.events(stage.id)[-1].payload["metrics"] == {"loss": 2.5}
    assert verify(store, load_settings()) == []


def test_a_diverged_stage_is_recorded_with_its_nan_and_infinite_numbers_and_verifies(store: LineageStore) -> None:
    """PostgreSQL's json refuses Python's bare NaN: the record of a stage whose loss diverged could not be
    written there ("invalid input syntax for type json"), though a failure's record is what is kept.
    The numbers read back as the floats they were, on either database; words stay words."""
    import math

    with store.transaction() as tx:
        run = tx.add(PipelineRun(recipe="marin-535b-a23b", replica="tiny", state="FAILED", params={"note": "NaN"}))
        stage = tx.add(
            StageRun(
                pipeline_run_id=run.id,
                stage="pretrain",
                identity="diverged",
                state="FAILED",
                metrics={"loss": math.nan, "grad_norm": math.inf, "moe": {"min": -math.inf}, "steps": [1.5, math.nan]},
            )
        )
    got = store.require(StageRun, stage.id).metrics
    assert math.isnan(got["loss"]) and got["grad_norm"] == math.inf and got["moe"] == {"min": -math.inf}
    assert got["steps"][0] == 1.5 and math.isnan(got["steps"][1])
    assert store.require(PipelineRun, run.id).params == {"note": "NaN"}, "a word in a column of words stays one"
    assert verify(store, load_settings()) == []


def test_failed_transaction_writes_nothing(store: LineageStore) -> None:
    _populate(store)
    before = len(store.events())
    with pytest.raises(RuntimeError):
        with store.transaction() as tx:
            tx.add(Experiment(name="half-written"))
            raise RuntimeError("crash in the middle")
    assert len(store.events()) == before
    assert store.list(Experiment, name="half-written") == []


def test_row_edited_in_sql_is_named(store: LineageStore) -> None:
    _, stage = _populate(store)
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE stagerun SET state = 'FAILED' WHERE id = :id"), {"id": stage.id})
    problems = verify(store, load_settings())
    assert [p.record for p in problems] == [f"stage_run:{stage.id}"]
    assert "state" in problems[0].message


def test_row_inserted_or_deleted_in_sql_is_named(store: LineageStore) -> None:
    run, _ = _populate(store)
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO experiment (id, name, description, created_at) VALUES ('exp_forged', 'f', '', :t)"),
            {"t": run.started_at},
        )
    names = {p.record for p in verify(store, load_settings())}
    assert "experiment:exp_forged" in names


def test_event_tampering_breaks_the_chain(store: LineageStore) -> None:
    _populate(store)
    with store.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM event WHERE seq = 2"))
    records = {p.record for p in verify(store, load_settings())}
    assert "event:2" in records and "event:3" in records  # missing, and the next link broken


def test_rows_sql_made_unreadable_are_named_and_every_other_check_still_runs(tmp_path: Path) -> None:
    """A date that is not one, JSON cut short: SQLite stores what SQL gives it, and verify stopped at
    the first such row with a traceback, hiding every other edit behind it."""
    store = LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}")
    run, stage = _populate(store)
    (exp,) = store.list(Experiment)
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE event SET at = 'garbage' WHERE seq = 2"))
        conn.execute(sa.text("UPDATE stagerun SET metrics = '[1,2' WHERE id = :id"), {"id": stage.id})
        conn.execute(sa.text("UPDATE pipelinerun SET started_at = 'yesterday' WHERE id = :id"), {"id": run.id})
        conn.execute(sa.text("UPDATE experiment SET name = 'forged' WHERE id = :id"), {"id": exp.id})
    found = {p.record: p.message for p in verify(store, load_settings())}
    for record in ("event:2", f"stage_run:{stage.id}", f"pipeline_run:{run.id}"):
        assert found.get(record, "").startswith("unreadable, edited outside openlab: "), (record, found)
    assert "name" in found[f"experiment:{exp.id}"], found
    assert "event:3" not in found, "the chain goes on from the unreadable event's hash"
    store.close()


def _writer(url: str, worker: int, count: int) -> None:
    store = LineageStore(url)
    for i in range(count):
        with store.transaction() as tx:
            tx.add(Experiment(name=f"w{worker}-{i}"))
    store.close()


def test_concurrent_processes_keep_one_chain(store: LineageStore) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(store.url, w, 15)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    events = store.events()
    assert len(events) == 60
    assert [e.seq for e in events] == list(range(1, 61))
    assert verify(store, load_settings()) == []


def test_older_database_is_migrated(tmp_path: Path) -> None:
    from alembic import command

    from orchestrator.lineage.migrations import _alembic_config, head_revision

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        command.upgrade(_alembic_config(conn), "0001")
    with engine.begin() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == "0001"
    engine.dispose()
    store = LineageStore(url)
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == head_revision()
    _populate(store)
    assert verify(store, load_settings()) == []


def test_newer_database_is_refused(store: LineageStore) -> None:
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(StoreError, match="newer than this openlab"):
        LineageStore(store.url)


def test_corrupted_sqlite_file_is_one_clear_line(tmp_path: Path, run_cli, openlab_home: Path) -> None:
    (openlab_home / "lineage.db").write_bytes(b"this is not a database" * 100)
    result = run_cli("lineage", "list")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "not a readable SQLite database" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unreachable_database_url_hides_password(run_cli) -> None:
    result = run_cli("lineage", "list", env={"OPENLAB_DB_URL": "postgresql://u:hunter2@127.0.0.1:1/x"})
    assert result.returncode == 2
    assert "hunter2" not in result.stderr
    assert "cannot use lineage database" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [("lineage", "list"), ("lineage", "verify"), ("lineage", "export")])
def test_auditing_a_database_that_does_not_exist_is_an_error_not_an_empty_history(
    run_cli, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """A mistyped OPENLAB_DB_URL must not make `verify` say "intact" about a database it just created."""
    typo = tmp_path / "lineagee" / "lineage.db"
    result = run_cli(*command, env={"OPENLAB_DB_URL": f"sqlite:///{typo}"})
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip() == (
        f"error: no lineage database at {typo}: nothing has been recorded there; "
        "check OPENLAB_HOME or OPENLAB_DB_URL (a first run or snapshot creates it)"
    )
    assert not typo.parent.exists(), "a reader created the database it was asked to read"


@pytest.mark.parametrize("command", [("lineage", "list"), ("lineage", "verify"), ("lineage", "export")])
def test_auditing_a_lineage_file_emptied_to_0_bytes_is_an_error_and_leaves_it_as_it_is(
    run_cli, openlab_home: Path, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """`: > lineage.db` erased every record; `verify` then wrote the schema into the empty file and
    called the new, empty event chain intact (exit 0). A reader refuses a database without tables."""
    db = openlab_home / "lineage.db"
    db.write_bytes(b"")
    result = run_cli(*command)
    assert result.returncode == 2, result.stdout
    assert result.stderr.startswith(f"error: {db} holds no lineage (an empty database"), result.stderr
    assert db.stat().st_size == 0, "a reader wrote into the database it was asked to audit"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("a\n")
    assert run_cli("snapshot", str(tmp_path / "data")).returncode == 0  # a writer still makes its schema there
    assert run_cli(*command).returncode == 0


def test_opening_a_new_database_another_process_is_still_writing_waits_for_it(tmp_path: Path) -> None:
    """Two pipelines started together both create the new database. Switching it to WAL does not wait
    on SQLite's busy timeout: while the other side's first write was open, the switch failed at once
    with "database is locked" (seen in test_two_pipeline_processes_at_once, about 1 run in 7)."""
    path = tmp_path / "new.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    other.execute("CREATE TABLE first_write (x)")
    release = threading.Timer(0.5, lambda: other.execute("COMMIT"))
    release.start()
    try:
        with LineageStore(f"sqlite:///{path}") as store, store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        release.join()
        other.close()


def test_sqlite_uses_wal(openlab_home: Path) -> None:
    store = LineageStore.open()
    _populate(store)
    conn = sqlite3.connect(openlab_home / "lineage.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_records_written_before_a_migration_still_verify(tmp_path: Path) -> None:
    """A column added later is absent from old events: verify must not call old rows tampered."""
    import datetime as dt

    from alembic import command

    from orchestrator.lineage.migrations import _alembic_config
    from orchestrator.lineage.store import GENESIS_HASH, event_hash

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        command.upgrade(_alembic_config(conn), "0002")
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    # The row and its event exactly as openlab at schema 0002 wrote them (no `error` field yet).
    payload = {
        "id": "prun_old",
        "experiment_id": None,
        "name": "",
        "recipe": "r",
        "replica": "tiny",
        "backend": "local",
        "trigger": None,
        "flow_run_id": None,
        "params": {},
        "state": "COMPLETED",
        "verdict": None,
        "started_at": "2026-01-01T00:00:00Z",
        "ended_at": None,
    }
    digest = event_hash(1, at, "pipeline_run", "prun_old", "create", payload, GENESIS_HASH)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO pipelinerun (id, name, recipe, replica, backend, params, state, started_at) "
                "VALUES ('prun_old', '', 'r', 'tiny', 'local', '{}', 'COMPLETED', '2026-01-01 00:00:00.000000')"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO event (seq, at, record_kind, record_id, action, payload, prev_hash, hash) "
                "VALUES (1, '2026-01-01 00:00:00.000000', 'pipeline_run', 'prun_old', 'create', :p, :prev, :h)"
            ),
            {"p": __import__("json").dumps(payload), "prev": GENESIS_HASH, "h": digest},
        )
    engine.dispose()
    store = LineageStore(url)  # migrates 0002 -> head, adding pipelinerun.error
    assert verify(store, load_settings()) == []
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE pipelinerun SET error = 'forged' WHERE id = 'prun_old'"))
    assert [p.record for p in verify(store, load_settings())] == ["pipeline_run:prun_old"]


def test_migrations_build_the_schema_the_models_declare(tmp_path: Path) -> None:
    """A model field without a migration (or the reverse) would break every existing store."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlmodel import SQLModel

    import orchestrator.lineage.models  # noqa: F401 - registers every table on SQLModel.metadata

    store = LineageStore(f"sqlite:///{tmp_path / 'fresh.db'}")
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    assert diff == []


def test_a_log_rewritten_whole_passes_the_chain_but_not_an_anchor_published_before(store: LineageStore) -> None:
    """The attack the chain alone cannot see: whoever controls the database edits what a run recorded
    at its start (its recipe, its pre-registered prediction) and recomputes every hash after it. An
    anchor published before (the run card on GitHub carries one) catches it."""
    from orchestrator.lineage.verify import Anchor, anchor_of, check_anchors, parse_anchor
    from tests.core.forgery import rewrite_whole_log

    run, _ = _populate(store)
    anchor = anchor_of(store, run.id)
    assert anchor is not None and store.events(run.id)[0].seq == anchor.seq
    assert verify(store, load_settings(), anchors=[parse_anchor(str(anchor))]) == []

    rewrite_whole_log(store, "pipeline_run", run.id, params={"lr": 9.0})
    assert store.require(PipelineRun, run.id).params == {"lr": 9.0}
    assert verify(store, load_settings()) == [], "a consistent rewrite passes the chain and the records"
    problems = verify(store, load_settings(), anchors=[Anchor(anchor.seq, anchor.hash, "the card")])
    assert [p.record for p in problems] == [f"anchor:{anchor.seq}"]
    assert "published at the card" in problems[0].message and "rewritten" in problems[0].message

    (gone,) = check_anchors(store, [Anchor(10_000, anchor.hash)])
    assert "no event #10000" in gone.message
    with pytest.raises(OpenlabError, match="SEQ:HASH"):
        parse_anchor("12:not-a-hash")


def test_get_many_reads_records_by_id_in_one_query(store: LineageStore) -> None:
    """What `job list`, `lineage usage` and `lineage affected` look their owners up with: unknown
    ids and None (a job of no stage) are left out, not errors."""
    with store.transaction() as tx:
        a = tx.add(PipelineRun(recipe="r"))
        b = tx.add(PipelineRun(recipe="s"))
    found = store.get_many(PipelineRun, [a.id, None, "prun_nope", b.id, a.id])
    assert {k: v.recipe for k, v in found.items()} == {a.id: "r", b.id: "s"}
    assert store.get_many(PipelineRun, [None]) == {}


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("garbage", "'garbage'"),
        ("postgresql://u:hunter2@db:notaport/x", "'postgresql://***@db:notaport/x'"),
        ("postgres:hunter2@db/x", "'***@db/x'"),  # the // forgotten: no URL, still no password
        ("sqlite://lineage.db", "'sqlite://lineage.db'"),  # two slashes: a host, which SQLite has none of
    ],
)
def test_a_database_url_that_does_not_parse_is_one_line_naming_the_setting(run_cli, url: str, shown: str) -> None:
    """`OPENLAB_DB_URL=garbage` was `sqlalchemy.exc.ArgumentError: Could not parse SQLAlchemy URL`."""
    result = run_cli("lineage", "list", env={"OPENLAB_DB_URL": url})
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip() == (
        f"error: OPENLAB_DB_URL is not a database URL ({shown}): use sqlite:///PATH or postgresql://USER@HOST/DBNAME"
    )
    assert "hunter2" not in result.stderr
    with pytest.raises(StoreError, match="^the lineage database URL is not a database URL"):
        LineageStore(url)


def test_a_database_url_in_the_config_file_that_does_not_parse_names_the_file(run_cli, tmp_path: Path) -> None:
    config = tmp_path / "openlab.toml"
    config.write_text('db_url = "postgresql+psycopg://u:hunter2@db:port/x"\n')
    for args in (("lineage", "list"), ("lineage", "verify"), ("gc", "--dry-run")):
        result = run_cli(*args, env={"OPENLAB_CONFIG": str(config)})
        assert result.returncode == 2, (args, result.stdout)
        assert result.stderr.startswith(f"error: db_url in {config} is not a database URL ("), result.stderr
        assert "hunter2" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    unsupported = run_cli("lineage", "list", env={"OPENLAB_DB_URL": "postgresql+nodriver://u:hunter2@db/x"})
    assert unsupported.returncode == 2 and "unsupported lineage database URL" in unsupported.stderr
    assert "hunter2" not in unsupported.stderr and "Traceback" not in unsupported.stderr


def _foreign_sqlite(path: Path) -> bytes:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE foo (x)")
    conn.execute("INSERT INTO foo VALUES (1)")
    conn.commit()
    conn.close()
    return path.read_bytes()


@pytest.mark.parametrize("command", [("lineage", "list"), ("lineage", "verify"), ("lineage", "show", "abcdef12")])
def test_a_database_that_is_not_openlabs_is_refused_and_left_as_it_was(
    run_cli, openlab_home: Path, command: tuple[str, ...]
) -> None:
    """A SQLite file holding someone else's table was read as an empty lineage ("no records match",
    `verify`: "event chain intact"), and left holding openlab's whole schema beside it."""
    path = openlab_home / "lineage.db"
    before = _foreign_sqlite(path)
    result = run_cli(*command)
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip() == (
        f"error: sqlite:///{path} is not an openlab lineage database (it holds foo): "
        "point OPENLAB_DB_URL/OPENLAB_HOME elsewhere; it was left as it is"
    )
    assert path.read_bytes() == before
    assert sorted(p.name for p in openlab_home.iterdir()) == ["lineage.db", "openlab.toml"]


def test_every_opener_refuses_a_foreign_sqlite_database_but_creates_in_an_empty_file(openlab_home: Path) -> None:
    from orchestrator.lineage.store import open_store

    path = openlab_home / "lineage.db"
    before = _foreign_sqlite(path)
    for opener in (
        open_store,
        lambda: open_store(create=False),
        lambda: LineageStore.open(migrate=False),
        LineageStore.open_to_plan,
        lambda: LineageStore(f"sqlite:///{path}"),
    ):
        with pytest.raises(StoreError, match="is not an openlab lineage database"):
            opener()
        assert path.read_bytes() == before
    path.write_bytes(b"")  # an empty file is a new database, as a missing one is
    with open_store() as store:
        _populate(store)
        assert verify(store, load_settings()) == []


def test_a_postgresql_database_that_is_not_openlabs_is_refused_and_left_as_it_was() -> None:
    """Pointed at another application's PostgreSQL database (Prefect's has an alembic_version too),
    openlab must neither write its schema there nor call that schema "newer than this openlab"."""
    with _new_postgres_database() as (url, other):
        with other.begin() as conn:
            conn.execute(sa.text("CREATE TABLE foo (x int)"))
        for tables in (["foo"], ["alembic_version", "foo"]):
            with pytest.raises(StoreError, match=r"is not an openlab lineage database \(it holds "):
                LineageStore(url)
            with other.connect() as conn:
                assert sorted(sa.inspect(conn).get_table_names()) == tables
            with other.begin() as conn:  # another application's migrations
                conn.execute(sa.text("CREATE TABLE IF NOT EXISTS alembic_version (version_num varchar(32))"))
                conn.execute(sa.text("INSERT INTO alembic_version VALUES ('a1b2c3d4e5f6')"))


@contextlib.contextmanager
def _new_postgres_database() -> Iterator[tuple[str, sa.Engine]]:
    """A new, empty PostgreSQL database (its URL and an engine on it), dropped afterwards."""
    import uuid

    from tests.core.conftest import _drop_database, _postgres_admin_url

    admin_url = _postgres_admin_url()
    name = f"openlab_t_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.engine.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    other = sa.create_engine(url)
    try:
        yield url, other
    finally:
        other.dispose()
        _drop_database(admin, name)
        admin.dispose()


def test_auditing_an_empty_postgresql_database_is_an_error_and_writes_nothing_there() -> None:
    """A reader (`lineage verify`) on a PostgreSQL database nobody recorded in, or whose tables were
    dropped, created the schema and reported an intact, empty history."""
    with _new_postgres_database() as (url, other):
        with pytest.raises(StoreError, match=r"holds no lineage \(an empty database"):
            LineageStore(url, create=False)
        with other.connect() as conn:
            assert sa.inspect(conn).get_table_names() == []
        LineageStore(url).close()  # a writer makes its schema in it, and readers then read it
        LineageStore(url, create=False).close()


def test_an_id_prefix_is_characters_of_an_id_not_a_like_pattern(store: LineageStore) -> None:
    """`lineage show "c6873%"` found a record from five characters, `"%%%%%%"` and `"______"` matched
    every record; and a 4-character prefix said only that no record has that id."""
    from orchestrator.errors import NotFoundError

    run, stage = _populate(store)
    assert store.find(run.id[:10]).id == run.id  # a real prefix, `_` included, still finds it
    for pattern in (run.id[:5] + "%", "%%%%%%", "______", run.id[:4] + "_" * 6, "%" + run.id[-6:]):
        with pytest.raises(NotFoundError, match=r"^no lineage record with id "):
            store.find(pattern)
    with pytest.raises(NotFoundError, match="an id prefix needs at least 6 characters"):
        store.find(run.id[:4])
