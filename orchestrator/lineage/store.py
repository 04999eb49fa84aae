"""The lineage store: one database, transactional writes, a hash-chained event log.

Every write goes through :meth:`LineageStore.transaction`. Inside it,
:meth:`Transaction.add`, :meth:`Transaction.update` and :meth:`Transaction.relate`
change a record *and* append an :class:`~orchestrator.lineage.models.Event` whose hash
covers the record's full new content and the previous event's hash. A row edited
behind openlab's back no longer matches its last event, and a removed or altered
event breaks the chain; :mod:`orchestrator.lineage.verify` finds both.

Appending to one chain from several processes needs one writer at a time: on SQLite
a write transaction starts with ``BEGIN IMMEDIATE`` (WAL mode keeps readers going),
on PostgreSQL it takes a transaction-scoped advisory lock. Either way the whole
change, records and events, commits or rolls back together.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import re
import shlex
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, OperationalError, SQLAlchemyError
from sqlmodel import Session, SQLModel, col, select

from orchestrator.errors import NotFoundError, StoreError
from orchestrator.hashing import canonical, hash_json
from orchestrator.lineage.models import (
    PREFIXES,
    RECORD_TYPES,
    RELATION_KINDS,
    Artifact,
    Attempt,
    Commit,
    DataSnapshot,
    Event,
    GithubIssue,
    LineageRecord,
    Relation,
    StageRun,
    WandbRun,
    new_id,
    utcnow,
)
from orchestrator.secrets import credential_values, redact_value, secret_values
from orchestrator.settings import Settings, load_settings

log = logging.getLogger(__name__)

GENESIS_HASH = "0" * 64
#: The shortest id prefix :meth:`LineageStore.find` looks records up by.
MIN_PREFIX = 6
_URL_FORMS = "use sqlite:///PATH or postgresql://USER@HOST/DBNAME"
_PG_CHAIN_LOCK = 0x6F70656E6C6162  # "openlab"

R = TypeVar("R", bound=LineageRecord)

#: Ids per ``IN (...)`` list: PostgreSQL takes at most 65,535 bound parameters a statement and
#: SQLite builds from 32,766 up, and a bad cluster's jobs over a year can be more.
IN_CHUNK = 500


def in_chunks(ids: Iterable[str]) -> Iterator[list[str]]:
    """``ids`` in lists short enough for one ``IN (...)`` each."""
    batch: list[str] = []
    for one in ids:
        batch.append(one)
        if len(batch) == IN_CHUNK:
            yield batch
            batch = []
    if batch:
        yield batch


def record_payload(record: SQLModel) -> dict[str, Any]:
    """The canonical content of a record, as hashed into its events."""
    return canonical(record.model_dump(mode="json"))


def event_hash(seq: int, at: dt.datetime, kind: str, record_id: str, action: str, payload: Any, prev: str) -> str:
    """Hash of one event: its content and the previous event's hash."""
    return hash_json(
        {
            "seq": seq,
            "at": at.astimezone(dt.UTC).isoformat(),
            "record_kind": kind,
            "record_id": record_id,
            "action": action,
            "payload": payload,
            "prev_hash": prev,
        }
    )


def display_url(url: str | URL) -> str:
    """A database URL safe to print: the password is never shown."""
    try:  # libpq also takes the password as a parameter: postgresql://host/db?password=...
        return _hide_password_parameter(make_url(str(url)).render_as_string(hide_password=True))
    except Exception:  # noqa: BLE001 - an unparsable URL is shown as the user wrote it, minus nothing secret
        return "<unparsable database URL>"


def _hide_password_parameter(text: str) -> str:
    return re.sub(r"(?i)(password=)[^&]*", r"\1***", text)


def _masked(text: str) -> str:
    """Text meant as a database URL that does not parse, safe to print: whatever stands before an
    ``@`` (a user and password) and a ``password=`` value are hidden, the rest shown."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    return _hide_password_parameter(scheme + sep + rest)


def _parse_url(url: str, setting: str = "the lineage database URL") -> URL:
    """``url`` parsed, or a :class:`StoreError` naming ``setting`` (where the URL came from) and the
    forms it can take, never the password."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        parsed = None
    if parsed is None or (parsed.get_backend_name() == "sqlite" and (parsed.host or parsed.port)):
        # sqlite://lineage.db (two slashes) names a host, which SQLite has none of
        raise StoreError(f"{setting} is not a database URL ({_masked(url)!r}): {_URL_FORMS}")
    return parsed


