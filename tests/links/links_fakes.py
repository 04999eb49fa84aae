"""A fake GitHub REST API for the links tests (served by pytest-httpserver).

It speaks GitHub's REST JSON for the endpoints openlab uses, with every ``url`` field
pointing back at the local server (PyGithub follows them and checks the host). It keeps
state (issues, comments, labels), checks the token, pages comment lists with
``Link: rel="next"`` and can be scripted to fail a request with any status and headers.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

TOKEN = "ghp_SECRETtoken0123456789abcdefXYZ"


@dataclass
class Scripted:
    method: str
    pattern: re.Pattern[str]
    status: int
    body: Any
    headers: dict[str, str]
    times: int


@dataclass
class FakeGitHub:
    server: HTTPServer
    token: str = TOKEN
    issues: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    comments: dict[int, dict[str, Any]] = field(default_factory=dict)
    disabled: set[str] = field(default_factory=set)
    requests: list[tuple[str, str]] = field(default_factory=list)
    scripted: list[Scripted] = field(default_factory=list)
    page_size: int = 30
    next_id: int = 5_000_000_001  # above 2**32, as real comment ids are
    #: Commit statuses by sha, as posted; ``known_commits`` (when set) are the shas the repo has.
    statuses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    known_commits: set[str] | None = None

    def __post_init__(self) -> None:
        self.api = self.server.url_for("/api/v3").rstrip("/")
        self.web = self.server.url_for("/").rstrip("/")
        self.server.expect_request(re.compile(r"^/api/v3/.*")).respond_with_handler(self.handle)

    # -- state helpers -------------------------------------------------------------------------
    def add_issue(
        self, repo: str, number: int, title: str = "Experiment", state: str = "open", labels=(), body: str = ""
    ) -> None:
        self.issues[(repo, number)] = {
            "title": title,
            "state": state,
            "labels": list(labels),
            "body": body,
            "state_reason": None,
        }

    def issues_in(self, repo: str) -> list[dict[str, Any]]:
        """Every issue of ``repo`` as GitHub's JSON, oldest first."""
        return [self._issue(r, n) for (r, n) in sorted(self.issues) if r == repo]

    def add_comment(self, repo: str, number: int, body: str) -> int:
        cid = self.next_id
        self.next_id += 1
        self.comments[cid] = {"repo": repo, "number": number, "body": body}
        return cid

    def comments_on(self, repo: str, number: int) -> list[dict[str, Any]]:
        return [dict(c, id=i) for i, c in sorted(self.comments.items()) if (c["repo"], c["number"]) == (repo, number)]

    def fail(
        self, method: str, pattern: str, status: int, body: Any, headers: dict[str, str] | None = None, times: int = 1
    ) -> None:
        self.scripted.append(Scripted(method, re.compile(pattern), status, body, headers or {}, times))

    def count(self, method: str, pattern: str = "") -> int:
        return sum(1 for m, p in self.requests if m == method and re.search(pattern, p))

    # -- JSON shapes ---------------------------------------------------------------------------
    def _label(self, repo: str, name: str) -> dict[str, Any]:
        return {"name": name, "color": "ededed", "url": f"{self.api}/repos/{repo}/labels/{urllib.parse.quote(name)}"}

    def _issue(self, repo: str, number: int) -> dict[str, Any]:
        data = self.issues[(repo, number)]
        url = f"{self.api}/repos/{repo}/issues/{number}"
        return {
            "id": number,
            "number": number,
            "title": data["title"],
            "body": data.get("body") or None,
            "state": data["state"],
            "state_reason": data.get("state_reason"),
            "labels": [self._label(repo, n) for n in data["labels"]],
            "url": url,
            "comments_url": f"{url}/comments",
            "labels_url": f"{url}/labels{{/name}}",
            "repository_url": f"{self.api}/repos/{repo}",
            "html_url": f"{self.web}/{repo}/issues/{number}",
            "comments": len(self.comments_on(repo, number)),
        }

    def _comment(self, cid: int) -> dict[str, Any]:
        c = self.comments[cid]
        return {
            "id": cid,
            "body": c["body"],
            "url": f"{self.api}/repos/{c['repo']}/issues/comments/{cid}",
            "issue_url": f"{self.api}/repos/{c['repo']}/issues/{c['number']}",
            "html_url": f"{self.web}/{c['repo']}/issues/{c['number']}#issuecomment-{cid}",
            "user": {"login": "openlab-bot", "id": 1, "url": f"{self.api}/users/openlab-bot"},
        }

    # -- the handler ---------------------------------------------------------------------------
    @staticmethod
    def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
        return Response(json.dumps(body), status=status, headers=headers or {}, content_type="application/json")

    def handle(self, request: Request) -> Response:
        path = request.path[len("/api/v3") :]
        method = request.method
        self.requests.append((method, request.full_path.rstrip("?")))
        if request.headers.get("Authorization") != f"token {self.token}":
            return self._json(401, {"message": "Bad credentials", "documentation_url": "https://docs.github.com"})
        for s in self.scripted:
            if s.times > 0 and s.method == method and s.pattern.search(path):
                s.times -= 1
                return self._json(s.status, s.body, s.headers)
        m = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues/(\d+)(/.*)?", path)
        if m:
            repo, number, rest = m.group(1), int(m.group(2)), m.group(3) or ""
            if repo in self.disabled:
                return self._json(410, {"message": "Issues are disabled for this repo"})
            if (repo, number) not in self.issues:
                return self._json(404, {"message": "Not Found"})
            return self._issue_route(request, repo, number, rest)
        m = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues", path)
        if m:
            return self._repo_issues(request, m.group(1))
        m = re.fullmatch(r"/repos/([^/]+/[^/]+)/statuses/([0-9a-f]{7,40})", path)
        if m and method == "POST":
            sha = m.group(2)
            if self.known_commits is not None and sha not in self.known_commits:
                return self._json(422, {"message": f"No commit found for SHA: {sha}"})
            data = request.get_json()
            posted = {k: data.get(k) for k in ("state", "target_url", "description", "context")}
            self.statuses.setdefault(sha, []).append(posted)
            return self._json(
                201, {"id": len(self.statuses[sha]), "url": f"{self.api}/repos/{m.group(1)}/statuses/{sha}", **posted}
            )
        m = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues/comments/(\d+)", path)
        if m:
            cid = int(m.group(2))
            if cid not in self.comments:
                return self._json(404, {"message": "Not Found"})
            if method == "PATCH":
                self.comments[cid]["body"] = request.get_json()["body"]
            return self._json(200, self._comment(cid))
        return self._json(404, {"message": "Not Found"})

    def _repo_issues(self, request: Request, repo: str) -> Response:
        """``GET /repos/R/issues`` (``state``, ``labels`` filters; one page: tests stay small) and
        ``POST /repos/R/issues`` (title, body, labels)."""
        if repo in self.disabled:
            return self._json(410, {"message": "Issues are disabled for this repo"})
        if request.method == "POST":
            data = request.get_json()
            if not data.get("title"):
                return self._json(
                    422, {"message": "Validation Failed", "errors": [{"field": "title", "code": "missing"}]}
                )
            number = max([n for (r, n) in self.issues if r == repo], default=0) + 1
            self.add_issue(repo, number, data["title"], labels=data.get("labels") or [], body=data.get("body") or "")
            return self._json(201, self._issue(repo, number))
        state = request.args.get("state", "open")
        wanted = [w for w in request.args.get("labels", "").split(",") if w]
        found = [
            i
            for i in self.issues_in(repo)
            if (state == "all" or i["state"] == state) and all(w in [lb["name"] for lb in i["labels"]] for w in wanted)
        ]
        return self._json(200, list(reversed(found)))  # newest first, as GitHub sorts by default

    def _issue_route(self, request: Request, repo: str, number: int, rest: str) -> Response:
        method = request.method
        issue = self.issues[(repo, number)]
        if rest == "" and method == "GET":
            return self._json(200, self._issue(repo, number))
        if rest == "" and method == "PATCH":
            data = request.get_json()
            if "state" in data and data["state"] not in ("open", "closed"):
                return self._json(
                    422, {"message": "Validation Failed", "errors": [{"field": "state", "code": "invalid"}]}
                )
            for key in ("title", "body", "state", "state_reason"):
                if key in data:
                    issue[key] = data[key]
            return self._json(200, self._issue(repo, number))
        if rest == "/comments" and method == "GET":
            page = int(request.args.get("page", "1"))
            items = self.comments_on(repo, number)
            chunk = items[(page - 1) * self.page_size : page * self.page_size]
            headers = {}
            last = max(1, -(-len(items) // self.page_size))
            if page < last:
                base = f"{self.api}/repos/{repo}/issues/{number}/comments"
                headers["Link"] = f'<{base}?page={page + 1}>; rel="next", <{base}?page={last}>; rel="last"'
            return self._json(200, [self._comment(c["id"]) for c in chunk], headers)
        if rest == "/comments" and method == "POST":
            body = request.get_json()["body"]
            if len(body) > 65536:
                return self._json(422, {"message": "Validation Failed", "errors": [{"message": "body is too long"}]})
            cid = self.add_comment(repo, number, body)
            return self._json(201, self._comment(cid))
        if rest == "/labels" and method == "POST":
            data = request.get_json()
            names = data["labels"] if isinstance(data, dict) else data
            for name in names:
                if name not in issue["labels"]:
                    issue["labels"].append(name)
            return self._json(200, [self._label(repo, n) for n in issue["labels"]])
        if rest.startswith("/labels/") and method == "DELETE":
            name = urllib.parse.unquote(rest[len("/labels/") :])
            if name not in issue["labels"]:
                return self._json(404, {"message": "Label does not exist"})
            issue["labels"].remove(name)
            return self._json(200, [self._label(repo, n) for n in issue["labels"]])
        return self._json(404, {"message": "Not Found"})
