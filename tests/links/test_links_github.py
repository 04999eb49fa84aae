"""GitHub links against a local server speaking GitHub's REST JSON (PyGithub on the client side)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli.github import app as github_app
from orchestrator.lineage.models import GithubComment, GithubIssue, GithubUpdate, PipelineRun, Relation
from orchestrator.lineage.store import LineageStore
from orchestrator.links.github import (
    GithubLinker,
    GithubLinkError,
    comment_record_id,
    marker,
    parse_issue_ref,
    publish_card,
    resolve_issue,
)
from tests.links.links_fakes import TOKEN, FakeGitHub

ISSUE = "lab/exp#7"


def _finish(store: LineageStore, run: PipelineRun, **fields: object) -> None:
    with store.transaction() as tx:
        tx.update(tx.get(PipelineRun, run.id), **fields)


# -- references -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [("lab/exp#7", "lab/exp#7"), ("#12", "dflt/repo#12"), ("https://github.com/o-x/r.y/issues/3", "o-x/r.y#3")],
)
def test_parse_issue_ref_accepts_the_documented_forms(text: str, expected: str) -> None:
    assert parse_issue_ref(text, "dflt/repo").id == expected


def test_an_issue_url_on_another_github_than_openlabs_is_refused_not_read_as_one_here(tmp_path: Path) -> None:
    """An Enterprise issue's URL, with github.com configured, linked github.com's issue of that number."""
    from orchestrator.links.github import GithubConfig, check_issue_option
    from orchestrator.settings import load_settings

    empty = tmp_path / "openlab.toml"
    empty.write_text("")
    public = load_settings(environ={"OPENLAB_CONFIG": str(empty)})
    assert check_issue_option("https://www.github.com/lab/exp/issues/7", public).id == "lab/exp#7"
    with pytest.raises(GithubLinkError, match=r"is on ghe.lab.org, and openlab's GitHub is github.com: set \[github\]"):
        check_issue_option("https://ghe.lab.org/lab/exp/issues/7", public)
    enterprise = load_settings(
        environ={"OPENLAB_CONFIG": str(empty), "OPENLAB_GITHUB__BASE_URL": "https://ghe.lab.org/api/v3"}
    )
    assert GithubConfig.from_settings(enterprise).web_hosts[-1] == "ghe.lab.org"
    assert check_issue_option("https://ghe.lab.org/lab/exp/issues/7", enterprise).id == "lab/exp#7"
    with pytest.raises(GithubLinkError, match="is on github.com, and openlab's GitHub is ghe.lab.org"):
        check_issue_option("https://github.com/lab/exp/issues/7", enterprise)


@pytest.mark.parametrize("text", ["lab/exp", "lab/exp#", "#x", "lab#3", "lab/exp#7 extra", "", "a/b/c#1", "#0"])
def test_malformed_issue_ref_is_one_clear_line(text: str) -> None:
    with pytest.raises(GithubLinkError) as err:
        parse_issue_ref(text, "dflt/repo")
    assert "\n" not in str(err.value)
    assert "owner/repo#N" in str(err.value) or "start at 1" in str(err.value)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("base_url", "notaurl", "[github] base_url = 'notaurl': give the API's http(s) address"),
        ("base_url", "ftp://x", "[github] base_url = 'ftp://x': give the API's http(s) address"),
        ("timeout_s", "0", "[github] timeout_s = 0: give a number 1 or more (default 15)"),
        ("per_page", "0", "[github] per_page = 0: give a number from 1 to 100 (default 100)"),
        ("per_page", "101", "[github] per_page = 101: give a number from 1 to 100"),
        ("max_wait_s", "abc", "[github] max_wait_s = 'abc': give a number 0 or more (default 60)"),
        ("seconds_between_requests", "-1", "[github] seconds_between_requests = -1: give a number 0 or more"),
        ("strict", "maybe", "[github] strict = 'maybe': give true or false"),
        ("required", "maybe", "[github] required = 'maybe': give true or false"),
        ("commit_statuses", "maybe", "[github] commit_statuses = 'maybe': give true or false"),
        ("regression_issues", "maybe", "[github] regression_issues = 'maybe': give true or false"),
        ("repo", "5", "[github] repo = 5: give the repository as owner/name, in quotes"),
    ],
)
def test_a_bad_github_setting_is_one_line_naming_it(tmp_path: Path, key: str, value: str, message: str) -> None:
    """A base URL without a scheme was an AttributeError traceback, a timeout of 0 PyGithub's ValueError,
    ``per_page = 0`` an AssertionError; ``max_wait_s = abc`` named no setting; ``strict = maybe`` was
    taken as true."""
    from orchestrator.errors import ConfigError
    from orchestrator.links.github import GithubConfig
    from orchestrator.settings import load_settings

    (tmp_path / "openlab.toml").write_text("")
    env = {"OPENLAB_CONFIG": str(tmp_path / "openlab.toml"), f"OPENLAB_GITHUB__{key.upper()}": value}
    with pytest.raises(ConfigError) as caught:
        GithubConfig.from_settings(load_settings(environ=env))
    assert str(caught.value).startswith(message), caught.value
    env[f"OPENLAB_GITHUB__{key.upper()}"] = {"strict": "off", "required": "yes", "per_page": "100"}.get(key, "")
    GithubConfig.from_settings(load_settings(environ=env))  # a good value, or none: taken


def test_short_ref_without_default_repo_says_how_to_fix() -> None:
    with pytest.raises(GithubLinkError, match=r"\[github\] repo"):
        parse_issue_ref("#5", None)


# -- resolve ----------------------------------------------------------------------------------------
def test_resolve_records_issue_and_relates_it_to_the_run(fake_github: FakeGitHub, store, pipeline) -> None:
    issue = resolve_issue(store, "#7", pipeline)
    assert issue.id == ISSUE and issue.resolved and issue.last_error is None
    assert issue.title == "MoE replica: aux-loss-free routing"
    assert issue.state == "open" and issue.labels == ["experiment"]
    assert issue.url == f"{fake_github.web}/lab/exp/issues/7"
    rels = store.list(Relation, relation="wasAssociatedWith", subject_id=pipeline.id, object_id=ISSUE)
    assert len(rels) == 1
    assert store.list(GithubUpdate) == []


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        (lambda f: None, "not found (404)"),  # issue 99 does not exist
        (lambda f: f.disabled.add("lab/exp"), "issues are disabled on lab/exp (410 Gone)"),
        (lambda f: setattr(f, "token", "other"), "rejected the token in $GITHUB_TOKEN (401 Bad credentials)"),
    ],
    ids=["404", "410", "401"],
)
def test_resolve_errors_optional_warns_required_raises(
    fake_github: FakeGitHub, store, pipeline, caplog, setup, needle: str
) -> None:
    setup(fake_github)
    ref = "lab/exp#99" if "404" in needle else ISSUE
    with caplog.at_level(logging.WARNING):
        issue = resolve_issue(store, ref, pipeline)
    assert not issue.resolved and needle in (issue.last_error or "")
    assert needle in caplog.text
    with pytest.raises(GithubLinkError) as err:
        resolve_issue(store, ref, pipeline, required=True)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_resolve_retryable_error_is_queued_permanent_is_not(fake_github: FakeGitHub, store, pipeline) -> None:
    fake_github.token = "rotated"  # 401: a new token may fix it, so it waits in the queue
    resolve_issue(store, ISSUE, pipeline)
    fake_github.token = TOKEN
    resolve_issue(store, "lab/exp#99", pipeline)  # 404: retrying cannot help
    states = {u.issue_id: u.state for u in store.list(GithubUpdate)}
    assert states == {ISSUE: "pending", "lab/exp#99": "failed"}


def test_closed_issue_warns_and_strict_makes_it_an_error(
    fake_github: FakeGitHub, openlab_env: Path, store, pipeline, caplog
) -> None:
    fake_github.issues[("lab/exp", 7)]["state"] = "closed"
    with caplog.at_level(logging.WARNING):
        assert resolve_issue(store, ISSUE, pipeline).state == "closed"
    assert "lab/exp#7 is closed" in caplog.text
    openlab_env.write_text(openlab_env.read_text() + "strict = true\n")
    with pytest.raises(GithubLinkError, match="is closed"):
        resolve_issue(store, ISSUE, pipeline)
    with pytest.raises(GithubLinkError, match="not found"):
        resolve_issue(store, "lab/exp#99", pipeline)


def test_missing_token_records_unresolved_and_queues(
    fake_github: FakeGitHub, store, pipeline, monkeypatch, caplog
) -> None:
    monkeypatch.delenv("GITHUB_TOKEN")
    with caplog.at_level(logging.WARNING):
        issue = resolve_issue(store, ISSUE, pipeline)
    assert not issue.resolved and "no GitHub token: set GITHUB_TOKEN" in (issue.last_error or "")
    assert fake_github.requests == []
    with pytest.raises(GithubLinkError, match="no GitHub token"):
        resolve_issue(store, ISSUE, pipeline, required=True)


def test_token_env_names_another_variable(fake_github: FakeGitHub, openlab_env, store, pipeline, monkeypatch) -> None:
    monkeypatch.delenv("GITHUB_TOKEN")
    monkeypatch.setenv("GH_TOKEN_TEST", TOKEN)
    openlab_env.write_text(openlab_env.read_text() + 'token_env = "GH_TOKEN_TEST"\n')
    assert resolve_issue(store, ISSUE, pipeline).resolved


def test_github_token_is_no_fallback_for_an_enterprise_host() -> None:
    """With `token_env = "GHE_TOKEN"` unset and GITHUB_TOKEN (a github.com token) set, the github.com
    token was sent to the Enterprise host, and its 401 blamed $GHE_TOKEN, which held nothing."""
    from orchestrator.links.github import GithubConfig

    env = {"GITHUB_TOKEN": "gh-public"}
    enterprise = GithubConfig(base_url="https://ghe.lab.org/api/v3", token_env="GHE_TOKEN")
    assert enterprise.token(env) is None and enterprise.token_var(env) == "GHE_TOKEN"
    assert enterprise.token({**env, "GHE_TOKEN": "ghe"}) == "ghe"
    public = GithubConfig(token_env="LAB_TOKEN")
    assert public.token(env) == "gh-public" and public.token_var(env) == "GITHUB_TOKEN", "said as the one used"
    assert public.token_var({**env, "LAB_TOKEN": "lab"}) == "LAB_TOKEN"


# -- the card comment -------------------------------------------------------------------------------
def test_card_comment_created_once_then_edited_and_labels_follow_state(
    fake_github: FakeGitHub, store, pipeline
) -> None:
    resolve_issue(store, ISSUE, pipeline)
    [rec] = publish_card(store, pipeline.id)
    [c] = fake_github.comments_on("lab/exp", 7)
    assert rec.comment_id == c["id"] and c["body"].startswith(marker(pipeline.id))
    assert "tokenize" in c["body"] and "https://github.com/lab/exp/commit/abc1234def567890" in c["body"]
    assert fake_github.issues[("lab/exp", 7)]["labels"] == ["experiment", "openlab:running"]

    posts = fake_github.count("POST", "/comments")
    publish_card(store, pipeline.id)  # nothing changed: no API call at all
    assert fake_github.count("POST", "/comments") == posts and fake_github.count("PATCH") == 0

    _finish(store, pipeline, state="COMPLETED", verdict={"status": "passed", "loss_delta": -0.01})
    publish_card(store, pipeline.id)
    [c] = fake_github.comments_on("lab/exp", 7)
    assert fake_github.count("POST", "/comments$") == 1 and fake_github.count("PATCH") == 1
    assert "Nightly verdict:** passed" in c["body"]
    assert fake_github.issues[("lab/exp", 7)]["labels"] == ["experiment", "openlab:passed"]

    _finish(store, pipeline, verdict={"status": "regressed"})
    publish_card(store, pipeline.id)
    assert fake_github.issues[("lab/exp", 7)]["labels"] == ["experiment", "openlab:regressed"]
    assert len(fake_github.comments_on("lab/exp", 7)) == 1
    assert store.get(GithubIssue, ISSUE).labels == ["experiment", "openlab:regressed"]


def test_the_card_publishes_a_lineage_anchor_that_verify_reads_back_from_github(
    fake_github: FakeGitHub, store, pipeline, monkeypatch
) -> None:
    """The run card carries the event that recorded the run's start; `lineage verify --github-anchors`
    reads it back from GitHub (not from the database it checks) and so catches a log rewritten whole
    after the card was posted, which the chain alone cannot."""
    import json

    from orchestrator.cli.lineage import app as lineage_app
    from orchestrator.lineage.verify import Anchor, anchor_of, find_anchors
    from tests.core.forgery import rewrite_whole_log

    resolve_issue(store, ISSUE, pipeline)
    [rec] = publish_card(store, pipeline.id)
    anchor = anchor_of(store, pipeline.id)
    assert anchor is not None
    [c] = fake_github.comments_on("lab/exp", 7)
    assert f"`{anchor}`" in c["body"]
    published = GithubLinker(store).published_anchors()
    assert published.anchors == [Anchor(anchor.seq, anchor.hash, str(rec.url))]
    assert published.unreadable == [] and published.without_anchor == []

    # a card over GitHub's size limit (a sweep's thousands of values set) is cut in its middle: the
    # anchors, its last lines, stay, where a cut keeping the first 65,000 characters dropped them
    from orchestrator.lineage import PipelineRun
    from orchestrator.links.github import MAX_BODY

    many = {f"pretrain.layer_{i:05d}.scale": i for i in range(3000)}
    with store.transaction() as tx:
        run = tx.get(PipelineRun, pipeline.id) or pipeline
        tx.update(run, params={**(run.params or {}), "recipe": {"run_set": many}})
    long_card = GithubLinker(store).render_body(pipeline.id)
    assert len(long_card) <= MAX_BODY and "pretrain.layer_00000.scale=0" in long_card
    assert "\n\n_card truncated; `openlab lineage show` has the rest_\n\n**Lineage anchor:** " in long_card
    assert [a.seq for a in find_anchors(long_card, where="card")] == [anchor.seq], long_card[-600:]

    runner = CliRunner()
    report = json.loads(runner.invoke(lineage_app, ["verify", "--github-anchors", "--json"]).stdout)
    assert report["anchors"] == [{"anchor": str(anchor), "where": rec.url}] and report["notes"] == []
    assert not [p for p in report["problems"] if p["record"].startswith("anchor:")], report

    rewrite_whole_log(store, "pipeline_run", pipeline.id, backend="local")  # "it never ran on Slurm"
    result = runner.invoke(lineage_app, ["verify", "--github-anchors", "--json"])
    assert result.exit_code == 1
    (broken,) = [p for p in json.loads(result.stdout)["problems"] if p["record"].startswith("anchor:")]
    assert broken["record"] == f"anchor:{anchor.seq}" and str(rec.url) in broken["message"], broken
    assert not [p for p in json.loads(result.stdout)["problems"] if p["record"].startswith("event:")], (
        "the rewrite is consistent: only the anchor tells"
    )

    # a card someone edited the anchor out of is named, not silently passed
    fake_github.comments[c["id"]]["body"] = "edited by hand"
    published = GithubLinker(store).published_anchors()
    assert published.anchors == [] and len(published.without_anchor) == 1
    assert "carries no lineage anchor" in published.without_anchor[0]
    # and a card that cannot be read fails the audit: its anchor went unchecked
    del fake_github.comments[c["id"]]
    result = runner.invoke(lineage_app, ["verify", "--github-anchors", "--json"])
    (unread,) = [p for p in json.loads(result.stdout)["problems"] if p["record"] == "card"]
    assert result.exit_code == 1 and "cannot be read" in unread["message"], unread
    monkeypatch.delenv("GITHUB_TOKEN")
    with pytest.raises(GithubLinkError, match="needs a GitHub token"):
        GithubLinker(store).published_anchors()


def test_crash_between_create_and_record_never_duplicates(
    fake_github: FakeGitHub, store, pipeline, monkeypatch
) -> None:
    resolve_issue(store, ISSUE, pipeline)

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("process killed")

    with monkeypatch.context() as m:
        m.setattr(GithubLinker, "_record_comment", crash)
        with pytest.raises(RuntimeError):
            publish_card(store, pipeline.id)
    assert len(fake_github.comments_on("lab/exp", 7)) == 1
    assert store.get(GithubComment, comment_record_id(ISSUE, pipeline.id)) is None

    _finish(store, pipeline, state="FAILED")
    [rec] = publish_card(store, pipeline.id)
    [c] = fake_github.comments_on("lab/exp", 7)
    assert rec.comment_id == c["id"] and "FAILED" in c["body"]
    assert fake_github.count("POST", "/comments$") == 1


def test_deleted_comment_is_replaced_not_duplicated(fake_github: FakeGitHub, store, pipeline) -> None:
    resolve_issue(store, ISSUE, pipeline)
    [rec] = publish_card(store, pipeline.id)
    del fake_github.comments[rec.comment_id]
    _finish(store, pipeline, state="COMPLETED")
    [rec2] = publish_card(store, pipeline.id)
    assert [c["id"] for c in fake_github.comments_on("lab/exp", 7)] == [rec2.comment_id]
    assert rec2.comment_id != rec.comment_id


def test_marker_found_on_a_later_page(fake_github: FakeGitHub, store, pipeline) -> None:
    fake_github.page_size = 2
    for i in range(5):
        fake_github.add_comment("lab/exp", 7, f"discussion {i}")
    existing = fake_github.add_comment("lab/exp", 7, f"{marker(pipeline.id)}\nold card")
    fake_github.add_comment("lab/exp", 7, "later discussion")
    resolve_issue(store, ISSUE, pipeline)
    [rec] = publish_card(store, pipeline.id)
    assert rec.comment_id == existing
    assert fake_github.count("POST", "/comments$") == 0
    assert fake_github.count("GET", r"/comments\?page=3") == 1  # followed rel="next" to the third page
    assert "tokenize" in fake_github.comments[existing]["body"]
    assert len(fake_github.comments_on("lab/exp", 7)) == 7


def test_422_on_comment_is_recorded_not_raised(fake_github: FakeGitHub, store, pipeline, caplog) -> None:
    resolve_issue(store, ISSUE, pipeline)
    fake_github.fail(
        "POST",
        r"/comments$",
        422,
        {"message": "Validation Failed", "errors": [{"message": "body is too long (maximum is 65536)"}]},
    )
    with caplog.at_level(logging.WARNING):
        assert publish_card(store, pipeline.id) == []
    issue = store.get(GithubIssue, ISSUE)
    assert "422 Validation Failed; body is too long" in (issue.last_error or "")
    [entry] = store.list(GithubUpdate, action="publish")
    assert entry.state == "failed"
    assert "422" in caplog.text


# -- rate limits ----------------------------------------------------------------------------------
def _rate_limited(reset_in: float) -> dict[str, str]:
    return {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(time.time() + reset_in))}


def test_rate_limit_waits_as_headers_say_within_bound(fake_github: FakeGitHub, store, pipeline) -> None:
    waits: list[float] = []
    linker = GithubLinker(store, sleep=waits.append)
    fake_github.fail("GET", r"/issues/7$", 403, {"message": "API rate limit exceeded for user"}, _rate_limited(3))
    assert resolve_issue(store, ISSUE, pipeline, linker=linker).resolved
    assert len(waits) == 1 and 1 <= waits[0] <= 4
    fake_github.fail("POST", r"/comments$", 429, {"message": "slow down"}, {"Retry-After": "2"})
    assert publish_card(store, pipeline.id, linker=linker)
    assert waits[1:] == [2.0]


def test_rate_limit_beyond_bound_queues_then_sync_flushes(fake_github: FakeGitHub, store, pipeline) -> None:
    waits: list[float] = []
    linker = GithubLinker(store, sleep=waits.append)
    resolve_issue(store, ISSUE, pipeline, linker=linker)
    fake_github.fail("GET", r"/issues/7$", 403, {"message": "API rate limit exceeded"}, _rate_limited(3600))
    assert publish_card(store, pipeline.id, linker=linker) == []
    assert waits == []  # an hour is over max_wait_s = 5: no waiting at all
    [entry] = store.list(GithubUpdate, action="publish")
    assert entry.state == "pending" and entry.not_before is not None and "rate limit" in (entry.last_error or "")
    assert fake_github.comments_on("lab/exp", 7) == []
    report = linker.sync()
    assert report.deferred == 1 and report.sent == 0  # its reset time has not come
    with store.transaction() as tx:
        tx.session.get(GithubUpdate, entry.id).not_before = None
    assert linker.sync().sent == 1
    assert len(fake_github.comments_on("lab/exp", 7)) == 1


# -- the offline queue and `openlab github sync` --------------------------------------------------------
def test_offline_queue_flushed_by_cli_sync(fake_github: FakeGitHub, store, pipeline, monkeypatch) -> None:
    monkeypatch.delenv("GITHUB_TOKEN")
    resolve_issue(store, ISSUE, pipeline)
    assert publish_card(store, pipeline.id) == []
    _finish(store, pipeline, state="COMPLETED")
    publish_card(store, pipeline.id)  # coalesces into the same queued update
    assert fake_github.requests == []
    assert sorted((u.action, u.state) for u in store.list(GithubUpdate)) == [
        ("publish", "pending"),
        ("resolve", "pending"),
    ]
    runner = CliRunner()
    result = runner.invoke(github_app, ["sync"])
    assert result.exit_code == 2 and "no GitHub token" in result.stderr
    assert len(result.output.strip().splitlines()) == 1

    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    result = runner.invoke(github_app, ["sync"])
    assert result.exit_code == 0, result.output
    assert "2 sent" in result.output
    assert {u.state for u in store.list(GithubUpdate)} == {"done"}
    assert store.get(GithubIssue, ISSUE).resolved
    [c] = fake_github.comments_on("lab/exp", 7)
    assert "COMPLETED" in c["body"]
    assert fake_github.issues[("lab/exp", 7)]["labels"] == ["experiment", "openlab:passed"]
    result = runner.invoke(github_app, ["queue"])
    assert result.exit_code == 0 and "nothing queued" in result.output


def test_cli_sync_exits_2_when_updates_stay_queued(fake_github: FakeGitHub, store, pipeline) -> None:
    fake_github.token = "revoked"
    resolve_issue(store, ISSUE, pipeline)
    result = CliRunner().invoke(github_app, ["sync"])
    assert result.exit_code == 2
    assert "401 Bad credentials" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "0 sent, 1 still queued" in result.stdout


# -- secrets ------------------------------------------------------------------------------------------
def test_token_never_in_lineage_logs_or_comments(
    fake_github: FakeGitHub, openlab_env: Path, store, pipeline, caplog
) -> None:
    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="github"):
        resolve_issue(store, ISSUE, pipeline)
        publish_card(store, pipeline.id)
        fake_github.token = "changed"
        resolve_issue(store, ISSUE, pipeline)
        CliRunner().invoke(github_app, ["queue"])
    fake_github.token = TOKEN
    with caplog.at_level(logging.INFO):  # PyGithub's DEBUG log would show the body a server echoes
        fake_github.fail("GET", r"/issues/7$", 500, {"message": f"boom {TOKEN}"})
        _finish(store, pipeline, state="COMPLETED")
        publish_card(store, pipeline.id)
    assert fake_github.requests, "the scenario must have talked to the server"
    assert "(500 boom ***)" in (store.get(GithubIssue, ISSUE).last_error or "")
    assert any(r.name.startswith("github") for r in caplog.records), "PyGithub debug logs must be captured"
    assert TOKEN not in caplog.text
    store.close()
    home = Path(openlab_env.parent / "home")
    files = [p for p in home.rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert TOKEN.encode() not in path.read_bytes(), path
    for c in fake_github.comments.values():
        assert TOKEN not in c["body"]


def test_no_network_records_unresolved_and_queues(openlab_env: Path, store, pipeline, monkeypatch, caplog) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a proxy's password in the API's URL: masked in the issue's record and in the queue's alike
    url = f"http://bob:proxyPassw0rd@127.0.0.1:{port}/api/v3"
    openlab_env.write_text(f'[github]\nbase_url = "{url}"\nseconds_between_requests = 0\n')
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    with caplog.at_level(logging.WARNING):
        issue = resolve_issue(store, ISSUE, pipeline)
        for _stage_update in range(3):  # each stage's transition refreshes the card: the same outage each time
            assert publish_card(store, pipeline.id) == []
    said = f"cannot reach GitHub at http://bob:***@127.0.0.1:{port}/api/v3"
    assert not issue.resolved and said in (issue.last_error or ""), issue.last_error
    assert all(said in (u.last_error or "") for u in store.list(GithubUpdate)), store.list(GithubUpdate)
    warned = [r.getMessage() for r in caplog.records if "not posted on" in r.getMessage()]
    assert len(warned) == 1 and "queued for `openlab github sync`" in warned[0], warned  # said once, not per stage
    assert sorted((u.action, u.state) for u in store.list(GithubUpdate)) == [
        ("publish", "pending"),
        ("resolve", "pending"),
    ]
    with pytest.raises(GithubLinkError, match="cannot reach GitHub") as raised:
        resolve_issue(store, ISSUE, pipeline, required=True)
    # the cause in words, not urllib3's wrapping cut off at 200 characters
    assert str(raised.value).endswith("Connection refused (the issue link is required)"), raised.value
    assert "HTTPConnectionPool" not in str(raised.value) and "Max retries" not in str(raised.value)
