"""GitHub experiment issues as lineage nodes: resolve, one card comment per run, labels, a queue.

A pipeline run may name an experiment issue. :func:`resolve_issue` records it (title,
state, labels, URL) and relates it to the run; :func:`publish_card` keeps a single
comment on it holding the run's lineage card, plus a state label. What GitHub cannot
take right now (no token, no network, rate limit) is recorded on the issue
(``last_error``) and queued durably in the lineage database
(:class:`~orchestrator.lineage.models.GithubUpdate`); ``openlab github sync`` flushes it
with :func:`sync_queue`. The daily digest (:mod:`orchestrator.links.digest`, ``openlab github
digest``) is posted through the same client, queue and marker logic, one comment per issue and day.

Why the design is what it is:

- *Never two comments for one run.* The comment's id is stored, and the body carries a
  hidden marker ``<!-- openlab:pipeline-run=ID -->``. If a process dies between creating
  the comment and storing its id, the next publish finds the marker and edits that
  comment instead of posting another.
- *GitHub never fails the pipeline when the link is optional.* Every GitHub error is
  turned into one line, recorded and (when retrying can help) queued. Only
  ``required=True`` at resolve time raises, and the flows call that before any job starts.
- *Rate limits are waited out only within a bound* (``[github] max_wait_s``): a
  pipeline should not stall for an hour on a status comment, so a longer wait queues.
- *The token is read from the environment where it is used* and never reaches lineage,
  logs, comments or exports; every message is scrubbed of it anyway.

Configuration (``[github]``): ``repo`` (default for ``#N``), ``token_env`` (default
``GITHUB_TOKEN``), ``base_url`` (GitHub Enterprise: ``https://HOST/api/v3``), ``strict``,
``max_wait_s``, ``timeout_s``, ``per_page``, ``seconds_between_requests``,
``seconds_between_writes`` (0 disables PyGithub's throttle) and ``[github.labels]``
``running`` / ``passed`` / ``regressed`` / ``failed`` (an empty name disables that label).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import math
import os
import re
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sqlmodel import col

from orchestrator.cards import pipeline_card, verdict_status
from orchestrator.errors import ConfigError, choices
from orchestrator.lineage.models import (
    GithubComment,
    GithubDigest,
    GithubIssue,
    GithubUpdate,
    PipelineRun,
    Relation,
    as_utc,
    utcnow,
)
from orchestrator.lineage.store import LineageStore
from orchestrator.links.refs import REPO_PATTERN, GithubLinkError, IssueRef, parse_issue_ref
from orchestrator.settings import Settings, load_settings, yes_or_no

if TYPE_CHECKING:
    from orchestrator.lineage.verify import Anchor
    from orchestrator.links.digest import IssueDigest

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_BASE_URL = "https://api.github.com"
DEFAULT_LABELS: dict[str, str] = {
    "running": "openlab:running",
    "passed": "openlab:passed",
    "regressed": "openlab:regressed",
    "failed": "openlab:failed",
}
#: Queued updates about a repository rather than an issue, from a nightly's verdict (``issue_id``
#: holds the repository): its regression issue (which may not exist yet) and the tested commit's status.
NIGHTLY_ACTIONS = ("regression", "status")
#: GitHub refuses comment bodies over 65536 characters.
MAX_BODY = 65_000
#: Without headers, GitHub asks clients to wait at least a minute after a secondary rate limit.
SECONDARY_LIMIT_WAIT_S = 60.0


def marker(pipeline_run_id: str) -> str:
    """The hidden HTML marker that identifies a run's card comment on any issue."""
    return f"<!-- openlab:pipeline-run={pipeline_run_id} -->"


def comment_record_id(issue_id: str, pipeline_run_id: str) -> str:
    """Deterministic lineage id of the (issue, pipeline run) card comment."""
    return "ghc_" + hashlib.sha256(f"{issue_id}@{pipeline_run_id}".encode()).hexdigest()[:20]


def _number(section: Mapping[str, Any], key: str, default: float, *, least: float, most: float | None = None) -> float:
    """A ``[github]`` number from a number or its text, refused in one line naming the key where it is
    not one or out of range (a timeout of 0 was PyGithub's ValueError traceback, ``per_page = 0`` an
    AssertionError). Unset or empty: ``default``."""
    value = section.get(key)
    value = default if value is None or value == "" else value
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < least or (most is not None and number > most):
        bound = f"from {least:g} to {most:g}" if most is not None else f"{least:g} or more"
        raise ConfigError(f"[github] {key} = {value!r}: give a number {bound} (default {default:g})")
    return number


def _seconds_or_none(section: Mapping[str, Any], key: str, default: float) -> float | None:
    """A throttle's seconds, 0 for none (PyGithub's own ``None``)."""
    if section.get(key) is None or section.get(key) == "":
        return default
    return _number(section, key, default, least=0) or None


def _flag(section: Mapping[str, Any], key: str, default: bool) -> bool:
    """A ``[github]`` yes/no: a boolean or its text; ``strict = "maybe"`` was taken as true. Unset or
    empty: ``default``."""
    value = section.get(key)
    flag = default if value is None or value == "" else yes_or_no(value)
    if flag is None:
        raise ConfigError(f"[github] {key} = {value!r}: give true or false")
    return flag