def url_setting(settings: Settings) -> str:
    """Where ``settings.db_url`` came from, as a message names it."""
    if (os.environ.get("OPENLAB_DB_URL") or "").strip():
        return "OPENLAB_DB_URL"
    if settings.config.get("db_url"):
        return f"db_url in {settings.config_path}" if settings.config_path else "db_url"
    return "the lineage database URL (from OPENLAB_HOME)"


def _normalise_url(url: str) -> str:
    """Accept ``postgresql://`` and ``postgres://`` as psycopg 3 URLs."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def _sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL; None for another database or one in memory."""
    parsed = _parse_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database).expanduser()


def _require_sqlite_file(url: str) -> None:
    path = _sqlite_path(url)
    if path is not None and not path.is_file():
        raise StoreError(
            f"no lineage database at {path}: nothing has been recorded there; "
            "check OPENLAB_HOME or OPENLAB_DB_URL (a first run or snapshot creates it)"
        )


def _use_wal(cur: Any, patience_s: float = 60.0) -> None:
    """Put the database in WAL mode (persistent: only a new file is converted), retrying while locked.

    Switching the journal mode does not wait on the busy timeout: two processes creating the
    same new database at once (two pipelines started together) saw one fail at once with
    "database is locked". The switch is retried instead, for as long as a write would wait.
    """
    import sqlite3

    delay, waited = 0.01, 0.0
    while True:
        try:
            if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
                return
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or waited >= patience_s:
                raise
            time.sleep(delay)
            waited += delay
            delay = min(delay * 2, 0.5)


def _sqlite_tables(path: Path) -> list[str] | None:
    """The tables in the SQLite file at ``path``, read without writing to it (not even the switch to
    WAL mode every openlab connection makes); None where it cannot be read so (the engine then says why)."""
    import sqlite3

    if not path.is_file():
        return None
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=60)
    except sqlite3.Error:
        return None
    try:
        return [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def _refuse_foreign(url: str, tables: Iterable[str] | None) -> None:
    """Raise :class:`StoreError` when a database that has tables is not an openlab lineage database:
    no ``alembic_version`` or none of openlab's tables. Migrating it would write openlab's schema
    into someone else's database (and a reader would then call it an empty, intact history); an
    empty database, or a new one, is what openlab creates its schema in."""
    names = sorted(t for t in tables or () if not t.startswith("sqlite_"))
    if not names or ("alembic_version" in names and set(names) & set(SQLModel.metadata.tables)):
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise StoreError(
        f"{display_url(url)} is not an openlab lineage database (it holds {shown}): "
        "point OPENLAB_DB_URL/OPENLAB_HOME elsewhere; it was left as it is"
    )


def _refuse_empty(url: str, tables: Iterable[str]) -> None:
    """For a reader: raise :class:`StoreError` when the database holds no tables at all. A lineage
    file truncated to 0 bytes (its whole history erased) was migrated by ``verify``, which then
    called the new, empty event chain intact; a database nobody wrote is "nothing recorded", as a
    missing SQLite file is."""
    if not any(not t.startswith("sqlite_") for t in tables):
        raise StoreError(
            f"{_sqlite_path(url) or display_url(url)} holds no lineage (an empty database: nothing was "
            "recorded there, or what was has been erased); check OPENLAB_HOME or OPENLAB_DB_URL, and "
            "restore it from a backup if it held records; it was left as it is"
        )


def _make_engine(url: str, setting: str = "the lineage database URL") -> Engine:
    parsed = _parse_url(url, setting)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:":
            folder = Path(database).expanduser().parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(
                    f"cannot make the lineage database's folder {folder}: {exc.strerror}; "
                    "set OPENLAB_HOME (or OPENLAB_DB_URL) to a place this user can write"
                ) from None
        try:
            engine = sa.create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})
        except (ArgumentError, ImportError):  # sqlite://host/x, sqlite+nodriver:///x
            raise StoreError(f"unsupported lineage database URL {display_url(url)}: {_URL_FORMS}") from None

        @sa_event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            # Let SQLAlchemy, not the sqlite3 module, issue BEGIN, so it can be IMMEDIATE.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA busy_timeout = 60000")
            _use_wal(cur)
            cur.execute("PRAGMA synchronous = NORMAL")
            cur.execute("PRAGMA foreign_keys = ON")
            cur.close()

        @sa_event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.info.get("write") else "BEGIN")

        return engine
    if parsed.get_backend_name() == "postgresql":
        try:
            return sa.create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 10})
        except (ArgumentError, ImportError):  # postgresql+nodriver://
            pass
    raise StoreError(f"unsupported lineage database URL {display_url(url)}: {_URL_FORMS}")


