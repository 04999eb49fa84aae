"""Experiment issue references: ``owner/repo#N``, ``#N`` (default repo) or an issue URL."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.errors import OpenlabError


class GithubLinkError(OpenlabError):
    """A GitHub link cannot be made: bad reference, token, permission or issue."""


#: ``owner/name`` as GitHub allows them.
REPO_PATTERN = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/[A-Za-z0-9._-]{1,100}"
_REF = re.compile(rf"^(?P<repo>{REPO_PATTERN})?#(?P<number>[0-9]+)$")
_URL = re.compile(
    rf"^https?://(?P<host>[^/\s]+)/(?P<repo>{REPO_PATTERN})/(?:issues|pull)/(?P<number>[0-9]+)/?(?:[#?].*)?$"
)


@dataclass(frozen=True)
class IssueRef:
    """One issue: ``repo`` is ``owner/name``; :attr:`id` is the lineage id."""

    repo: str
    number: int

    @property
    def id(self) -> str:
        return f"{self.repo}#{self.number}"

    def __str__(self) -> str:
        return self.id


def parse_issue_ref(ref: str, default_repo: str | None = None, hosts: Sequence[str] | None = None) -> IssueRef:
    """Parse ``owner/repo#N``, ``#N`` (needs ``default_repo``, i.e. ``[github] repo``) or an issue URL,
    whose host must be one of ``hosts`` where given (the GitHub openlab talks to): an Enterprise
    issue's URL with github.com configured named ``owner/repo#N`` on github.com, another issue.

    Raises :class:`GithubLinkError` with one line saying what is wrong, so a typo is
    caught before any job starts rather than discovered when the card is posted.
    """
    text = (ref or "").strip()
    m = _REF.match(text) or _URL.match(text)
    if not m:
        raise GithubLinkError(
            f"malformed issue reference {ref!r}: use owner/repo#N, #N (with [github] repo set) or an issue URL"
        )
    host = (m.groupdict().get("host") or "").lower().removeprefix("www.").partition(":")[0]
    if host and hosts is not None and host not in hosts:
        raise GithubLinkError(
            f"issue {ref!r} is on {host}, and openlab's GitHub is {hosts[-1]}: set [github] base_url to "
            f"{host}'s API (https://{host}/api/v3), or give the issue as owner/repo#N"
        )
    number = int(m.group("number"))
    if number < 1:
        raise GithubLinkError(f"malformed issue reference {ref!r}: issue numbers start at 1")
    repo = m.group("repo")
    if repo is None:
        if not default_repo:
            raise GithubLinkError(
                f"issue reference {ref!r} names no repository and [github] repo is not set: "
                "write owner/repo#N or set [github] repo (or OPENLAB_GITHUB__REPO)"
            )
        if not re.fullmatch(REPO_PATTERN, default_repo):
            raise GithubLinkError(f"[github] repo {default_repo!r} is not owner/name")
        repo = default_repo
    return IssueRef(repo=repo, number=number)
