"""A toy three-stage pipeline in a scratch git repository, for fast pipeline tests.

Each stage is a tiny script under ``stages/`` that reads its JSON config, consumes its
input folder, writes its output folder and a ``metrics.json``, and appends one line to
``$TOY_LEDGER`` so tests can count real executions. ``make_repo`` builds the repository;
``toy_pipeline`` declares the DAG against it; ``python toy.py REPO`` runs it (used by
the two-process test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.pipeline import Pipeline, RunOptions, StageSpec, run_pipeline

COMMON = """
import json, os, sys, time
from pathlib import Path
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
cfg = json.loads(Path(args["--config"]).read_text())
out = Path(args["--out"]); out.mkdir(parents=True, exist_ok=True)
ledger = os.environ.get("TOY_LEDGER")
if ledger:
    with open(ledger, "a") as fh:
        fh.write(os.environ["OPENLAB_STAGE"] + " " + str(os.getpid()) + "\\n")
time.sleep(float(os.environ.get("TOY_SLEEP") or cfg.get("sleep", 0)))
"""

SCRIPTS = {
    "gen.py": COMMON
    + """
(out / "corpus.txt").write_text("\\n".join(f"line {i}" for i in range(cfg["n"])) + "\\n")
(out / "metrics.json").write_text(json.dumps({"lines": cfg["n"], "wall": time.time()}))
""",
    "upper.py": COMMON
    + """
text = (Path(cfg["inputs"]["corpus"]) / "corpus.txt").read_text()
(out / "upper.txt").write_text(text.upper())
(out / "metrics.json").write_text(json.dumps({"chars": len(text), "wall": time.time()}))
""",
    "count.py": COMMON
    + """
text = (Path(cfg["inputs"]["text"]) / "upper.txt").read_text()
print("step 1/1 counting")
(out / "count.json").write_text(json.dumps({"words": len(text.split())}))
(out / "metrics.json").write_text(json.dumps({"eval/loss": 1.5, "words": len(text.split()), "wall": time.time()}))
""",
}


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@e",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@e",
    }
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True, env=env).stdout


def make_repo(root: Path) -> Path:
    """A git repository with the three stage scripts committed."""
    repo = root / "toyrepo"
    (repo / "stages").mkdir(parents=True)
    for name, body in SCRIPTS.items():
        (repo / "stages" / name).write_text(body)
    (repo / "README").write_text("toy\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "toy stages")
    return repo


def toy_pipeline(repo: Path) -> Pipeline:
    """gen -> upper -> count, each declaring its own script as code."""

    def stage(name: str, script: str, inputs: dict[str, str]) -> StageSpec:
        return StageSpec(
            name=name,
            inputs=inputs,
            code_paths=(f"stages/{script}",),
            environment_fields=("python_version",),
            command=("{python}", f"stages/{script}", "--config", "{config}", "--out", "{out}"),
            snapshot_output=name == "gen",
        )

    return Pipeline(
        name="toy",
        stages=(
            stage("gen", "gen.py", {}),
            stage("upper", "upper.py", {"corpus": "gen"}),
            stage("count", "count.py", {"text": "upper"}),
        ),
        repo_root=repo,
    )


def toy_configs(sleep: float = 0.0, n: int = 5) -> dict[str, dict]:
    return {"gen": {"n": n, "sleep": sleep}, "upper": {"sleep": sleep}, "count": {"sleep": sleep}}


def main() -> int:
    repo = Path(sys.argv[1])
    sleep = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    start_at = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    while time.time() < start_at:
        time.sleep(0.005)
    result = run_pipeline(toy_pipeline(repo), toy_configs(sleep), options=RunOptions(wait_poll=0.1, lease_ttl=10))
    print(json.dumps(result.to_dict()))
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