def _explain_db_error(url: str, exc: BaseException) -> str:
    text = str(getattr(exc, "orig", exc) or exc).strip().splitlines()
    reason = text[0] if text else type(exc).__name__
    shown = display_url(url)
    if "file is not a database" in reason or "malformed" in reason:
        return (
            f"lineage database {shown} is not a readable SQLite database ({reason}); "
            "move it aside to start a new one, or restore it from a backup"
        )
    if url.startswith("postgresql"):
        return f"cannot use lineage database {shown}: {reason}; check OPENLAB_DB_URL and that the server is up"
    return f"cannot use lineage database {shown}: {reason}"


class Transaction:
    """One atomic change to lineage: records plus the events that describe them."""

    def __init__(self, session: Session, store: LineageStore) -> None:
        self.session = session
        self.store = store
        self._head: tuple[int, str] | None = None

    # -- the chain ---------------------------------------------------------------
    def _chain_head(self) -> tuple[int, str]:
        if self._head is None:
            last = self.session.exec(select(Event).order_by(col(Event.seq).desc()).limit(1)).first()
            self._head = (last.seq, last.hash) if last else (0, GENESIS_HASH)
        return self._head

    def _append(self, record: LineageRecord, action: str) -> Event:
        self.session.flush()
        seq, prev = self._chain_head()
        seq += 1
        at = utcnow()
        payload = record_payload(record)
        digest = event_hash(seq, at, record.kind, record.id, action, payload, prev)  # type: ignore[attr-defined]
        entry = Event(
            seq=seq,
            at=at,
            record_kind=record.kind,
            record_id=record.id,  # type: ignore[attr-defined]
            action=action,
            payload=payload,
            prev_hash=prev,
            hash=digest,
        )
        self.session.add(entry)
        self.session.flush()
        self._head = (seq, digest)
        return entry

    # -- writes --------------------------------------------------------------------
    @staticmethod
    def _redact(record: LineageRecord) -> None:
        """Mask credentials and scrub secret values in place before anything is written.

        The one gate every record passes, so no caller can leak a token into lineage.
        """
        fields = type(record).model_fields
        found = secret_values()
        for name in fields:
            found.extend(credential_values(getattr(record, name)))
        found.sort(key=len, reverse=True)
        for name in fields:
            value = getattr(record, name)
            if isinstance(value, str | dict | list):
                clean = redact_value(value, found)
                if clean != value:
                    setattr(record, name, clean)

    def add(self, record: R) -> R:
        """Insert a new record (an id is assigned when it has none)."""
        if not getattr(record, "id", None):
            record.id = new_id(record.id_prefix)  # type: ignore[attr-defined]
        self._redact(record)
        self.session.add(record)
        self._append(record, "create")
        return record

    def ensure(self, record: R) -> R:
        """Insert a content-addressed record unless one with its id exists; return the stored one.

        Content-addressed records (commits, snapshots, environments) are the same thing
        whenever their id is the same, so a second capture changes nothing.
        """
        existing = self.session.get(type(record), record.id)  # type: ignore[attr-defined]
        if existing is not None:
            return existing
        return self.add(record)

    def update(self, record: R, **changes: Any) -> R:
        """Change fields of a stored record and log the new content."""
        stored = record if record in self.session else self.session.merge(record)
        for name, value in changes.items():
            if name not in type(stored).model_fields:
                raise AttributeError(f"{type(stored).__name__} has no field {name!r}")
            setattr(stored, name, value)
        self._redact(stored)
        self.session.add(stored)
        self._append(stored, "update")
        return stored

    def relate(self, relation: str, subject: LineageRecord, obj: LineageRecord, role: str = "") -> Relation:
        """Record a PROV relation ``subject --relation--> obj`` (idempotent)."""
        if relation not in RELATION_KINDS:
            raise ValueError(f"unknown relation {relation!r}; known: {', '.join(RELATION_KINDS)}")
        existing = self.session.exec(
            select(Relation).where(
                Relation.relation == relation,
                Relation.subject_id == subject.id,  # type: ignore[attr-defined]
                Relation.object_id == obj.id,  # type: ignore[attr-defined]
                Relation.role == role,
            )
        ).first()
        if existing is not None:
            return existing
        edge = Relation(
            id=new_id(Relation.id_prefix),
            relation=relation,
            subject_kind=subject.kind,
            subject_id=subject.id,  # type: ignore[attr-defined]
            object_kind=obj.kind,
            object_id=obj.id,  # type: ignore[attr-defined]
            role=role,
        )
        return self.add(edge)

    # -- reads inside the transaction ---------------------------------------------
    def get(self, model: type[R], record_id: str) -> R | None:
        return self.session.get(model, record_id)