def _base_url(value: Any) -> str:
    """The API's address, ``https://api.github.com`` or an Enterprise host's ``https://HOST/api/v3``;
    anything else (no scheme, ``ftp://``) was a traceback out of PyGithub at the first request."""
    url = str(value or DEFAULT_BASE_URL).rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"[github] base_url = {value!r}: give the API's http(s) address, "
            "https://api.github.com or https://HOST/api/v3 for GitHub Enterprise"
        )
    return url


@dataclass(frozen=True)
class GithubConfig:
    """The ``[github]`` settings section, validated."""

    repo: str | None = None
    token_env: str = "GITHUB_TOKEN"
    base_url: str = DEFAULT_BASE_URL
    strict: bool = False
    required: bool = False
    commit_statuses: bool = True
    regression_issues: bool = True
    max_wait_s: float = 60.0
    timeout_s: int = 15
    per_page: int = 100
    seconds_between_requests: float | None = 0.25
    seconds_between_writes: float | None = 1.0
    labels: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_LABELS))

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> GithubConfig:
        section = (settings or load_settings()).section("github")
        labels = dict(DEFAULT_LABELS)
        raw_labels = section.get("labels", {})
        if not isinstance(raw_labels, Mapping):
            raise ConfigError("[github] labels must be a table of running/passed/regressed/failed names")
        unknown = set(raw_labels) - set(DEFAULT_LABELS)
        if unknown:
            first = sorted(unknown)[0]
            raise ConfigError(f"[github.labels] {first}: unknown key; {choices(first, DEFAULT_LABELS)}")
        labels.update({k: str(v) for k, v in raw_labels.items()})
        repo = section.get("repo") or None
        if repo is not None and not (isinstance(repo, str) and re.fullmatch(REPO_PATTERN, repo)):
            raise ConfigError(f"[github] repo = {repo!r}: give the repository as owner/name, in quotes")
        return cls(
            repo=repo,
            token_env=str(section.get("token_env") or "GITHUB_TOKEN"),
            base_url=_base_url(section.get("base_url")),
            strict=_flag(section, "strict", False),
            required=_flag(section, "required", False),
            commit_statuses=_flag(section, "commit_statuses", True),
            regression_issues=_flag(section, "regression_issues", True),
            max_wait_s=_number(section, "max_wait_s", 60.0, least=0),
            timeout_s=int(_number(section, "timeout_s", 15, least=1)),
            per_page=int(_number(section, "per_page", 100, least=1, most=100)),
            seconds_between_requests=_seconds_or_none(section, "seconds_between_requests", 0.25),
            seconds_between_writes=_seconds_or_none(section, "seconds_between_writes", 1.0),
            labels=labels,
        )

    def token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The token from the configured variable, else ``GITHUB_TOKEN`` for github.com alone: an
        Enterprise host was sent the github.com token of ``GITHUB_TOKEN`` when ``GHE_TOKEN`` was
        unset, and its 401 then blamed the variable that held nothing. Never stored."""
        env = os.environ if environ is None else environ
        return env.get(self.token_env) or (env.get("GITHUB_TOKEN") if self.token_var(env) == "GITHUB_TOKEN" else None)

    def token_var(self, environ: Mapping[str, str] | None = None) -> str:
        """The variable :meth:`token` reads the token from: the configured one where it is set, else
        ``GITHUB_TOKEN`` where openlab talks to github.com, else the configured one (holding none)."""
        env = os.environ if environ is None else environ
        public = (urllib.parse.urlparse(self.base_url).hostname or "api.github.com") == "api.github.com"
        return self.token_env if env.get(self.token_env) or not public else "GITHUB_TOKEN"

    @property
    def web_hosts(self) -> tuple[str, ...]:
        """Hosts whose git remotes get commit links on cards (github.com plus an Enterprise host)."""
        host = urllib.parse.urlparse(self.base_url).hostname or ""
        if host in ("", "api.github.com"):
            return ("github.com",)
        return ("github.com", host)

    def label_for(self, run: PipelineRun) -> str | None:
        """The state label a pipeline run should carry, or ``None`` when it has none."""
        state = (run.state or "").upper()
        if state in ("RUNNING", "PENDING"):
            key = "running"
        elif state in ("FAILED", "CANCELLED", "LOST"):
            key = "failed"
        elif state in ("COMPLETED", "REUSED"):
            verdict = verdict_status(run.verdict)
            key = "regressed" if verdict in ("regressed", "regression", "fail", "failed") else "passed"
        else:
            return None
        return self.labels.get(key) or None


_CONNECTION_PREFIX = re.compile(r"^\w+\(host=[^)]*\):\s*")


def network_reason(exc: BaseException, limit: int = 200) -> str:
    """What went wrong on the wire, in words: the innermost cause of a ``requests`` error
    (``Failed to resolve 'api.github.com' ([Errno -2] Name or service not known)``), without the
    connection pool's wrapping, which filled the 200 characters kept and was cut mid-word."""
    inner = exc
    for _ in range(8):  # requests' error -> urllib3's MaxRetryError -> its reason
        nxt = getattr(inner, "reason", None)
        if not isinstance(nxt, BaseException):
            nxt = inner.args[0] if inner.args and isinstance(inner.args[0], BaseException) else None
        if nxt is None or nxt is inner:
            break
        inner = nxt
    text = " ".join(_CONNECTION_PREFIX.sub("", str(inner)).split()) or type(inner).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _Failure(Exception):
    """A GitHub call that did not work, already phrased for people."""

    def __init__(
        self, message: str, *, retryable: bool, status: int | None = None, not_before: dt.datetime | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.status = status
        self.not_before = not_before


@dataclass
class PublishedAnchors:
    """What :meth:`GithubLinker.published_anchors` read back from GitHub."""

    anchors: list[Anchor] = field(default_factory=list)
    #: Cards that could not be read (deleted, no access, GitHub down): their anchors went unchecked.
    unreadable: list[str] = field(default_factory=list)
    #: Cards that carry no anchor (posted before openlab published them, or edited by hand).
    without_anchor: list[str] = field(default_factory=list)


@dataclass
class SyncReport:
    """What one flush of the queue did."""

    sent: int = 0
    failed: int = 0
    pending: int = 0
    deferred: int = 0
    errors: list[str] = field(default_factory=list)


class GithubLinker:
    """GitHub operations for one process: a PyGithub client plus lineage bookkeeping.

    ``sleep`` and ``clock`` are injectable so rate-limit waits can be tested without waiting.
    """

    def __init__(
        self,
        store: LineageStore,
        *,
        settings: Settings | None = None,
        config: GithubConfig | None = None,
        environ: Mapping[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.config = config or GithubConfig.from_settings(settings)
        self._token = self.config.token(environ)
        self._sleep = sleep
        self._clock = clock
        self._client: Any = None
        self._waited = 0.0

    # -- plumbing ------------------------------------------------------------------------------
    @property
    def has_token(self) -> bool:
        return bool(self._token)

    def scrub(self, text: str) -> str:
        """``text`` with the token (if any), this process's other secrets and any URL's password masked:
        messages end up in lineage and logs."""
        from orchestrator.secrets import scrub

        if self._token and self._token in text:
            text = text.replace(self._token, "***")
        return scrub(text)

    def _missing_token(self) -> _Failure:
        env = self.config.token_env
        public = self.config.token_var({}) == "GITHUB_TOKEN"  # GITHUB_TOKEN serves github.com alone
        hint = env if env == "GITHUB_TOKEN" or not public else f"{env} (or GITHUB_TOKEN)"
        return _Failure(f"no GitHub token: set {hint} to a token that can write issues", retryable=True)

    def client(self) -> Any:
        """The PyGithub client; retries are ours (bounded), not urllib3's (unbounded waits)."""
        if not self._token:
            raise self._missing_token()
        if self._client is None:
            from github import Auth, Github

            self._client = Github(
                auth=Auth.Token(self._token),
                base_url=self.config.base_url,
                timeout=self.config.timeout_s,
                per_page=self.config.per_page,
                retry=None,
                lazy=True,
                seconds_between_requests=self.config.seconds_between_requests,
                seconds_between_writes=self.config.seconds_between_writes,
            )
        return self._client

    def _rate_limit_wait(self, exc: Any) -> float | None:
        """Seconds GitHub asks us to wait, from Retry-After or X-RateLimit-Reset; None if not a rate limit."""
        from github.GithubException import RateLimitExceededException

        headers = {str(k).lower(): str(v) for k, v in (exc.headers or {}).items()}
        if exc.status not in (403, 429):
            return None
        if "retry-after" in headers:
            try:
                return max(0.0, float(headers["retry-after"]))
            except ValueError:
                pass
        if headers.get("x-ratelimit-remaining") == "0" and "x-ratelimit-reset" in headers:
            try:
                return max(0.0, float(headers["x-ratelimit-reset"]) - self._clock())
            except ValueError:
                pass
        if isinstance(exc, RateLimitExceededException) or exc.status == 429:
            return SECONDARY_LIMIT_WAIT_S
        return None

    def _classify(self, exc: Any, ref: IssueRef) -> _Failure:
        """One clear line for each GitHub error status."""
        status = exc.status
        data = exc.data if isinstance(exc.data, Mapping) else {}
        detail = str(data.get("message") or "").strip()
        env = self.config.token_var()
        if status == 401:
            msg = f"GitHub rejected the token in ${env} (401 Bad credentials): it is revoked, expired or mistyped"
            return _Failure(msg, retryable=True, status=status)
        if status == 403:
            msg = f"GitHub refused access to {ref.repo} (403 {detail or 'Forbidden'}): the token lacks permission"
            return _Failure(msg, retryable=False, status=status)
        if status == 404 and ref.number == 0:  # a call about the repository (a regression issue to open)
            msg = f"repository {ref.repo} not found (404): check [github] repo and that the token in ${env} can read it"
            return _Failure(msg, retryable=False, status=status)
        if status == 404:
            msg = (
                f"issue {ref.id} not found (404): check the repository and number, "
                f"and that the token in ${env} can read {ref.repo}"
            )
            return _Failure(msg, retryable=False, status=status)
        if status == 410:
            msg = f"issues are disabled on {ref.repo} (410 Gone): enable them or name an issue in another repository"
            return _Failure(msg, retryable=False, status=status)
        if status == 422:
            errors = data.get("errors") or []
            parts = [detail or "Validation Failed"]
            for err in errors if isinstance(errors, list) else []:
                if isinstance(err, Mapping):
                    parts.append(str(err.get("message") or f"{err.get('field')} {err.get('code')}"))
            msg = f"GitHub rejected the update to {ref.id} (422 {'; '.join(parts)})"
            return _Failure(msg, retryable=False, status=422)
        if status >= 500:
            msg = f"GitHub failed ({status} {detail or 'server error'}) on {ref.id}"
            return _Failure(msg, retryable=True, status=status)
        return _Failure(f"GitHub answered {status} {detail} for {ref.id}".strip(), retryable=False, status=status)

    def _call(self, ref: IssueRef, fn: Callable[[], T]) -> T:
        """Run one GitHub call, waiting out rate limits within ``max_wait_s`` for this operation."""
        import requests
        from github.GithubException import GithubException

        for _ in range(4):
            try:
                return fn()
            except GithubException as exc:
                wait = self._rate_limit_wait(exc)
                if wait is None:
                    failure = self._classify(exc, ref)
                    failure.message = self.scrub(failure.message)  # a server may echo anything back
                    raise failure from None
                if self._waited + wait > self.config.max_wait_s:
                    until = dt.datetime.fromtimestamp(self._clock() + wait, dt.UTC)
                    msg = (
                        f"GitHub rate limit reached until {until:%H:%M:%S} UTC, longer than "
                        f"[github] max_wait_s={self.config.max_wait_s:g}s"
                    )
                    raise _Failure(msg, retryable=True, status=exc.status, not_before=until) from None
                log.info("GitHub rate limit: waiting %.1fs as its headers ask", wait)
                self._sleep(wait)
                self._waited += wait
            except (requests.RequestException, OSError) as exc:
                reason = self.scrub(network_reason(exc))
                raise _Failure(f"cannot reach GitHub at {self.config.base_url}: {reason}", retryable=True) from None
        raise _Failure("GitHub rate limit persists after waiting", retryable=True)

    def _issue(self, ref: IssueRef) -> Any:
        """Fetch the issue (one GET); a lazy object is completed here so its errors surface here."""
        client = self.client()

        def fetch() -> Any:
            issue = client.get_repo(ref.repo).get_issue(ref.number)
            issue.title  # noqa: B018 - completes a lazy object
            return issue

        return self._call(ref, fetch)

    # -- lineage bookkeeping ---------------------------------------------------------------------
    def _ensure_issue(self, ref: IssueRef, pipeline_run: PipelineRun | str | None) -> GithubIssue:
        with self.store.transaction() as tx:
            issue = tx.ensure(GithubIssue(id=ref.id, repo=ref.repo, number=ref.number))
            if pipeline_run is not None:
                run = pipeline_run if isinstance(pipeline_run, PipelineRun) else tx.get(PipelineRun, pipeline_run)
                if run is None:
                    raise GithubLinkError(f"no pipeline run with id {pipeline_run!r} to link {ref.id} to")
                tx.relate("wasAssociatedWith", run, issue)
            return issue

    def _record_issue(self, ref: IssueRef, gh_issue: Any, labels: list[str] | None = None) -> GithubIssue:
        with self.store.transaction() as tx:
            stored = tx.get(GithubIssue, ref.id) or tx.add(GithubIssue(id=ref.id, repo=ref.repo, number=ref.number))
            return tx.update(
                stored,
                title=gh_issue.title,
                state=gh_issue.state,
                labels=labels if labels is not None else [lb.name for lb in gh_issue.labels],
                url=gh_issue.html_url,
                resolved=True,
                last_error=None,
                updated_at=utcnow(),
            )

    def _record_error(self, ref: IssueRef, message: str) -> None:
        with self.store.transaction() as tx:
            stored = tx.get(GithubIssue, ref.id) or tx.add(GithubIssue(id=ref.id, repo=ref.repo, number=ref.number))
            if stored.last_error != message:
                tx.update(stored, last_error=message, updated_at=utcnow())

    def _record_comment(self, ref: IssueRef, pipeline_run_id: str, comment: Any, body_hash: str) -> GithubComment:
        cid = comment_record_id(ref.id, pipeline_run_id)
        with self.store.transaction() as tx:
            rec = tx.get(GithubComment, cid)
            fields = {"comment_id": int(comment.id), "url": comment.html_url, "body_hash": body_hash}
            if rec is None:
                rec = tx.add(GithubComment(id=cid, issue_id=ref.id, pipeline_run_id=pipeline_run_id, **fields))
                issue = tx.get(GithubIssue, ref.id)
                run = tx.get(PipelineRun, pipeline_run_id)
                if issue is not None:
                    tx.relate("wasDerivedFrom", rec, issue, role="comment-on")
                if run is not None:
                    tx.relate("wasGeneratedBy", rec, run)
                return rec
            if any(getattr(rec, k) != v for k, v in fields.items()):
                rec = tx.update(rec, updated_at=utcnow(), **fields)
            return rec

    def _queue_id(self, action: str, ref: IssueRef, key: str | None, issue_id: str | None = None) -> str:
        """``<action>:<issue>:<key>``, the key being the pipeline run (a card) or the day (a digest);
        ``issue_id`` replaces the issue for an update about a repository (a regression issue to find)."""
        return f"{action}:{issue_id or ref.id}:{key or '-'}"

    def _enqueue(
        self,
        action: str,
        ref: IssueRef,
        pipeline_run_id: str | None,
        failure: _Failure,
        *,
        key: str | None = None,
        issue_id: str | None = None,
    ) -> bool:
        """Queue ``action`` for `openlab github sync`; True when that is news (not queued already
        for the same error): a run updates its card at every stage, and one line says it."""
        qid = self._queue_id(action, ref, key or pipeline_run_id, issue_id)
        with self.store.transaction() as tx:
            entry = tx.session.get(GithubUpdate, qid)
            news = entry is None or entry.state == "done" or entry.last_error != self.scrub(failure.message)
            entry = entry or GithubUpdate(
                id=qid, action=action, issue_id=issue_id or ref.id, pipeline_run_id=pipeline_run_id
            )
            entry.state = "pending" if failure.retryable else "failed"
            entry.attempts += 1
            entry.last_error = self.scrub(failure.message)  # written past the store's masking (tx.session)
            entry.not_before = failure.not_before
            entry.updated_at = utcnow()
            tx.session.add(entry)
        return news

    def _mark_done(
        self,
        action: str,
        ref: IssueRef,
        pipeline_run_id: str | None,
        *,
        key: str | None = None,
        issue_id: str | None = None,
    ) -> None:
        qid = self._queue_id(action, ref, key or pipeline_run_id, issue_id)
        with self.store.transaction() as tx:
            entry = tx.session.get(GithubUpdate, qid)
            if entry is not None and entry.state != "done":
                entry.state, entry.last_error, entry.updated_at = "done", None, utcnow()
                tx.session.add(entry)

    # -- operations ------------------------------------------------------------------------------
    def resolve(
        self, ref: IssueRef | str, pipeline_run: PipelineRun | str | None = None, *, required: bool = False
    ) -> GithubIssue:
        """Record the issue and its link to the run, then fetch its title/state/labels/URL.

        Failures: ``required`` raises :class:`GithubLinkError`; otherwise the issue is
        left unresolved with ``last_error`` and, when retrying can help, queued.
        """
        ref = ref if isinstance(ref, IssueRef) else parse_issue_ref(ref, self.config.repo, self.config.web_hosts[-1:])
        self._waited = 0.0
        record = self._ensure_issue(ref, pipeline_run)
        try:
            gh_issue = self._issue(ref)
        except _Failure as failure:
            self._record_error(ref, failure.message)
            self._enqueue("resolve", ref, None, failure)  # non-retryable ones are kept as "failed"
            if required:
                raise GithubLinkError(f"{failure.message} (the issue link is required)") from None
            if not failure.retryable and self.config.strict:
                raise GithubLinkError(f"{failure.message} ([github] strict = true)") from None
            suffix = "; queued for `openlab github sync`" if failure.retryable else ""
            log.warning("GitHub issue %s left unresolved: %s%s", ref.id, failure.message, suffix)
            return self.store.get(GithubIssue, ref.id) or record
        record = self._record_issue(ref, gh_issue)
        self._mark_done("resolve", ref, None)
        if record.state == "closed":
            msg = f"issue {ref.id} is closed: reopen it or name an open experiment issue"
            if self.config.strict:
                raise GithubLinkError(f"{msg} ([github] strict = true)")
            log.warning("%s", msg)
        return record

    def linked_issues(self, pipeline_run_id: str) -> list[GithubIssue]:
        """The issues a pipeline run is associated with, in link order."""
        rels = self.store.list(
            Relation,
            relation="wasAssociatedWith",
            subject_id=pipeline_run_id,
            object_kind=GithubIssue.kind,
            order_by=col(Relation.created_at),
        )
        found = [self.store.get(GithubIssue, r.object_id) for r in rels]
        return [i for i in found if i is not None]

    def render_body(self, pipeline_run_id: str) -> str:
        """Marker plus card, cut to GitHub's size limit in the middle, at a line's end: the lineage
        anchors are the card's last lines, and a cut that kept its first 65,000 characters dropped
        them, so `lineage verify --github-anchors` found a card that "carries no lineage anchor"."""
        card = pipeline_card(self.store, pipeline_run_id, github_hosts=self.config.web_hosts)
        body = f"{marker(pipeline_run_id)}\n{card}"
        if len(body) <= MAX_BODY:
            return body
        at = body.find("\n**Lineage anchor:**")
        if at < 0:
            at = body.find("\n**End anchor:**")
        head, tail = (body[:at], body[at:]) if at >= 0 else (body, "")
        note = "\n\n_card truncated; `openlab lineage show` has the rest_\n"
        head = head[: MAX_BODY - len(tail) - len(note)]
        line_end = head.rfind("\n")  # at a line's end, unless that line is most of the card (thousands of --set)
        return (head[:line_end] if line_end > len(head) - 2000 else head) + note + tail

    def publish(self, pipeline_run_id: str, *, issue_id: str | None = None) -> list[GithubComment]:
        """Create or edit the run's card comment on each linked issue and set its state label.

        Never raises for GitHub problems: they are recorded and queued (see module doc).
        """
        results: list[GithubComment] = []
        for issue in self.linked_issues(pipeline_run_id):
            if issue_id is not None and issue.id != issue_id:
                continue
            ref = IssueRef(issue.repo, issue.number)
            self._waited = 0.0
            try:
                results.append(self._publish_one(ref, pipeline_run_id))
            except _Failure as failure:
                self._record_error(ref, failure.message)
                news = self._enqueue("publish", ref, pipeline_run_id, failure)
                suffix = "; queued for `openlab github sync`" if failure.retryable else ""
                log.log(
                    logging.WARNING if news else logging.DEBUG,  # said once, not at every stage's update
                    "lineage card for %s not posted on %s: %s%s",
                    pipeline_run_id,
                    ref.id,
                    failure.message,
                    suffix,
                )
        return results

    def _find_marked(self, ref: IssueRef, gh_issue: Any, mark: str) -> Any:
        """The existing card comment, found by its marker across all pages of comments."""

        def scan() -> Any:
            for comment in gh_issue.get_comments():
                if mark in (comment.body or ""):
                    return comment
            return None

        return self._call(ref, scan)

    def _publish_one(self, ref: IssueRef, pipeline_run_id: str) -> GithubComment:
        run = self.store.require(PipelineRun, pipeline_run_id)
        body = self.render_body(pipeline_run_id)
        body_hash = hashlib.sha256(body.encode()).hexdigest()
        rec = self.store.get(GithubComment, comment_record_id(ref.id, pipeline_run_id))
        wanted = self.config.label_for(run)
        managed = {name for name in self.config.labels.values() if name}
        stored_issue = self.store.get(GithubIssue, ref.id)
        if (
            rec is not None
            and rec.comment_id
            and rec.body_hash == body_hash
            and stored_issue is not None
            and stored_issue.resolved
            and {lb for lb in stored_issue.labels if lb in managed} == ({wanted} if wanted else set())
        ):
            self._mark_done("publish", ref, pipeline_run_id)
            return rec  # nothing changed since the last post: spend no API calls
        if not self._token:
            raise self._missing_token()
        gh_issue = self._issue(ref)
        comment, _ = self._upsert_comment(ref, gh_issue, rec.comment_id if rec else None, marker(pipeline_run_id), body)
        rec = self._record_comment(ref, pipeline_run_id, comment, body_hash)
        labels = self._sync_labels(ref, gh_issue, wanted, managed)
        self._record_issue(ref, gh_issue, labels=labels)
        self._mark_done("publish", ref, pipeline_run_id)
        return rec

    def _upsert_comment(
        self, ref: IssueRef, gh_issue: Any, comment_id: int | None, mark: str, body: str
    ) -> tuple[Any, str]:
        """Edit the comment we recorded, else the one carrying ``mark``, else create it: never two.

        Returns the comment and ``edited``, ``unchanged`` or ``created``.
        """
        if comment_id:
            known = gh_issue.get_comment(comment_id)
            try:
                self._call(ref, lambda: known.edit(body))
                return known, "edited"
            except _Failure as failure:
                if failure.status != 404:
                    raise
                log.info("comment %s on %s was deleted; looking for another", comment_id, ref.id)
        found = self._find_marked(ref, gh_issue, mark)
        if found is not None:
            if found.body == body:
                return found, "unchanged"
            self._call(ref, lambda: found.edit(body))
            return found, "edited"
        return self._call(ref, lambda: gh_issue.create_comment(body)), "created"

    def _sync_labels(self, ref: IssueRef, gh_issue: Any, wanted: str | None, managed: set[str]) -> list[str]:
        """Leave exactly one openlab state label (others' labels untouched); return the issue's labels."""
        current = [lb.name for lb in gh_issue.labels]
        for name in current:
            if name in managed and name != wanted:
                try:
                    self._call(ref, lambda n=name: gh_issue.remove_from_labels(n))
                except _Failure as failure:
                    if failure.status != 404:  # someone removed it already
                        raise
        if wanted and wanted not in current:
            self._call(ref, lambda: gh_issue.add_to_labels(wanted))
        kept = [n for n in current if n not in managed or n == wanted]
        return kept + ([wanted] if wanted and wanted not in kept else [])

    # -- the daily digest (orchestrator.links.digest renders it) -------------------------------------
    def publish_digest(self, digest: IssueDigest) -> IssueDigest:
        """Create, or edit, the issue's digest comment of ``digest.day``; sets its outcome and URL.

        Never raises for GitHub problems: they are recorded on the issue and queued (``digest``
        action), as for the card.
        """
        ref = parse_issue_ref(digest.issue_id)
        self._waited = 0.0
        try:
            self._publish_digest_one(ref, digest)
        except _Failure as failure:
            self._record_error(ref, failure.message)
            self._enqueue("digest", ref, None, failure, key=digest.day)
            digest.outcome = "queued" if failure.retryable else "failed"
            digest.error = failure.message
            suffix = "; queued for `openlab github sync`" if failure.retryable else ""
            log.warning("digest %s not posted on %s: %s%s", digest.day, ref.id, failure.message, suffix)
        return digest

    def _publish_digest_one(self, ref: IssueRef, digest: IssueDigest) -> None:
        from orchestrator.links.digest import digest_marker

        body_hash = digest.content_hash()
        rec = self._remember_digest(ref, digest)
        if rec.comment_id and rec.body_hash == body_hash:
            self._mark_done("digest", ref, None, key=digest.day)
            digest.outcome, digest.url = "unchanged", rec.url
            return  # nothing changed since the last post: spend no API calls
        if not self._token:
            raise self._missing_token()
        gh_issue = self._issue(ref)
        comment, outcome = self._upsert_comment(ref, gh_issue, rec.comment_id, digest_marker(digest.day), digest.body)
        rec = self._record_digest_comment(ref, digest, comment, body_hash)
        self._mark_done("digest", ref, None, key=digest.day)
        digest.outcome, digest.url = outcome, rec.url

    def _remember_digest(self, ref: IssueRef, digest: IssueDigest) -> GithubDigest:
        """Record the digest's window and runs before posting (a queued digest is sent for this window)."""
        from orchestrator.links.digest import digest_record_id

        did = digest_record_id(ref.id, digest.day)
        runs = [rd.run.id for rd in digest.runs]
        with self.store.transaction() as tx:
            rec = tx.get(GithubDigest, did)
            fields = {"window_start": digest.window.start, "window_end": digest.window.end, "pipeline_run_ids": runs}
            if rec is None:
                rec = tx.add(GithubDigest(id=did, issue_id=ref.id, day=digest.day, **fields))
                issue = tx.get(GithubIssue, ref.id)
                if issue is not None:
                    tx.relate("wasDerivedFrom", rec, issue, role="digest-on")
                return rec
            if rec.pipeline_run_ids != runs or as_utc(rec.window_end) != digest.window.end:
                rec = tx.update(rec, updated_at=utcnow(), **fields)
            return rec

    def _record_digest_comment(self, ref: IssueRef, digest: IssueDigest, comment: Any, body_hash: str) -> GithubDigest:
        """Record GitHub's id of the digest comment once it exists."""
        from orchestrator.links.digest import digest_record_id

        with self.store.transaction() as tx:
            rec = tx.get(GithubDigest, digest_record_id(ref.id, digest.day))
            if rec is None:  # recorded by _remember_digest a moment ago; it cannot have gone
                raise GithubLinkError(f"the digest record of {ref.id} {digest.day} vanished")
            return tx.update(
                rec, comment_id=int(comment.id), url=comment.html_url, body_hash=body_hash, updated_at=utcnow()
            )

    def published_anchors(self, pipeline_run_ids: Iterable[str] | None = None) -> PublishedAnchors:
        """The lineage anchors that run cards carry on GitHub, read back from GitHub: the copy that
        whoever controls the database cannot rewrite; and the cards that could not be read (not
        verified: a failure for an audit) or carry no anchor. Needs a token that can read the issues."""
        from orchestrator.lineage.verify import find_anchors

        if not self._token:
            raise GithubLinkError(f"reading the published anchors needs a GitHub token: set {self.config.token_env}")
        wanted = set(pipeline_run_ids) if pipeline_run_ids is not None else None
        client = self.client()
        found = PublishedAnchors()
        for rec in self.store.list(GithubComment, order_by=col(GithubComment.updated_at)):
            if rec.comment_id is None or (wanted is not None and rec.pipeline_run_id not in wanted):
                continue
            ref = parse_issue_ref(rec.issue_id)
            where = rec.url or f"{ref.id} comment {rec.comment_id}"
            comment_id = int(rec.comment_id)
            self._waited = 0.0
            issue = client.get_repo(ref.repo).get_issue(ref.number)  # lazy client: no request yet
            try:
                body = self._call(ref, lambda i=issue, c=comment_id: i.get_comment(c).body)
            except _Failure as failure:
                found.unreadable.append(f"{where}: the card of {rec.pipeline_run_id} cannot be read: {failure.message}")
                continue
            anchors = find_anchors(body or "", where=where)
            if not anchors:
                found.without_anchor.append(f"{where}: the card of {rec.pipeline_run_id} carries no lineage anchor")
            found.anchors.extend(anchors)
        return found

    def pending(self) -> list[GithubUpdate]:
        """Queued updates not yet sent (oldest first)."""
        return self.store.list(GithubUpdate, state="pending", order_by=col(GithubUpdate.created_at))

    def _resend_to_issue(self, entry: GithubUpdate, ref: IssueRef) -> None:
        """A queued update of an experiment issue: resolve it, its run's card, or its daily digest."""
        if entry.action == "resolve":
            self.resolve(ref)
        elif entry.action == "publish" and entry.pipeline_run_id:
            self.publish(entry.pipeline_run_id, issue_id=ref.id)
        elif entry.action == "digest":
            from orchestrator.links.digest import resend_digest

            day = entry.id.rsplit(":", 1)[-1]
            if resend_digest(self.store, ref.id, day, self) is None:  # its runs are gone: nothing to say
                self._mark_done("digest", ref, None, key=day)

    def _resend_nightly(self, entry: GithubUpdate) -> None:
        """A queued nightly report about a repository (its regression issue, the tested commit's
        status), rendered again from the verdict in lineage."""
        from orchestrator.links.regressions import report_verdict
        from orchestrator.links.statuses import report_status

        run_id = entry.pipeline_run_id or ""
        if self.store.get(PipelineRun, run_id) is None:  # the run was deleted: nothing to say
            self._mark_done(entry.action, IssueRef(entry.issue_id, 0), run_id, issue_id=entry.issue_id)
            return
        send = report_verdict if entry.action == "regression" else report_status
        send(self.store, run_id, linker=self)

    def sync(self) -> SyncReport:
        """Send every queued update whose rate-limit time has come; resolves before cards."""
        if not self._token:
            raise GithubLinkError(self._missing_token().message)
        report = SyncReport()
        now = utcnow()
        entries = sorted(self.pending(), key=lambda e: (e.action != "resolve", e.created_at))
        for entry in entries:
            not_before = as_utc(entry.not_before) if entry.not_before is not None else None
            if not_before is not None and not_before > now:
                report.deferred += 1
                continue
            if entry.action in NIGHTLY_ACTIONS:
                self._resend_nightly(entry)
            else:
                self._resend_to_issue(entry, parse_issue_ref(entry.issue_id))
            after = self.store.get(GithubUpdate, entry.id)
            state = after.state if after else "done"
            if state == "done":
                report.sent += 1
            else:
                report.failed += state == "failed"
                report.pending += state == "pending"
                if after and after.last_error:
                    report.errors.append(f"{entry.action} {entry.issue_id}: {after.last_error}")
        return report


# -- module-level API ---------------------------------------------------------------------------
def check_issue_option(ref: str, settings: Settings | None = None) -> IssueRef:
    """The experiment issue a run or sweep was asked to link, read before anything is recorded:
    a malformed reference (or ``#N`` without ``[github] repo``) is a typo to refuse in one line,
    not a FAILED run; whether the issue exists is for :func:`resolve_issue` once the run does."""
    config = GithubConfig.from_settings(settings)
    return parse_issue_ref(ref, config.repo, config.web_hosts[-1:])


def resolve_issue(
    store: LineageStore,
    ref: str | IssueRef,
    pipeline_run: PipelineRun | str | None = None,
    *,
    required: bool = False,
    settings: Settings | None = None,
    linker: GithubLinker | None = None,
) -> GithubIssue:
    """Resolve an experiment issue and relate it to the pipeline run (``wasAssociatedWith``).

    Call before any job starts: with ``required=True`` every problem (malformed ref, no
    token, 401/404/410, network, rate limit beyond the bound) raises
    :class:`GithubLinkError`; otherwise only a malformed ref raises, and problems are
    recorded on the issue and queued. ``[github] strict = true`` makes a closed or
    nonexistent issue an error too.
    """
    linker = linker or GithubLinker(store, settings=settings)
    return linker.resolve(ref, pipeline_run, required=required)


def publish_card(
    store: LineageStore,
    pipeline_run_id: str,
    *,
    settings: Settings | None = None,
    linker: GithubLinker | None = None,
) -> list[GithubComment]:
    """Create once, then edit, the run's card comment on each linked issue; maintain the state label.

    Safe to call on every stage transition: unchanged cards cost no API call, and
    GitHub problems are recorded and queued, never raised.
    """
    linker = linker or GithubLinker(store, settings=settings)
    return linker.publish(pipeline_run_id)


def sync_queue(
    store: LineageStore, *, settings: Settings | None = None, linker: GithubLinker | None = None
) -> SyncReport:
    """Flush queued GitHub updates (``openlab github sync``)."""
    linker = linker or GithubLinker(store, settings=settings)
    return linker.sync()


__all__ = [
    "GithubConfig",
    "GithubLinkError",
    "GithubLinker",
    "IssueRef",
    "SyncReport",
    "check_issue_option",
    "comment_record_id",
    "marker",
    "parse_issue_ref",
    "publish_card",
    "resolve_issue",
    "sync_queue",
]