class LineageStore:
    """Access to one lineage database (SQLite by default, PostgreSQL by URL)."""

    def __init__(
        self, url: str, *, migrate: bool = True, create: bool = True, setting: str = "the lineage database URL"
    ) -> None:
        """``create=False`` is for readers: a SQLite file that does not exist is an error, not a new
        empty database, so a mistyped ``OPENLAB_DB_URL`` cannot make an audit report "nothing" (or
        `verify` report "intact") about a database nobody wrote. A database that holds tables but
        not openlab's is refused either way, untouched. ``setting`` names where ``url`` came from,
        for the message about a URL that does not parse."""
        _parse_url(url, setting)  # as the user wrote it, for the message
        self.url = _normalise_url(url)
        if not create:
            _require_sqlite_file(self.url)
        path = _sqlite_path(self.url)
        if path is not None:  # before the engine: its first connection switches the file to WAL mode
            tables = _sqlite_tables(path)
            _refuse_foreign(self.url, tables)
            if not create and tables is not None:
                _refuse_empty(self.url, tables)
        self.engine = _make_engine(self.url, setting)
        try:
            from orchestrator.lineage.migrations import ensure_schema

            if not self.is_sqlite:
                with self.engine.connect() as conn:
                    tables = sa.inspect(conn).get_table_names()
                _refuse_foreign(self.url, tables)
                if not create:
                    _refuse_empty(self.url, tables)
            ensure_schema(self.engine, migrate=migrate)
        except (OperationalError, DatabaseError) as exc:
            self.engine.dispose()
            raise StoreError(_explain_db_error(self.url, exc)) from None
        except StoreError:
            self.engine.dispose()
            raise

    @classmethod
    def open(cls, settings: Settings | None = None, *, migrate: bool = True, create: bool = True) -> LineageStore:
        """Open the configured store: ``OPENLAB_DB_URL`` or ``$OPENLAB_HOME/lineage.db``."""
        settings = settings or load_settings()
        return cls(settings.db_url, migrate=migrate, create=create, setting=url_setting(settings))

    @classmethod
    def open_to_plan(cls, settings: Settings | None = None) -> LineageStore:
        """The configured store for a dry run, which records nothing: where no SQLite file exists yet,
        an empty one in memory (every stage would run), so that asking what a run would do leaves no
        database behind at a mistyped ``OPENLAB_HOME``."""
        settings = settings or load_settings()
        setting = url_setting(settings)
        _parse_url(settings.db_url, setting)  # a URL that does not parse is an error, not a plan against nothing
        url = _normalise_url(settings.db_url)
        try:
            _require_sqlite_file(url)
        except StoreError:
            return cls("sqlite://")
        return cls(settings.db_url, setting=setting)

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> LineageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sessions -----------------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """A read session; objects stay usable after it closes."""
        with Session(self.engine, expire_on_commit=False) as session:
            try:
                yield session
            except (OperationalError, DatabaseError) as exc:
                raise StoreError(_explain_db_error(self.url, exc)) from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """One atomic write: everything inside commits together or not at all."""
        try:
            with self.engine.connect() as conn:
                conn.info["write"] = True
                try:
                    with Session(bind=conn, expire_on_commit=False) as session:
                        with conn.begin():
                            if self.engine.dialect.name == "postgresql":
                                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_CHAIN_LOCK})
                            yield Transaction(session, self)
                            session.flush()
                finally:
                    conn.info.pop("write", None)
        except (OperationalError, DatabaseError) as exc:
            raise StoreError(_explain_db_error(self.url, exc)) from None

    # -- reads ----------------------------------------------------------------------
    def get(self, model: type[R], record_id: str) -> R | None:
        with self.session() as session:
            return session.get(model, record_id)

    def get_many(self, model: type[R], record_ids: Iterable[str | None]) -> dict[str, R]:
        """The records of ``model`` with these ids (None and unknown ids left out), by id, in one
        query per :data:`IN_CHUNK` ids: what a command that looked up one record at a time for
        thousands of jobs needs."""
        ids = sorted({i for i in record_ids if i})
        found: dict[str, R] = {}
        for chunk in in_chunks(ids):
            found |= {r.id: r for r in self.list(model, where=[col(model.id).in_(chunk)])}  # type: ignore[attr-defined]
        return found

    def require(self, model: type[R], record_id: str) -> R:
        found = self.get(model, record_id)
        if found is None:
            raise NotFoundError(f"no {model.kind} with id {record_id!r}; `openlab lineage list` shows ids")
        return found

    def list(
        self,
        model: type[R],
        *,
        where: Sequence[Any] = (),
        order_by: Any = None,
        limit: int | None = None,
        **equals: Any,
    ) -> list[R]:
        """Records of one kind, filtered by SQL expressions and ``field=value`` pairs."""
        stmt = select(model)
        for clause in where:
            stmt = stmt.where(clause)
        for name, value in equals.items():
            stmt = stmt.where(getattr(model, name) == value)
        if order_by is not None:
            stmt = stmt.order_by(order_by)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self.session() as session:
            return list(session.exec(stmt).all())

    def find(self, record_id: str) -> LineageRecord:
        """The record ``record_id`` names, of any kind: its id, or a unique id prefix (at least
        :data:`MIN_PREFIX` characters), or another name people have for it in hand:

        - a backend job id (``local-5f21cecd4c23``, Slurm's ``4711``): the attempt that is that job
          (:meth:`find_job`; one that names jobs on two clusters is refused, naming each);
        - a commit sha or a unique sha prefix: the commit (its clean tree's record; a sha recorded
          only from dirty trees, several of them, raises :class:`CommitTrees`, which says which);
          an exact ``sha+patch`` id is that dirty tree;
        - a W&B run's id (``2d5eb8fa``, what the W&B UI shows), ``project/run_id``,
          ``entity/project/run_id`` or its URL, and a unique prefix of its run id;
        - an issue, ``owner/repo#N``, ``#N`` or its URL;
        - a path on this machine (a checkpoint file, an output folder, a job's log): the output,
          snapshot or job recorded there.

        ``kind:id`` (``environment:40b288d4``), the form ``openlab lineage show`` prints a related
        record in, looks among that kind only. What names several records is refused in one line
        that lists them and says how to name one, never answered with one of them.
        """
        asked = record_id
        models = list(RECORD_TYPES.values())
        kind, qualified, rest = record_id.partition(":")
        own = PREFIXES.get(record_id.partition("_")[0])  # srun_… is a stage run's id: ask that table first
        with self.session() as session:
            for model in sorted(models, key=lambda m: m is not own):
                exact = session.get(model, record_id)
                if exact is not None:
                    return exact
            if qualified and kind in RECORD_TYPES and rest:
                models, record_id = [RECORD_TYPES[kind]], rest
                exact = session.get(models[0], record_id)
                if exact is not None:
                    return exact
            on_disk = len(models) > 1 and _is_path(record_id)
            if on_disk:
                at_path = self._recorded_at(session, record_id)
                if at_path is not None:
                    return at_path
            if GithubIssue in models and not on_disk and _names_issue(record_id):
                return _issue(session, record_id)
            named = _named(session, record_id, models)
            if named:
                return _one(record_id, named, prefix=False)
            if len(record_id) >= MIN_PREFIX:
                prefixed = _prefixed(session, record_id, models)
                if prefixed:
                    return _one(record_id, prefixed, prefix=True)
        if on_disk:
            shown = shlex.quote(record_id)
            raise NotFoundError(
                f"no lineage record with id {asked!r}: that path is not a recorded output, snapshot or job log "
                "(nothing was recorded at it or at a folder above it); if it is a copy of an output, "
                f"`openlab lineage which {shown}` finds the output that held its content"
            )
        if len(record_id) < MIN_PREFIX:
            raise NotFoundError(
                f"no lineage record with id {asked!r}; an id prefix needs at least {MIN_PREFIX} characters "
                "(`openlab lineage list` shows ids)"
            )
        raise NotFoundError(f"no lineage record with id {asked!r}; `openlab lineage list` shows ids")

    def find_job(self, job_id: str, *, backend: str | None = None) -> Attempt | None:
        """The attempt that is backend job ``job_id`` (on ``backend`` only, when given), or None.

        A job id means something only on its cluster (Slurm numbers jobs per cluster, and starts
        again when a controller loses its state): attempts with this id on two clusters, or for two
        stage runs, are two jobs, and asking for one is refused naming each (:class:`NotFoundError`).
        The same job recorded twice for one stage run on one cluster is that job: its last attempt.
        """
        with self.session() as session:
            groups = _jobs(session, job_id, backend)
        if not groups:
            return None
        if len(groups) > 1:
            raise NotFoundError(_jobs_ambiguous(job_id, groups))
        return groups[0].pick()

    @staticmethod
    def _recorded_at(session: Session, text: str) -> LineageRecord | None:
        """The output (artifact) or snapshot recorded at the existing path ``text`` or at the
        nearest folder above it, or the job whose log it is: "what made this checkpoint?" asked
        with the file in hand. The deepest match wins, an artifact over a snapshot of the same
        folder (the artifact knows the stage run that made it), then the newest; None when
        ``text`` is no path on this machine."""
        path = Path(text).expanduser()
        try:
            if not path.exists():
                return None
        except OSError:  # a name too long to be a path, say
            return None
        places = {str(p) for p in (Path(os.path.abspath(path)), path.resolve())}
        places |= {str(parent) for place in list(places) for parent in Path(place).parents}
        found: list[tuple[int, int, dt.datetime, LineageRecord]] = []
        kinds = (
            (2, Attempt, "log_path", "submitted_at"),  # a job's log file: the job that wrote it
            (1, Artifact, "uri", "created_at"),
            (0, DataSnapshot, "path", "created_at"),
        )
        for rank, model, field, when in kinds:
            for rec in session.exec(select(model).where(col(getattr(model, field)).in_(places))):
                found.append((len(getattr(rec, field)), rank, getattr(rec, when), rec))
        if not found:
            return None
        return max(found, key=lambda f: f[:3])[3]

    def relations(self, record_id: str) -> list[Relation]:
        """Every relation where ``record_id`` is the subject or the object."""
        with self.session() as session:
            stmt = (
                select(Relation)
                .where((Relation.subject_id == record_id) | (Relation.object_id == record_id))
                .order_by(col(Relation.created_at))
            )
            return list(session.exec(stmt).all())

    def events(self, record_id: str | None = None) -> list[Event]:
        with self.session() as session:
            stmt = select(Event).order_by(col(Event.seq))
            if record_id is not None:
                stmt = stmt.where(Event.record_id == record_id)
            return list(session.exec(stmt).all())


class CommitTrees(NotFoundError):
    """A commit recorded only with uncommitted changes, from several trees (``sha+patch`` each): no
    one record is the commit, so :meth:`LineageStore.find` names the trees; ``lineage trace SHA
    --down`` walks them all (:func:`orchestrator.lineage.trace.trace`)."""

    def __init__(self, sha: str, trees: list[Commit]) -> None:
        listed = ", ".join(t.id for t in trees[:5]) + (f" and {len(trees) - 5} more" if len(trees) > 5 else "")
        super().__init__(
            f"commit {sha[:12]} was recorded only with uncommitted changes, from {len(trees)} trees ({listed}): "
            f"give one of their ids; `openlab lineage trace {sha[:12]} --down` shows what was made from all of them"
        )
        self.sha = sha
        self.trees = trees


@dataclass
class _Found:
    """One thing a name or a prefix found: a record, or records that are one thing (a commit's
    trees, a job recorded twice for its stage run), with the text it was found by (``key``), how a
    message names it, and how it was found: ``id`` (an id prefix), ``job``, ``commit``, ``wandb``."""

    records: list[Any]
    key: str
    label: str
    source: str

    def pick(self) -> LineageRecord:
        if self.source == "commit":  # the commit: its clean tree's record, or its only tree
            clean = [t for t in self.records if t.id == self.key]
            if clean:
                return clean[0]  # type: ignore[no-any-return]
            if len(self.records) > 1:
                raise CommitTrees(self.key, self.records)
        return self.records[0]  # type: ignore[no-any-return]  # a job's: the newest attempt


#: A W&B run's page: https://wandb.ai/ENTITY/PROJECT/runs/RUN_ID.
_WANDB_URL = re.compile(r"^https?://[^/\s]+/([^/\s]+)/([^/\s]+)/runs/([^/?#\s]+)/?(?:[?#].*)?$")
#: An issue's page on GitHub (what orchestrator.links.refs parses, told from other URLs).
_ISSUE_URL = re.compile(r"^https?://[^/\s]+/[^/\s]+/[^/\s]+/(?:issues|pull)/")


def _is_path(text: str) -> bool:
    """Whether ``text`` names something on this machine (``""`` is not the current folder)."""
    if not text.strip():
        return False
    try:
        return Path(text).expanduser().exists()
    except (OSError, ValueError):  # a name too long to be a path, a NUL byte
        return False


def _names_issue(text: str) -> bool:
    return "#" in text or bool(_ISSUE_URL.match(text))


def _issue(session: Session, text: str) -> GithubIssue:
    """The issue ``owner/repo#N``, ``#N`` (in whichever repository has one) or an issue URL names,
    or a :class:`NotFoundError` that says how issues are named."""
    from orchestrator.links.refs import GithubLinkError, parse_issue_ref

    missing = "an issue is recorded when a run names it (`--issue`); `openlab lineage list -k github_issue` lists them"
    bare = re.fullmatch(r"#([0-9]+)", text.strip())
    if bare:
        number = int(bare.group(1))
        stmt = select(GithubIssue).where(GithubIssue.number == number).order_by(col(GithubIssue.id)).limit(10)
        found = list(session.exec(stmt))
        if len(found) == 1:
            return found[0]
        if found:
            listed = ", ".join(i.id for i in found)
            raise NotFoundError(
                f"#{number} is an issue in {len(found)} repositories: {listed}; give owner/repo#{number}"
            )
        raise NotFoundError(f"no issue #{number} in lineage: {missing}")
    try:
        ref = parse_issue_ref(text)
    except GithubLinkError:
        raise NotFoundError(
            f"{text!r} is no record id, and no issue: an issue is named owner/repo#N or #N (or by its URL)"
        ) from None
    issue = session.get(GithubIssue, ref.id)
    if issue is None:
        raise NotFoundError(f"no issue {ref.id} in lineage: {missing}")
    return issue


def _trees(session: Session, sha: str) -> list[Commit]:
    """Commit ``sha``'s records: the clean tree's first, then each dirty tree's as recorded."""
    stmt = select(Commit).where(Commit.sha == sha).order_by(col(Commit.created_at), col(Commit.id))
    trees = list(session.exec(stmt))
    return sorted(trees, key=lambda t: t.id != sha)


def _jobs(session: Session, job_id: str, backend: str | None) -> list[_Found]:
    """The jobs recorded with backend job id ``job_id``, each its attempts newest first: attempts on
    one backend and cluster for one stage run are one job (recorded again when requeued)."""
    stmt = select(Attempt).where(Attempt.job_id == job_id)
    if backend:
        stmt = stmt.where(Attempt.backend == backend)
    stmt = stmt.order_by(col(Attempt.submitted_at).desc(), col(Attempt.number).desc()).limit(50)
    groups: dict[tuple[str, str | None, str | None], list[Attempt]] = {}
    for attempt in session.exec(stmt):
        groups.setdefault((attempt.backend, attempt.cluster, attempt.stage_run_id), []).append(attempt)
    stage_ids = [k[2] for k in groups if k[2]]
    stages: dict[str, StageRun] = {}
    if stage_ids:
        stages = {s.id: s for s in session.exec(select(StageRun).where(col(StageRun.id).in_(stage_ids)))}
    out = []
    for (backend_name, cluster, stage_id), attempts in groups.items():
        where = f"cluster {cluster!r}" if cluster else "a cluster not recorded"
        stage = stages.get(stage_id or "")
        label = f"{attempts[0].id} ({backend_name} job on {where}"
        label += f", stage {stage.stage}" if stage is not None else ""
        label += f", submitted {attempts[0].submitted_at:%Y-%m-%d %H:%M})"
        out.append(_Found(attempts, job_id, label, "job"))
    return out


def _jobs_ambiguous(job_id: str, jobs: list[_Found]) -> str:
    listed = "; ".join(j.label for j in jobs)
    return (
        f"job id {job_id!r} names {len(jobs)} recorded jobs: {listed}; give the attempt id "
        "(a job id means something only on its cluster)"
    )


def _wandb_runs(session: Session, text: str) -> list[WandbRun]:
    """The W&B runs ``text`` names as W&B does: ``run_id``, ``project/run_id``,
    ``entity/project/run_id`` or the run's URL. A run recorded offline has no entity (its id is
    ``/project/run_id``): any entity given matches it, as it does once the run is synced."""
    url = _WANDB_URL.match(text)
    parts = list(url.groups()) if url else text.split("/")
    if len(parts) > 3 or not all(parts[-2:]):
        return []
    stmt = select(WandbRun).where(WandbRun.run_id == parts[-1])
    if len(parts) > 1:
        stmt = stmt.where(WandbRun.project == parts[-2])
    runs = list(session.exec(stmt.order_by(col(WandbRun.id)).limit(10)))
    if len(parts) == 3:
        entity = parts[0]
        same = [r for r in runs if (r.entity or "") == entity]
        runs = same or ([r for r in runs if not r.entity] if entity else [])
    return runs


def _named(session: Session, text: str, models: list[type[LineageRecord]]) -> list[_Found]:
    """What ``text`` names whole, though no record has it as its id: a backend job id, a commit sha
    recorded only from dirty trees, a W&B run's own names."""
    found: list[_Found] = []
    if Attempt in models:
        found += _jobs(session, text, None)
    if Commit in models:
        trees = _trees(session, text)
        if trees:
            found.append(_Found(trees, text, text, "commit"))
    if WandbRun in models:
        found += [_Found([r], r.run_id, r.id, "wandb") for r in _wandb_runs(session, text)]
    return found


def _prefixed(session: Session, text: str, models: list[type[LineageRecord]]) -> list[_Found]:
    """What ``text`` is the start of: ids, a commit's sha (all its trees one commit), W&B run ids."""
    found: list[_Found] = []
    for model in models:
        id_col = col(model.id)  # type: ignore[attr-defined]
        # autoescape: `%` and `_` in what was typed are characters of an id, not wildcards
        where = id_col.startswith(text, autoescape=True)
        if model is Commit and "+" not in text:  # a sha's start: the commit, not each of its trees
            shas = select(Commit.sha).where(col(Commit.sha).startswith(text, autoescape=True)).distinct().limit(4)
            for sha in session.exec(shas):
                found.append(_Found(_trees(session, sha), sha, sha, "commit"))  # type: ignore[arg-type]
            where = where & col(Commit.sha).is_(None)  # a tree of no git (no-git+patch): by its id
        found += [_Found([r], r.id, r.id, "id") for r in session.exec(select(model).where(where).limit(4))]  # type: ignore[attr-defined]
    if WandbRun in models:
        seen = {f.records[0].id for f in found if f.source == "id"}
        runs = select(WandbRun).where(col(WandbRun.run_id).startswith(text, autoescape=True))
        for run in session.exec(runs.order_by(col(WandbRun.id)).limit(4)):
            if run.id not in seen:
                found.append(_Found([run], run.run_id, run.id, "wandb"))
    return found


def _one(text: str, found: list[_Found], *, prefix: bool) -> LineageRecord:
    """The record of the one thing found, or a one-line refusal that lists what was found and says
    how to name one: more characters only where more characters can tell them apart."""
    if len(found) == 1:
        return found[0].pick()
    if all(f.source == "job" for f in found):
        raise NotFoundError(_jobs_ambiguous(text, found))
    listed = ", ".join(f.label for f in found[:3]) + (", ..." if len(found) > 3 else "")
    keys = {f.key for f in found}
    if all(f.source == "wandb" for f in found) and len(keys) == 1:  # one run id in several projects
        raise NotFoundError(
            f"W&B run {found[0].key} is in {len(found)} projects ({listed}): "
            "give project/run_id, or entity/project/run_id"
        )
    if prefix and len(keys) == len(found):
        raise NotFoundError(f"id prefix {text!r} is ambiguous ({listed}): give more characters")
    raise NotFoundError(
        f"{text!r} names {len(found)} records ({listed}): give a whole id, or KIND:ID (attempt:ID, "
        "wandb_run:ID, commit:SHA) to look among one kind"
    )


def open_store(settings: Settings | None = None, *, create: bool = True) -> LineageStore:
    """Open the configured lineage store, migrating it to this code's schema (see LineageStore for create)."""
    return LineageStore.open(settings, create=create)


__all__ = [
    "GENESIS_HASH",
    "MIN_PREFIX",
    "CommitTrees",
    "LineageStore",
    "StoreError",
    "SQLAlchemyError",
    "Transaction",
    "display_url",
    "event_hash",
    "open_store",
    "record_payload",
]
