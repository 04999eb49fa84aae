"""The core CLI contracts scripts rely on, run as a real subprocess against real git repos and files."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from orchestrator.settings import KNOWN_SETTINGS, PATH_SETTINGS, load_settings


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@x",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@x",
    }
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q", "-b", "main")
    (root / "train.py").write_text("print('train')\n")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "first")
    return root


@pytest.fixture
def data(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    for i in range(5):
        (folder / f"f{i}.txt").write_text(f"row {i}\n" * 100)
    (folder / "sub" / "deep.bin").write_bytes(os.urandom(4096))
    return folder


def test_snapshot_json_contract_and_stability(run_cli, data: Path) -> None:
    first = run_cli("snapshot", str(data), "--json")
    assert first.returncode == 0, first.stderr
    snap = json.loads(first.stdout)
    assert snap["files"] == 6
    assert snap["bytes"] == sum(p.stat().st_size for p in data.rglob("*") if p.is_file())
    again = json.loads(run_cli("snapshot", str(data), "--json").stdout)
    assert again["id"] == snap["id"]
    (data / "f0.txt").write_text("changed\n")
    assert json.loads(run_cli("snapshot", str(data), "--json").stdout)["id"] != snap["id"]


def test_provenance_json_contract(run_cli, repo: Path) -> None:
    clean = run_cli("provenance", str(repo), "--json", cwd=repo)
    assert clean.returncode == 0, clean.stderr
    info = json.loads(clean.stdout)
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert info["git"]["commit"] == head
    assert info["git"]["dirty"] is False
    assert info["git"]["patch_hash"] is None
    assert len(info["environment"]["packages_hash"]) == 64
    (repo / "train.py").write_text("print('edited')\n")
    dirty = json.loads(run_cli("provenance", str(repo), "--json", cwd=repo).stdout)
    assert dirty["git"]["dirty"] is True and dirty["git"]["patch_hash"]


def test_asking_what_would_be_recorded_or_run_writes_nothing(run_cli, repo: Path, openlab_home: Path) -> None:
    """`provenance` ("nothing is written"), `explain` and `sweep --dry-run` on a fresh home: they left
    the dirty patch's blob and an empty lineage database behind, at a mistyped OPENLAB_HOME too."""
    (repo / "train.py").write_text("print('edited')\n")
    assert run_cli("provenance", str(repo), cwd=repo).returncode == 0
    plan = run_cli("explain", "marin-535b-a23b", "-r", "tiny")
    assert plan.returncode == 0 and "no earlier completed run of this stage" in plan.stdout, plan.stderr
    swept = run_cli("sweep", "marin-535b-a23b", "-r", "tiny", "-g", "seed=1,2", "--dry-run")
    assert swept.returncode == 0 and "nothing is started or recorded" in swept.stdout, swept.stderr
    assert sorted(p.name for p in openlab_home.iterdir()) == ["openlab.toml"]  # the test's own empty config


def test_provenance_outside_git_warns_not_crashes(run_cli, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    result = run_cli("provenance", str(plain), "--json", cwd=plain)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["git"]["available"] is False
    # said once, as a line; Python's warning format said it a second time with a source file and line
    assert result.stderr == f"{plain}: no git; provenance records no git commit or patch\n", result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("snapshot", "/no/such/path"),
        ("lineage", "show", "srun_doesnotexist"),
        ("lineage", "list", "--kind", "bogus"),
        ("lineage", "verify", "--anchor", "12:not-a-hash"),
        # a typo in a forced stage would quietly reuse the stage meant to re-run
        ("explain", "marin-535b-a23b", "--force-stage", "pretrian"),
        ("run", "marin-535b-a23b", "--replica", "drops-tiny", "--force-stage", "pretrain"),
        # a misspelt --set key would run the recipe's value under a name that says otherwise
        ("run", "marin-535b-a23b", "--replica", "tiny", "--set", "pretrain.lrr=0.02"),
        ("explain", "marin-535b-a23b", "--replica", "tiny", "--set", "pretrain.lr"),
        ("adopt", "marin-535b-a23b", "/tmp", "--stage", "data", "--set", "resources.default.cpus=4"),
        # what the command line parser refuses, too: an option, a command, a value, an argument
        ("run", "marin-535b-a23b", "--dry-run"),
        ("lineage", "lst"),
        ("lineage", "list", "--limit", "many"),
        ("run",),
    ],
)
def test_bad_input_is_one_line_exit_2(run_cli, args: tuple[str, ...]) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1


def test_forcing_a_stage_this_run_leaves_out_says_so_not_that_there_is_no_such_stage(run_cli) -> None:
    """`--until pretrain --force-stage eval` said "no such stage in pipeline moe-replica": eval is a stage,
    the --until leaves it out."""
    out = run_cli("explain", "marin-535b-a23b", "-r", "tiny", "--until", "pretrain", "--force-stage", "eval")
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: --force-stage 'eval': this run does not run it (an --until before it, or a replica without it); "
        "it runs data, tokenize, pretrain"
    ), out.stderr


def test_a_home_or_path_the_file_system_refuses_is_one_line_naming_it(run_cli, tmp_path: Path, data: Path) -> None:
    """OPENLAB_HOME naming a file (or a folder that cannot be made) and an export into one were
    tracebacks from mkdir; each is one line naming the path."""
    afile = tmp_path / "afile"
    afile.write_text("")
    home = {"OPENLAB_HOME": str(afile)}
    for args, code, want in (
        (("snapshot", str(data)), 2, f"error: cannot make the lineage database's folder {afile}: File exists; set "),
        (("run", "marin-535b-a23b", "-r", "tiny", "--until", "data"), 2, "error: cannot make the lineage database's"),
    ):
        out = run_cli(*args, env=home)
        assert out.returncode == code and out.stderr.startswith(want), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert run_cli("snapshot", str(data)).returncode == 0
    out = run_cli("lineage", "export", "--output", str(afile / "lineage.json"))
    assert out.returncode == 2 and out.stderr.strip() == (
        f"error: cannot write {afile / 'lineage.json'}: {afile}: File exists; give a file in a folder you can write"
    ), out.stderr


def test_an_empty_path_is_refused_not_read_as_the_folder_the_command_ran_in(run_cli, tmp_path: Path) -> None:
    """``Path("")`` is ``.``: a variable that expanded to nothing adopted (or with --move, moved) the
    working tree, snapshotted it, or wrote an export's temporary file into it."""
    for args in (
        ("adopt", "marin-535b-a23b", "-r", "tiny", "--stage", "data", ""),
        ("snapshot", ""),
        ("lineage", "which", ""),
        ("provenance", ""),
        ("wandb", "record", "srun_x", ""),
        ("job", "run", "--artifact-root", "", "--", "true"),
        ("lineage", "export", "-o", ""),
    ):
        out = run_cli(*args, cwd=tmp_path, timeout=60)
        assert out.returncode == 2 and "empty" in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and not out.stdout, (args, out.stdout, out.stderr)
    assert list(tmp_path.iterdir()) == [], "nothing was written where the command ran"
    (tmp_path / "f.txt").write_text("x")
    assert run_cli("snapshot", str(tmp_path / "f.txt")).returncode == 0  # a lineage database to look in
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # `lineage which` on it waited for a writer for ever
    out = run_cli("lineage", "which", str(fifo), timeout=60)
    assert (
        out.returncode == 2
        and out.stderr.strip()
        == f"error: {fifo}: not a regular file or folder (device, fifo or socket): no content to look up"
    ), out.stderr


def test_a_home_of_no_user_a_negative_tail_and_a_secret_in_an_error_are_one_clean_line(run_cli, tmp_path: Path) -> None:
    """``~nosuchuser/...`` quoted past the shell was a RuntimeError traceback (``OPENLAB_HOME``, a recipe, a
    snapshot), or a folder literally named ``~nosuchuser`` made where the command ran (``--artifact-root``);
    ``job logs --tail -5`` printed nothing and exit 0; an error quoting what was typed quoted a secret's
    value with it."""
    nobody = "~nosuchuser-openlab"
    for args, env in (
        (("lineage", "list"), {"OPENLAB_HOME": f"{nobody}/home"}),
        (("explain", f"{nobody}/recipe.yaml"), {}),
        (("snapshot", f"{nobody}/data"), {}),
        (("job", "run", "-q", "-b", "local", "--artifact-root", f"{nobody}/out", "--", "true"), {}),
    ):
        out = run_cli(*args, env=env, cwd=tmp_path, timeout=60)
        assert out.returncode == 2 and f"no such user here to expand {nobody} for" in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert list(tmp_path.iterdir()) == [], "no folder named ~nosuchuser made here"
    tail = run_cli("job", "logs", "att_whatever", "--tail", "-5", timeout=60)
    assert tail.returncode == 2 and "'--tail'" in tail.stderr, tail.stderr
    secret = "s3cret-value-typed-back"
    echoed = run_cli(
        "job", "run", "-b", "local", "--stage-run", f"x-{secret}", "--", "true", env={"MY_API_TOKEN": secret}
    )
    assert echoed.returncode != 0 and echoed.stderr.startswith("error: "), echoed.stderr
    assert secret not in echoed.stderr + echoed.stdout and "***" in echoed.stderr, echoed.stderr


def test_a_refused_name_says_the_names_there_are_even_when_there_are_none() -> None:
    """`lineage compare --sort nosuch` over runs that measured nothing ended "columns: ", as if cut off."""
    from orchestrator.errors import choices

    assert choices("nosuch", [], label="columns") == "columns: none"
    assert choices("slurmm", ["local", "slurm"]) == "did you mean 'slurm'? known: local, slurm"


def test_rerun_refuses_a_backend_before_it_says_what_it_would_run(run_cli) -> None:
    """`rerun RUN --dry-run -b nosuch` printed what it would rerun on 'nosuch', then the error."""
    out = run_cli("rerun", "prun_whatever", "--dry-run", "-b", "slurmm", timeout=60)
    assert out.returncode == 2 and out.stderr.strip().startswith(
        "error: --backend 'slurmm': not a backend; did you mean 'slurm'?"
    ), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_server_options_are_checked_before_a_server_starts(run_cli) -> None:
    """`server --limit -1` started Prefect, served every deployment, then died in two tracebacks;
    `--nightly-cron bogus` started and stopped a server before saying so."""
    zone = {"OPENLAB_PREFECT__NIGHTLY_TIMEZONE": "Europe/Berln"}
    for args, env, want in (
        (("server", "--limit", "-1"), {}, "error: --limit -1: give the most flow runs at once, 1 or more"),
        (("server", "--nightly-cron", "bogus"), {}, "error: invalid nightly cron 'bogus'"),
        (("server",), zone, "error: invalid time zone 'Europe/Berln' ([prefect] nightly_timezone): use an IANA name"),
        # the other schedules, which failed once the Prefect server had started and printed its UI
        (("server",), {"OPENLAB_PREFECT__GC_CRON": "nightly"}, "error: invalid cron 'nightly' ([prefect] gc_cron)"),
        (("server",), {"OPENLAB_PREFECT__RECONCILE_EVERY_S": "5"}, "error: invalid [prefect] reconcile_every_s 5"),
        (
            ("server",),
            {"OPENLAB_PREFECT__NIGHTLY_DROPS_CRON": "0 4 * * * *"},
            "error: invalid nightly cron '0 4 * * * *' ([prefect] nightly_drops_cron): use five fields",
        ),
    ):
        out = run_cli(*args, timeout=60, env=env)
        assert out.returncode == 2 and out.stderr.startswith(want), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and not out.stdout, (out.stdout, out.stderr)


def test_a_prefect_api_urls_password_is_not_printed(run_cli) -> None:
    """`--api-url http://ada:s3cret@host/api` (a proxy's basic auth) was echoed whole in the error, and
    would have been in the banner's export line and every deployment link."""
    for command in ("server", "deploy"):
        out = run_cli(command, "--api-url", "http://ada:s3cret@127.0.0.1:9/api", timeout=60)
        assert out.returncode == 2 and "s3cret" not in out.stderr + out.stdout, out.stderr
        assert out.stderr.startswith("error: no Prefect API answers at http://ada:***@127.0.0.1:9/api: "), out.stderr


def test_a_bad_port_or_stage_is_named_as_it_was_given(run_cli) -> None:
    """`server --port 99999` was an OverflowError traceback followed by "stopped"; `adopt --stage pretrian`
    was refused as "--until 'pretrian'", an option the person never typed."""
    for args, env, want in (
        (("server", "--port", "99999"), {}, "error: --port 99999: a port is a whole number from 1 to 65535"),
        (("server",), {"OPENLAB_PREFECT__PORT": "http"}, "error: [prefect] port 'http': a port is a whole number"),
        (
            ("adopt", "marin-535b-a23b", "-r", "tiny", "--stage", "pretrian", "/tmp"),
            {},
            "error: --stage 'pretrian': not a stage of this run; did you mean 'pretrain'?",
        ),
    ):
        out = run_cli(*args, env=env, timeout=60)
        assert out.returncode == 2 and out.stderr.startswith(want), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and not out.stdout, (out.stdout, out.stderr)


def test_a_misspelt_option_or_command_names_the_command_its_help_and_the_one_meant(run_cli) -> None:
    result = run_cli("lineage", "lst")
    assert result.stderr.strip() == (
        "error: openlab lineage: No such command 'lst'. Did you mean 'list'?; see openlab lineage --help"
    )
    result = run_cli("run", "marin-535b-a23b", "--stage", "pretrain")
    assert result.stderr.strip() == (
        "error: openlab run: No such option: --stage (Possible options: --force-stage, --set); see openlab run --help"
    )
    assert result.stdout == ""


def test_a_setting_nothing_reads_is_refused_where_it_was_written_naming_the_one_meant(
    run_cli, openlab_home: Path, tmp_path: Path
) -> None:
    """`[lineage] db_url` was read by nothing: lineage went on into SQLite while its author believed
    it was in PostgreSQL. A section or key openlab does not read is one line, exit 2, nothing written."""
    config = tmp_path / "typo.toml"
    for text, env, want in (
        (
            '[lineage]\ndb_url = "postgresql://lab@db/lineage"\n',
            {},
            f"error: {config}: [lineage] is not an openlab setting: settings: home, db_url, artifacts, backends,",
        ),
        (
            "[pipeline]\nstage_retry = 3\n",
            {},
            f"error: {config}: [pipeline] stage_retry: no such setting; did you mean 'stage_retries'?",
        ),
        ('artifacts = "/data"\n', {}, f"error: {config}: artifacts = '/data': artifacts is a table of settings"),
        ('backends = "slurm"\n', {}, f"error: {config}: backends = 'slurm': backends is a table of settings"),
        ("home = 5\n", {}, f"error: {config}: home = 5: give a path as text, in quotes"),
        ("[artifacts]\nroot = true\n", {}, f"error: {config}: [artifacts] root = True: give a path as text"),
        ("db_url = 5\n", {}, f"error: {config}: db_url = 5: give a database URL as text, in quotes"),
        (
            "",
            {"OPENLAB_GITHUB__MAX_WAIT": "5"},
            "error: OPENLAB_GITHUB__MAX_WAIT: [github] max_wait: no such setting; did you mean 'max_wait_s'?",
        ),
        # a value made a table by a variable: named, not "None:"; a variable that names nothing: no IndexError
        ("", {"OPENLAB_HOME__X": "1"}, "error: OPENLAB_HOME__X: home = {'x': 1}: give a path as text, in quotes"),
        ("", {"OPENLAB___": "1"}, "error: OPENLAB___ names no setting: write OPENLAB_SECTION__KEY"),
    ):
        config.write_text(text)
        for args in (("lineage", "list"), ("run", "marin-535b-a23b", "-r", "tiny", "--until", "data")):
            out = run_cli(*args, env={"OPENLAB_CONFIG": str(config), **env})
            assert out.returncode == 2 and out.stderr.startswith(want), out.stderr
            assert len(out.stderr.strip().splitlines()) == 1 and not out.stdout, out.stderr
    assert not (openlab_home / "lineage.db").exists(), "nothing was run or recorded"
    every = "".join(
        f"[{section}]\n"
        + "".join(
            f"{key} = {'{}' if key == 'labels' else repr(str(tmp_path)) if (section, key) in PATH_SETTINGS else '1'}\n"
            for key in sorted(keys)
        )
        for section, keys in KNOWN_SETTINGS.items()
        if keys is not None
    )
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "lab"\n')
    named = run_cli("lineage", "list", env={"OPENLAB_CONFIG": str(pyproject)})
    assert named.returncode == 2 and named.stderr == (
        f"error: OPENLAB_CONFIG names {pyproject}, which has no [tool.openlab] table: add one there, or name an "
        "openlab.toml\n"
    ), named.stderr
    pyproject.write_text('[project]\nname = "lab"\n\n[tool.openlab.pipeline]\nstage_retries = 2\n')
    folder = run_cli("lineage", "list", env={"OPENLAB_CONFIG": str(tmp_path)})
    assert folder.stderr == f"error: OPENLAB_CONFIG names {tmp_path}, which is a folder, not a file\n", folder.stderr
    # /dev/null is no settings at all (as GIT_CONFIG_GLOBAL=/dev/null is), not "does not exist"
    none = run_cli("snapshot", str(pyproject), env={"OPENLAB_CONFIG": "/dev/null"})
    assert none.returncode == 0 and "OPENLAB_CONFIG" not in none.stderr, none.stderr
    os.mkfifo(tmp_path / "config.pipe")  # any other pipe or device: refused, not read for ever
    piped = run_cli("lineage", "list", env={"OPENLAB_CONFIG": str(tmp_path / "config.pipe")}, timeout=30)
    assert piped.stderr == f"error: OPENLAB_CONFIG names {tmp_path / 'config.pipe'}, which is not a regular file\n"
    taken = run_cli("snapshot", str(pyproject), env={"OPENLAB_CONFIG": str(pyproject)})
    assert taken.returncode == 0, taken.stderr
    config.write_text(every)  # every setting openlab reads is taken (what each value must be is each one's to say)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("a")
    taken = run_cli("snapshot", str(tmp_path / "data"), env={"OPENLAB_CONFIG": str(config)})
    assert taken.returncode == 0, taken.stderr


def test_what_openlab_server_was_started_with_is_what_its_flow_runs_read_from_the_repository_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`OPENLAB_HOME=.openlab openlab server` from /tmp/x: the server used /tmp/x/.openlab, and the flow
    runs it started in the repository's root read `.openlab` there, and found the repository's own
    openlab.toml, if any: another home, another backend. The server pins them, absolute, for its children."""
    from orchestrator.settings import load_settings, pin_environment

    started_in = tmp_path / "x"
    started_in.mkdir()
    (started_in / "openlab.toml").write_text('[backends]\ndefault = "slurm"\n')
    monkeypatch.delenv("OPENLAB_CONFIG", raising=False)
    monkeypatch.setenv("OPENLAB_HOME", ".openlab")
    server = load_settings(cwd=started_in)
    assert server.home == started_in / ".openlab" and server.config_path == started_in / "openlab.toml"
    pin_environment(server)
    assert os.environ["OPENLAB_HOME"] == str(started_in / ".openlab")
    assert os.environ["OPENLAB_CONFIG"] == str(started_in / "openlab.toml")
    child = load_settings(cwd=tmp_path)  # where a flow run starts: elsewhere
    assert (child.home, child.config_path, child.default_backend) == (server.home, server.config_path, "slurm")


def test_a_relative_home_is_the_folder_it_named_where_it_was_given(
    run_cli, openlab_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`OPENLAB_HOME=lab` was kept relative: the stage's job, which runs in the repository root, looked
    for its config under the repository's `lab/` and failed, and a command from another folder would
    have opened an empty store. A relative home (and artifacts root, and SQLite file) is the folder it
    names from where it was written, the working directory for a variable, the file's folder for a
    setting in a file, and every later command that names that folder finds what was recorded."""
    work = tmp_path / "work"
    work.mkdir()
    ran = run_cli("run", "marin-535b-a23b", "-r", "tiny", "--until", "data", env={"OPENLAB_HOME": "lab"}, cwd=work)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    home = work / "lab"
    assert [p.name for p in (home / "artifacts").iterdir()] == ["data"], "the job wrote under the home it was given"
    listed = run_cli("lineage", "list", "--kind", "pipeline_run", "--json", env={"OPENLAB_HOME": str(home)})
    assert [r["state"] for r in json.loads(listed.stdout)] == ["COMPLETED"], listed.stdout + listed.stderr

    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    (project / "openlab.toml").write_text(
        'home = "state"\ndb_url = "sqlite:///state/other.db"\n[backends.slurm]\nlog_dir = "slurm-logs"\n'
    )
    (project / "data.txt").write_text("a")
    from_sub = {"OPENLAB_HOME": "", "OPENLAB_CONFIG": "", "OPENLAB_PREFECT__HOME": "2026"}  # a folder, as written
    snap = run_cli("snapshot", "../data.txt", "--json", env=from_sub, cwd=project / "sub")
    assert snap.returncode == 0, snap.stderr
    assert json.loads(snap.stdout)["manifest_path"].startswith(f"{project}/state/snapshots/"), snap.stdout
    again = run_cli("lineage", "list", "--kind", "snapshot", "--json", env=from_sub, cwd=project)
    assert len(json.loads(again.stdout)) == 1, "the store in the file's folder, from the file's own folder too"
    assert (project / "state" / "other.db").is_file() and not (project / "sub" / "state").exists()
    # sbatch writes a relative log_dir from the job's folder (the repository), openlab read it from its own
    monkeypatch.delenv("OPENLAB_CONFIG")
    slurm = load_settings(cwd=project / "sub", environ={}).section("backends.slurm")
    assert slurm["log_dir"] == str(project / "slurm-logs")


def test_a_misspelt_backend_is_named_where_the_given_environment_wrote_it(tmp_path: Path) -> None:
    """``load_settings(environ=...)`` (a served flow run's environment, not this process's) names the
    variable that wrote ``[backends.slrum]``: the check read ``os.environ`` and blamed the file."""
    from orchestrator.errors import ConfigError

    (tmp_path / "openlab.toml").write_text('[backends]\ndefault = "local"\n')
    environ = {"OPENLAB_BACKENDS__SLRUM__PARTITION": "gpu", "OPENLAB_HOME": str(tmp_path / "home")}
    with pytest.raises(ConfigError) as raised:
        load_settings(tmp_path, environ=environ)
    assert str(raised.value).startswith(
        "OPENLAB_BACKENDS__SLRUM__PARTITION: [backends.slrum] is not a backend: did you mean 'slurm'?"
    ), raised.value
    environ["OPENLAB_BACKENDS__DEFAULT"] = "dokcer"
    del environ["OPENLAB_BACKENDS__SLRUM__PARTITION"]
    with pytest.raises(ConfigError, match=r"^OPENLAB_BACKENDS__DEFAULT: \[backends\] default = 'dokcer' is not a"):
        load_settings(tmp_path, environ=environ)
    assert load_settings(tmp_path, environ={"OPENLAB_HOME": str(tmp_path)}).default_backend == "local"
    (tmp_path / "lab.toml").write_text('[backends]\ndefault = "slurm"\n')  # the file it names, not this process's
    named = load_settings(
        tmp_path, environ={"OPENLAB_HOME": str(tmp_path), "OPENLAB_CONFIG": str(tmp_path / "lab.toml")}
    )
    assert (named.default_backend, named.config_path) == ("slurm", tmp_path / "lab.toml")


def test_every_documented_setting_is_one_openlab_reads() -> None:
    """The `[section] key` settings the README and the docstrings name are all in KNOWN_SETTINGS:
    documenting a new one without it would refuse the very setting the docs tell a person to write."""
    root = Path(__file__).resolve().parents[2]
    texts = [root / "README.md", *root.glob("orchestrator/**/*.py"), *root.glob("flows/**/*.py")]
    named = {
        (m[0], m[1])
        for path in texts
        for m in re.findall(r"\[(artifacts|pipeline|prefect|github|wandb)\] `?([a-z_]+)", path.read_text())
        if m[1] != "setting"  # "invalid [github] setting: ..." is a message, not a key
    }
    assert len(named) > 15, named
    unknown = sorted(f"[{s}] {k}" for s, k in named if k not in (KNOWN_SETTINGS[s] or ()))
    assert not unknown, unknown


def test_verify_reports_data_drift_and_tampering(run_cli, data: Path, openlab_home: Path) -> None:
    snap = json.loads(run_cli("snapshot", str(data), "--json").stdout)
    ok = run_cli("lineage", "verify", "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    report = json.loads(ok.stdout)
    assert report == {"ok": True, "problems": [], "anchors": [], "notes": [], "head": report["head"]}
    assert report["head"].startswith("1:")  # the snapshot's record, the log's one event: the anchor to publish

    (data / "f1.txt").write_text("drifted\n")
    drift = run_cli("lineage", "verify", "--json")
    assert drift.returncode == 1
    report = json.loads(drift.stdout)
    assert report["ok"] is False
    assert any(p["record"] == f"snapshot:{snap['id']}" and "f1.txt" in p["message"] for p in report["problems"])


def test_verify_into_a_pipe_its_reader_closed_exits_as_a_piped_command_does_not_as_problems_found(
    data: Path, openlab_home: Path
) -> None:
    """`openlab lineage verify | head -1` in a script with `set -o pipefail`: verify's exit status 1
    means "problems found", and a closed pipe gave that same 1 (rich and typer's own handling), so
    the script read a sound log as a broken one. A reader gone is 141, as for cat (128 + SIGPIPE)."""
    import signal
    import sys

    def into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first line: every write fails, not just some
        try:
            return subprocess.run(
                [sys.executable, "-m", "orchestrator.cli.main", *args],
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
        finally:
            os.close(write)

    subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.main", "snapshot", str(data)], check=True, capture_output=True
    )
    for sound_or_not in ("sound", "drifted"):
        for args in (("lineage", "verify"), ("lineage", "verify", "--json"), ("lineage", "list")):
            closed = into_closed_pipe(*args)
            assert (closed.returncode, closed.stderr) == (128 + signal.SIGPIPE, ""), (sound_or_not, args)
        (data / "f1.txt").write_text("drifted\n")
    # the same drifted log into a reader that stays: 1, problems found, as before
    kept = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "lineage", "verify"], capture_output=True)
    assert kept.returncode == 1


def test_verify_names_commits_that_vanished(run_cli, repo: Path, openlab_home: Path) -> None:
    from orchestrator.lineage import open_store
    from orchestrator.lineage.record import record_git
    from orchestrator.provenance import capture

    (repo / "train.py").write_text("print('dirty')\n")
    store = open_store()
    with store.transaction() as tx:
        commit = record_git(tx, capture(repo).git)
    assert commit.dirty and commit.patch_hash
    assert run_cli("lineage", "verify").returncode == 0
    # Rewrite history so the recorded commit no longer exists, and lose the patch blob.
    _git(repo, "checkout", "-q", "--orphan", "other")
    _git(repo, "commit", "-qam", "rewritten")
    _git(repo, "branch", "-D", "main")
    _git(repo, "reflog", "expire", "--expire=now", "--all")
    _git(repo, "gc", "-q", "--prune=now")
    (openlab_home / "blobs" / commit.patch_hash).unlink()
    report = json.loads(run_cli("lineage", "verify", "--json").stdout)
    messages = [p["message"] for p in report["problems"] if p["record"] == f"commit:{commit.id}"]
    assert any("no longer exists" in m for m in messages)
    assert any("patch" in m and "missing" in m for m in messages)


def test_show_list_and_diff(run_cli, openlab_home: Path) -> None:
    from orchestrator.identity import compute_identity
    from orchestrator.lineage import PipelineRun, StageRun, open_store

    store = open_store()
    a = compute_identity("pretrain", {"steps": 10}, inputs={"tokens": "t1"})
    b = compute_identity("pretrain", {"steps": 20}, inputs={"tokens": "t1"})
    with store.transaction() as tx:
        run = tx.add(PipelineRun(recipe="r", replica="tiny", backend="local"))
        s1 = tx.add(StageRun(pipeline_run_id=run.id, stage="pretrain", identity=a.digest, identity_fields=a.fields()))
        s2 = tx.add(StageRun(pipeline_run_id=run.id, stage="pretrain", identity=b.digest, identity_fields=b.fields()))
        tx.relate("wasInformedBy", s1, run)
    listed = json.loads(run_cli("lineage", "list", "--json").stdout)
    assert {r["id"] for r in listed} >= {run.id, s1.id, s2.id}
    shown = json.loads(run_cli("lineage", "show", s1.id[:12], "--json").stdout)
    assert shown["record"]["identity"] == a.digest
    assert shown["relations"][0]["object_id"] == run.id
    diff = json.loads(run_cli("lineage", "diff", s1.id, s2.id, "--json").stdout)
    assert diff["changes"]["pretrain"] == [{"path": "config.steps", "old": 10, "new": 20}]


def test_show_prints_nested_fields_one_leaf_a_line_and_takes_the_related_ids_it_prints(
    run_cli, openlab_home: Path
) -> None:
    """An auditor reads a stage's identity fields and metrics in ``lineage show``: nested values are
    indented blocks, not one ``{'config': {...}}`` line; a recorded command reads as a shell line
    that gives back the same words; and the ``kind:id`` a relation is printed as opens that record."""
    import shlex

    from orchestrator.identity import compute_identity
    from orchestrator.lineage import Attempt, Environment, StageRun, open_store

    moe = {"dispatch": "pooled_wave", "ranks": 4, "capacity_factor": 1.15, "transport_capacity_factor": 1.15}
    config = {"moe": {**moe, "waves": 3, "chunks": 2, "qb": True}, "train": {"mixture": {"code": 0.3, "prose": 0.7}}}
    metrics = {f"layer_{i}/routing_entropy": 1.8627980947494507 + i for i in range(4)}
    ident = compute_identity("midtrain", config, inputs={"tokens": "t" * 64})
    command = ["python", "-m", "workloads.moe", "midtrain", "--out", "/data/run 1/out"]
    with open_store() as store, store.transaction() as tx:
        stage = tx.add(
            StageRun(
                stage="midtrain",
                identity=ident.digest,
                identity_fields=ident.fields(),
                metrics={"train/loss": 5.316871643066406, **metrics},
            )
        )
        used = {"max_rss_bytes": 2**30, "cpu_seconds": 3.71}
        attempt = tx.add(Attempt(stage_run_id=stage.id, number=1, backend="local", command=command, used=used))
        env = tx.add(
            Environment(id="e" * 64, python="CPython 3.11.7", platform="Linux", hostname="h", packages_hash="p")
        )
        tx.relate("wasAssociatedWith", stage, env, role="environment")
    shown = run_cli("lineage", "show", stage.id, env={"COLUMNS": "100"})
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "{'" not in out, out  # no Python dict repr anywhere
    assert re.search(r"^ {4}config$", out, re.M) and re.search(r"^ {6}moe$", out, re.M), out
    assert re.search(r"^ {8}capacity_factor\s+1\.15$", out, re.M), out
    assert re.search(r"^ {8}mixture\s+code=0\.3, prose=0\.7$", out, re.M), out  # a short mapping stays on one line
    assert re.search(r"^ {4}train/loss\s+5\.31687$", out, re.M), out  # six significant digits for people
    recorded = json.loads(run_cli("lineage", "show", stage.id, "--json").stdout)["record"]["metrics"]
    assert recorded["train/loss"] == 5.316871643066406  # the JSON keeps every digit
    assert f"\nattempts\n  {attempt.id}  #1 local PENDING\n" in out, out  # its jobs, which no relation lists
    as_json = json.loads(run_cli("lineage", "show", stage.id, "--json").stdout)
    assert as_json["attempts"] == [{"id": attempt.id, "summary": "#1 local PENDING"}]
    related = re.search(r"wasAssociatedWith -> (environment:\S+) environment\n {6}python CPython 3.11.7 on h", out)
    assert related, out  # the related record's id, and under it what it is
    opened = run_cli("lineage", "show", related.group(1))
    assert opened.returncode == 0 and opened.stdout.startswith(f"environment {env.id}"), opened.stdout + opened.stderr
    wrong_kind = run_cli("lineage", "show", f"commit:{env.id}")
    assert wrong_kind.returncode == 2 and f"'commit:{env.id}'" in wrong_kind.stderr, wrong_kind.stderr

    job = run_cli("lineage", "show", attempt.id).stdout.splitlines()
    line = next(x for x in job if x.startswith("  command"))
    assert shlex.split(line.split(None, 1)[1]) == command
    assert "  used            peak memory 1.00 GiB, 3.7 CPU-seconds" in job  # as `job status` says it


def test_diff_of_two_pipeline_runs_says_what_went_in_differently_and_how_the_results_moved(
    run_cli, openlab_home: Path
) -> None:
    """Last night's run against tonight's: per stage, in pipeline order, the identity fields that
    differ and, with --metric, the metrics that moved (a reused stage compares with the metrics of
    the run it reused, so it reads as unchanged rather than as missing)."""
    from orchestrator.identity import compute_identity
    from orchestrator.lineage import PipelineRun, StageRun, open_store

    tok = compute_identity("tokenize", {"vocab": 512})
    old_pt = compute_identity("pretrain", {"lr": 0.01}, inputs={"tokens": tok.digest})
    new_pt = compute_identity("pretrain", {"lr": 0.02}, inputs={"tokens": tok.digest})
    done = {"eval": {"code": {"loss": 5.25}}, "moe/drop_fraction": 0.031, "train/loss": 5.0}
    moved = {"eval": {"code": {"loss": 5.5}}, "moe/drop_fraction": 0.045, "train/loss": 5.0, "new/x": 1.0}
    with open_store() as store, store.transaction() as tx:
        night1 = tx.add(PipelineRun(recipe="r", replica="tiny", backend="local"))
        night2 = tx.add(PipelineRun(recipe="r", replica="tiny", backend="local"))

        def stage(run: PipelineRun, ident: Any, **kw: Any) -> StageRun:
            fields = {"identity": ident.digest, "identity_fields": ident.fields()}
            return tx.add(StageRun(pipeline_run_id=run.id, stage=ident.stage, **fields, **kw))

        t1 = stage(night1, tok, state="COMPLETED", metrics={"tokens": 1000})  # what a reuse takes: a completed run
        stage(night1, old_pt, state="COMPLETED", metrics=done)
        evaluated = compute_identity("eval", {}, inputs={"model": old_pt.digest})
        stage(night1, evaluated, state="COMPLETED", metrics=done)  # night 2 stopped before it
        stage(night2, tok, state="REUSED", reused_from=t1.id)  # no metrics of its own: t1's are its
        stage(night2, new_pt, state="COMPLETED", metrics=moved)
    shown = run_cli("lineage", "diff", night1.id, night2.id, "--metric", "eval/*/loss", "-m", "moe/*", "-m", "new/*")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "tokenize: identical" and lines[1] == "  metrics: none matches --metric", lines
    start = lines.index("pretrain: 1 field(s) differ")
    assert lines[start + 1 :] == [
        "  config.lr: 0.01 -> 0.02",
        "  metrics: 2 of 3 moved, 1 missing",  # a metric only one run reported has not moved: it is missing
        "    eval/code/loss     5.25 -> 5.5  (+0.25, +4.76%)",
        "    moe/drop_fraction  0.031 -> 0.045  (+0.014, +45.16%)",
        f"    new/x              - -> 1  missing in {night1.id}",
        f"eval: only in {night1.id} (the other run did not run it: no metrics to compare)",
    ], lines
    # a misspelt pattern beside one that matches said "none matches" under stages, or nothing at all
    typo = run_cli("lineage", "diff", night1.id, night2.id, "-m", "eval/*/loss", "-m", "moe/drop_fractoin")
    assert typo.returncode == 2 and typo.stdout == "", typo.stdout
    assert typo.stderr.startswith(
        "error: -m moe/drop_fractoin: no metric of these runs matches; did you mean 'moe/drop_fraction'?"
    ), typo.stderr
    data = json.loads(run_cli("lineage", "diff", night1.id, night2.id, "-m", "*", "--json").stdout)
    assert data["changes"]["tokenize"] == [] and data["metrics"]["tokenize"] == []  # reused: the same numbers
    assert {c["metric"] for c in data["metrics"]["pretrain"]} == {"eval/code/loss", "moe/drop_fraction", "new/x"}
    drop = next(c for c in data["metrics"]["pretrain"] if c["metric"] == "moe/drop_fraction")
    assert drop["old"] == 0.031 and drop["new"] == 0.045 and abs(drop["relative"] - 0.014 / 0.031) < 1e-12
    shown = run_cli("lineage", "show", night2.id).stdout  # a run lists its stages, in the order they ran
    assert re.search(
        r"^stages\n  srun_\w+  tokenize REUSED identity=\w+ \(reused srun_\w+\)\n  srun_\w+  pretrain ", shown, re.M
    ), shown
    wrong = run_cli("lineage", "diff", night1.id, t1.id)
    assert wrong.returncode == 2 and "cannot diff a pipeline_run with a stage_run" in wrong.stderr, wrong.stderr


def test_diff_of_two_pipeline_runs_names_the_code_and_recipe_they_ran(run_cli, openlab_home: Path) -> None:
    """Two runs of the same values at different commits (or a dirty tree), or of an edited recipe file:
    ``lineage diff`` said only the values set, where ``lineage compare`` named the commits. Which code
    ran is the first thing an auditor asks."""
    from orchestrator.lineage import Commit, PipelineRun, open_store

    with open_store() as store, store.transaction() as tx:
        runs = []
        for sha, dirty, recipe_hash in (("a" * 40, "", "1" * 64), ("b" * 40, "+" + "c" * 40, "2" * 64)):
            params = {"recipe": {"recipe_hash": recipe_hash}}
            run = tx.add(PipelineRun(recipe="r", replica="tiny", backend="local", params=params))
            commit = tx.ensure(Commit(id=sha + dirty, sha=sha, repo_path="/repo", dirty=bool(dirty)))
            tx.relate("wasAssociatedWith", run, commit, role="code")
            runs.append(run)
    shown = run_cli("lineage", "diff", runs[0].id, runs[1].id)
    assert shown.returncode == 0, shown.stderr
    assert f"  commit: '{'a' * 12}' -> '{'b' * 12}+{'c' * 8}'" in shown.stdout, shown.stdout
    assert f"  recipe_hash: '{'1' * 12}' -> '{'2' * 12}'" in shown.stdout, shown.stdout


def test_diff_names_the_commits_that_touched_the_code_that_changed(run_cli, repo: Path) -> None:
    """Two runs whose pretrain code differs: the diff lists the commits between their commits that
    touched that file (where to bisect), and says so when no commit did (a dirty working tree)."""
    from orchestrator.identity import compute_identity
    from orchestrator.lineage import Commit, StageRun, open_store

    first = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "train.py").write_text("print('train, faster')\n")
    (repo / "notes.md").write_text("unrelated\n")
    _git(repo, "commit", "-qam", "train: a faster loop")
    _git(repo, "add", "notes.md")
    _git(repo, "commit", "-qm", "notes only")
    last = _git(repo, "rev-parse", "HEAD").strip()
    ids = []
    with open_store() as store, store.transaction() as tx:
        for sha, dirty, tree in ((first, "", "1" * 40), (last, "", "2" * 40), (last, "+p1", "3" * 40)):
            ident = compute_identity("pretrain", {"lr": 0.01}, code={"train.py": tree})
            run = tx.add(StageRun(stage="pretrain", identity=ident.digest, identity_fields=ident.fields()))
            commit = tx.ensure(Commit(id=sha + dirty, sha=sha, repo_path=str(repo), dirty=bool(dirty)))
            tx.relate("wasAssociatedWith", run, commit, role="code")
            ids.append(run.id)
    shown = run_cli("lineage", "diff", ids[0], ids[1])
    assert shown.returncode == 0, shown.stderr
    assert f"  commits touching that code, {first[:12]}..{last[:12]}:\n" in shown.stdout, shown.stdout
    listed = shown.stdout.split("commits touching that code")[1].splitlines()[1:]
    assert [line.split(None, 1)[1] for line in listed] == ["train: a faster loop"], shown.stdout  # not "notes only"
    as_json = json.loads(run_cli("lineage", "diff", ids[0], ids[1], "--json").stdout)
    assert [c["subject"] for c in as_json["code_commits"]["pretrain"]["commits"]] == ["train: a faster loop"]
    dirty = run_cli("lineage", "diff", ids[1], ids[2]).stdout
    assert f"no commit {last[:12]}..{last[:12]} touches that code: it changed in an uncommitted working tree" in dirty
    # the later run on the older commit (a checkout back, a branch without it): the change was undone,
    # not made in a working tree, and old..new alone lists nothing
    back = run_cli("lineage", "diff", ids[1], ids[0]).stdout
    assert f"  undone (in {last[:12]}, not in {first[:12]}):\n" in back, back
    assert [line.split(None, 1)[1] for line in back.split("undone (")[1].splitlines()[1:]] == ["train: a faster loop"]
    assert "commits touching that code" not in back and "uncommitted working tree" not in back, back
    as_json = json.loads(run_cli("lineage", "diff", ids[1], ids[0], "--json").stdout)
    assert [c["subject"] for c in as_json["code_commits"]["pretrain"]["undone"]] == ["train: a faster loop"]


def test_a_path_in_hand_finds_what_made_it(run_cli, openlab_home: Path, tmp_path: Path) -> None:
    """ "Which run made this checkpoint?" asked with the file: a file inside a recorded output folder
    finds that output (over a snapshot of the same folder), a job's log file finds the job, and a
    path nothing was recorded at is the usual one-line miss."""
    from orchestrator.lineage import Artifact, Attempt, DataSnapshot, StageRun, open_store

    out = tmp_path / "artifacts" / "pretrain" / "abc"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.pt").write_bytes(b"weights")
    log = tmp_path / "logs" / "local-1.log"
    log.parent.mkdir()
    log.write_text("step 1/1\n")
    with open_store() as store, store.transaction() as tx:
        stage = tx.add(StageRun(stage="pretrain", identity="i-path", state="COMPLETED"))
        made = tx.add(Artifact(name="pretrain/out", artifact_type="folder", uri=str(out), content_hash="c" * 64))
        tx.relate("wasGeneratedBy", made, stage, role="out")
        tx.add(DataSnapshot(id="s" * 64, path=str(out), files=1, bytes=7, manifest_path="/m.json"))
        job = tx.add(Attempt(stage_run_id=stage.id, backend="local", job_id="local-1", log_path=str(log)))
    for asked, cwd in ((str(out / "checkpoint" / "state.pt"), None), ("checkpoint/state.pt", out), (str(out), None)):
        shown = run_cli("lineage", "show", asked, "--json", cwd=cwd)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["record"]["id"] == made.id, (asked, shown.stdout)
    traced = run_cli("lineage", "trace", str(out / "checkpoint" / "state.pt"))
    assert f"wasGeneratedBy (out) stage_run {stage.id}" in traced.stdout, traced.stdout
    assert json.loads(run_cli("lineage", "show", str(log), "--json").stdout)["record"]["id"] == job.id
    stray = tmp_path / "elsewhere.bin"
    stray.write_bytes(b"x")
    missed = run_cli("lineage", "show", str(stray))
    assert missed.returncode == 2 and missed.stderr.startswith(f"error: no lineage record with id '{stray}'")


def test_which_finds_the_output_that_held_a_copied_file_by_its_content(
    run_cli, openlab_home: Path, tmp_path: Path
) -> None:
    """A checkpoint copied and renamed for a release still leads back to the output that had it
    (and from there to what made it); a folder copied whole is matched whole; content nothing
    recorded is one line and exit 2."""
    import shutil

    from orchestrator.lineage import Artifact, StageRun, open_store
    from orchestrator.snapshots import snapshot

    out = tmp_path / "artifacts" / "pretrain" / "abc"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.pt").write_bytes(os.urandom(4096))
    (out / "notes.txt").write_text("trained\n")
    snap = snapshot(out)
    with open_store() as store, store.transaction() as tx:
        stage = tx.add(StageRun(stage="pretrain", identity="i-which", state="COMPLETED"))
        made = tx.add(Artifact(name="pretrain/out", artifact_type="folder", uri=str(out), content_hash=snap.id))
        tx.relate("wasGeneratedBy", made, stage, role="out")
    release = tmp_path / "release" / "model-v1.pt"
    release.parent.mkdir()
    shutil.copy(out / "checkpoint" / "state.pt", release)
    shown = run_cli("lineage", "which", str(release))
    assert shown.returncode == 0, shown.stderr
    assert f"artifact {made.id} holds it as checkpoint/state.pt" in shown.stdout, shown.stdout
    assert f"what made it: openlab lineage trace {made.id}" in shown.stdout, shown.stdout
    as_json = json.loads(run_cli("lineage", "which", str(release), "--json").stdout)
    assert as_json["holders"] == [
        {"content_hash": snap.id, "entry": "checkpoint/state.pt", "records": [{"kind": "artifact", "id": made.id}]}
    ]
    copied = tmp_path / "copy"
    shutil.copytree(out, copied)
    assert f"artifact {made.id} holds it\n" in run_cli("lineage", "which", str(copied)).stdout
    stray = tmp_path / "other.pt"
    stray.write_bytes(b"not a recorded checkpoint")
    missed = run_cli("lineage", "which", str(stray))
    assert missed.returncode == 2 and missed.stderr.count("\n") == 1 and "no recorded output holds" in missed.stderr


def test_recorded_text_is_printed_as_recorded_not_as_markup(run_cli, openlab_home: Path) -> None:
    """`[rank 3]` in an error or `[WIP]` in a commit subject is data: the audit output must not eat it."""
    from orchestrator.lineage import Commit, StageRun, open_store

    error = "[rank 3] CUDA out of memory; see [bold]log[/bold]"
    subject = "[WIP] try [red]top-k[/red] routing"
    with open_store() as store, store.transaction() as tx:
        stage = tx.add(StageRun(stage="pretrain", identity="i-markup", state="FAILED", error=error))
        tx.add(Commit(id="c0ffee" * 6 + "abcd", sha="c0ffee" * 6 + "abcd", message=subject))
    shown = run_cli("lineage", "show", stage.id)
    assert shown.returncode == 0, shown.stderr
    assert error in shown.stdout
    listed = run_cli("lineage", "list", "--kind", "commit")
    assert "[WIP]" in listed.stdout and "[red]top-k[/red]" in listed.stdout, listed.stdout  # the table may wrap it


def test_a_bad_retry_setting_stops_a_run_before_anything_is_recorded(run_cli, openlab_home: Path) -> None:
    bad = run_cli("run", "marin-535b-a23b", "--replica", "tiny", env={"OPENLAB_PIPELINE__STAGE_RETRIES": "lots"})
    assert bad.returncode == 2, bad.stdout
    assert bad.stderr.strip().splitlines() == [
        "error: invalid [pipeline] stage_retries 'lots': use a whole number, 0 or more (e.g. 1)"
    ]
    assert not (openlab_home / "lineage.db").exists()
    negative = run_cli("run", "marin-535b-a23b", "--replica", "tiny", "--retries", "-1")
    assert negative.returncode == 2 and "Traceback" not in negative.stderr


def test_a_value_set_on_the_command_line_runs_is_recorded_and_shown_and_is_reused_only_when_set_again(
    run_cli, openlab_home: Path
) -> None:
    """`openlab run --set`: the stage runs with the value, its summary and lineage card say so, the
    pipeline run records it apart from the recipe's values, `explain` with the same `--set` reuses
    the stage, and without it plans a run naming the field."""
    from orchestrator.cards import pipeline_card
    from orchestrator.lineage import LineageStore, PipelineRun, StageRun

    args = ("marin-535b-a23b", "--replica", "tiny", "--until", "data")
    ran = run_cli("run", *args, "--set", "data.max_bytes_per_domain=150000", "--json")
    assert ran.returncode == 0, ran.stderr
    doc = json.loads(ran.stdout)
    assert doc["recipe_lineage"]["run_set"] == {"data.max_bytes_per_domain": 150000}
    with LineageStore.open() as store:
        (run,) = store.list(PipelineRun)
        (data,) = store.list(StageRun, stage="data")
        assert run.params["recipe"]["run_set"] == {"data.max_bytes_per_domain": 150000}
        assert run.params["recipe"]["set"]["data.max_bytes_per_domain"] == 200000  # the replica's, as written
        assert data.identity_fields["config"]["data"]["max_bytes_per_domain"] == 150000
        assert "**Set for this run:** `` data.max_bytes_per_domain=150000 ``" in pipeline_card(store, run.id)

    again = json.loads(run_cli("explain", *args, "--set", "data.max_bytes_per_domain=150000", "--json").stdout)
    assert again["stages"][0]["action"] == "reuse" and again["stages"][0]["reused_from"] == data.id
    plain = json.loads(run_cli("explain", *args, "--json").stdout)["stages"][0]
    assert plain["action"] == "run" and any("150000 -> 200000" in c for c in plain["changes"]), plain

    shown = run_cli("run", *args, "--set", "data.max_bytes_per_domain=150000", env={"COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    assert "set for this run: data.max_bytes_per_domain=150000" in shown.stdout.splitlines(), shown.stdout
    listed = run_cli("lineage", "list", "--kind", "pipeline_run")  # which runs were the experiment
    assert " ".join(listed.stdout.split()).count("backend=local set data.max_bytes_per_domain=150000 user=") == 2

    # `lineage diff` names the value set once, as what the two runs were asked differently
    plain_run = json.loads(run_cli("run", *args, "--json").stdout)["pipeline_run_id"]
    with LineageStore.open() as store:
        first, second, third = (r.id for r in store.list(PipelineRun, order_by=PipelineRun.started_at))
    assert third == plain_run
    same = json.loads(run_cli("lineage", "diff", first, second, "--json").stdout)
    assert "run" not in same["changes"] and same["changes"]["data"] == []
    moved = json.loads(run_cli("lineage", "diff", second, third, "--json", "-m", "*").stdout)
    assert moved["changes"]["run"] == [{"path": "set.data.max_bytes_per_domain", "old": 150000, "new": None}]
    assert {"path": "config.data.max_bytes_per_domain", "old": 150000, "new": 200000} in moved["changes"]["data"]
    assert "run" not in moved["metrics"]
    text = run_cli("lineage", "diff", second, third, "-m", "*").stdout.splitlines()
    assert text[:2] == ["run: 1 field(s) differ", "  set.data.max_bytes_per_domain: 150000 -> None"], text

    # the RO-Crate of the experiment says what it set over its recipe: a setting of its run, an example of
    # the workflow's formal parameter of that name, read back by the rocrate library
    from rocrate.rocrate import ROCrate

    crate_dir = openlab_home / "crate"
    exported = run_cli("lineage", "export", first, second, "-f", "ro-crate", "-o", str(crate_dir))
    assert exported.returncode == 0, exported.stderr
    crate = ROCrate(crate_dir)
    for run_id in (first, second):
        settings = {p["name"]: p for p in crate.dereference(f"#{run_id}")["object"] if p.type == "PropertyValue"}
        assert settings["set data.max_bytes_per_domain"]["value"] == 150000, settings
        assert settings["replica"]["value"] == "tiny" and settings["backend"]["value"] == "local"
    param = settings["set data.max_bytes_per_domain"]["exampleOfWork"]
    assert param.type == "FormalParameter" and param["additionalType"] == "Integer"
    assert param.id in {i.id for i in crate.mainEntity["input"]}

    # a value that is a secret's (typed from the environment) is masked in what the terminal keeps
    masked = run_cli("run", *args, "--set", "data.max_bytes_per_domain=150000", env={"MY_API_KEY": "150000"})
    assert "set for this run: data.max_bytes_per_domain=***" in masked.stdout.splitlines(), masked.stdout
    assert "150000" not in masked.stdout


def test_run_at_a_terminal_shows_live_progress_and_the_summary(run_cli_tty, run_cli) -> None:
    """The display only a terminal gets (rich progress bars) must work: it is what people see first."""
    code, out = run_cli_tty("run", "marin-535b-a23b", "--replica", "drops-tiny", "--until", "tokenize")
    assert code == 0, out[-3000:]
    assert "Traceback" not in out
    assert "pipeline run prun_" in out and "COMPLETED" in out  # the summary table
    assert "tokenize" in out and "lineage: openlab lineage show prun_" in out
    host = re.escape(os.uname().nodename)  # each stage's job, and the cluster it ran on (a local job: this host)
    assert re.search(rf"local-[0-9a-f]{{12}} on {host}", out), out[-3000:]

    # 80 columns, or a pipe: a block per stage, its run ids whole (they are copied into lineage show)
    again = run_cli("run", "marin-535b-a23b", "--replica", "drops-tiny", "--until", "tokenize", env={"COLUMNS": "80"})
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, again.stdout
    header = next(line for line in lines if line.startswith("tokenize "))
    assert "REUSED" in header and re.search(r"srun_[0-9a-f]{20}  \d+\.\d\d s$", header), header
    # the command that compares it with the run before, whole on its line
    assert re.search(r"^  openlab lineage diff prun_[0-9a-f]{20} prun_[0-9a-f]{20}$", again.stdout, re.M), again.stdout
    assert any(re.search(r"^    identity [0-9a-f]{16} · reused from srun_[0-9a-f]{20}\s*$", line) for line in lines), (
        lines
    )


def test_explain_in_a_narrow_terminal_gives_each_stage_a_block_with_its_identity_whole(
    run_cli, openlab_home: Path
) -> None:
    """Six columns of prose cut identities and run ids in two at 80 characters (or in a pipe, which
    rich takes as 80): there each stage gets a block, with what changed one field per line."""
    planned = json.loads(run_cli("explain", "marin-535b-a23b", "--replica", "tiny", "--json").stdout)["stages"]
    out = run_cli("explain", "marin-535b-a23b", "--replica", "tiny", env={"COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, out.stdout
    for plan in planned:  # a header line per stage: name, action, the identity's first 16 digits whole
        header = next(line for line in lines if line.startswith(plan["stage"] + " "))
        assert plan["action"] in header and (plan["identity"] or "(after upstream)")[:16] in header, header
        assert "asks cpus=" in header, header  # the tiny replica says what each job asks for
    assert "no earlier completed run of this stage" in out.stdout
    wide = run_cli("explain", "marin-535b-a23b", "--replica", "tiny", env={"COLUMNS": "160"})
    assert "changed fields" in wide.stdout, "a wide terminal keeps the table"


def test_every_command_has_help_whose_paragraphs_the_terminal_wraps() -> None:
    """Every command's --help works, and a paragraph of its help is one line to the terminal,
    wrapped at its width, where the source's line breaks made 80 columns ragged."""
    import click
    import typer
    from click.testing import CliRunner

    from orchestrator.cli.main import _reflow_all, app, reflow

    assert (
        reflow("Run it.\n\nA long\nparagraph here.\n\n- one\n- two")
        == "Run it.\n\nA long paragraph here.\n\n- one\n- two"
    )
    root = _reflow_all(typer.main.get_command(app))

    def paths(command: click.Command, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        found = [prefix]
        for name, sub in getattr(command, "commands", {}).items():
            found += paths(sub, (*prefix, name))
        return found

    every = paths(root)
    assert ("job", "list") in every and ("lineage", "diff") in every and len(every) > 30
    for path in every:
        shown = CliRunner().invoke(root, [*path, "--help"], prog_name="openlab", terminal_width=80)
        assert shown.exit_code == 0, (path, shown.output)
        assert "Usage: openlab" in shown.output, (path, shown.output)
        assert "\\[" not in shown.output, (path, shown.output)  # escaped once, not shown escaped
        for text in _helps(root, path):  # a config section named in help reaches the reader
            for section in re.findall(r"\[([a-z][a-z_.]*)\]", text):
                if section not in _STYLES:
                    assert f"[{section}]" in shown.output, (path, section, shown.output)


_STYLES = {"bold", "dim", "red", "green", "yellow", "cyan", "magenta", "blue", "italic", "b", "i", "u"}


def _helps(root: Any, path: tuple[str, ...]) -> list[str]:
    """The help texts a command's --help renders: its own and each of its options' and arguments'.
    Rich reads ``[backends]`` as a style tag and drops it unless written ``\\[backends]``."""
    command = root
    for name in path:
        command = command.commands[name]
    return [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]


def test_compare_puts_a_sweeps_runs_side_by_side_with_what_each_set_and_measured(run_cli, openlab_home: Path) -> None:
    """`lineage compare`: one row a run, oldest first; the values that vary among them (each `--set`,
    the backend) and not those that do not; the metrics the patterns pick, a reused stage's through
    the run it reused; a metric two stages report under one name told apart by its stage."""
    import datetime as dt

    from orchestrator.lineage import LineageStore, PipelineRun, StageRun

    start = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    ids: list[str] = []
    evals: list[StageRun] = []
    with LineageStore.open() as store, store.transaction() as tx:
        for i, (lr, backend, loss) in enumerate(((0.01, "local", 5.5), (0.02, "slurm", 5.25), (0.02, "local", None))):
            run = tx.add(
                PipelineRun(
                    recipe="marin-535b-a23b",
                    replica="tiny",
                    backend=backend,
                    state="COMPLETED",
                    started_at=start + dt.timedelta(hours=i),
                    params={"recipe": {"run_set": {"pretrain.lr": lr}}},
                )
            )
            ids.append(run.id)
            at = start + dt.timedelta(hours=i, minutes=1)
            tx.add(  # post-training logs a metric of the same name as eval's
                StageRun(
                    pipeline_run_id=run.id,
                    stage="posttrain",
                    identity=f"p{i}",
                    state="COMPLETED",
                    metrics={"eval/sft/loss": 6.0 + i},
                    started_at=at,
                )
            )
            measured = {"eval/code/loss": loss, "eval/sft/loss": 5.0 + i, "eval/moe/drop_fraction": 0.1}
            evals.append(
                tx.add(
                    StageRun(
                        pipeline_run_id=run.id,
                        stage="eval",
                        identity=f"e{min(i, 1)}",
                        state="COMPLETED" if loss is not None else "REUSED",
                        metrics=measured if loss is not None else {},
                        # the third run's eval reused the second's: its numbers are read through it
                        reused_from=evals[1].id if loss is None else None,
                        started_at=at + dt.timedelta(minutes=1),
                    )
                )
            )

    doc = json.loads(run_cli("lineage", "compare", "--replica", "tiny", "-m", "*loss", "--json").stdout)
    assert [r["id"] for r in doc["runs"]] == ids  # oldest first
    assert doc["varies"] == ["set.pretrain.lr", "backend"]  # the recipe, replica and commit are the same
    labels = [c["label"] for c in doc["columns"]]  # pipeline order; a name two stages report says whose
    assert labels == ["posttrain:eval/sft/loss", "eval/code/loss", "eval:eval/sft/loss"], labels
    assert [r["asked"]["set.pretrain.lr"] for r in doc["runs"]] == [0.01, 0.02, 0.02]
    assert [r["metrics"]["eval"]["eval/code/loss"] for r in doc["runs"]] == [5.5, 5.25, 5.25]  # reused: read through
    assert [r["metrics"]["posttrain"]["eval/sft/loss"] for r in doc["runs"]] == [6.0, 7.0, 8.0]

    # STAGE:PATTERN picks one stage's; two runs given by id; the default is eval's losses
    picked = json.loads(run_cli("lineage", "compare", ids[0], ids[1], "-m", "eval:*sft*", "--json").stdout)
    assert [(c["stage"], c["label"]) for c in picked["columns"]] == [("eval", "eval/sft/loss")]
    assert [r["metrics"] for r in picked["runs"]] == [
        {"eval": {"eval/sft/loss": 5.0}},
        {"eval": {"eval/sft/loss": 6.0}},
    ]
    default = json.loads(run_cli("lineage", "compare", *ids, "--json").stdout)
    default_labels = ["eval/code/loss", "eval/sft/loss"]
    assert [c["label"] for c in default["columns"]] == default_labels

    best = json.loads(run_cli("lineage", "compare", *ids, "--sort", "eval/code/loss", "--json").stdout)
    assert [r["id"] for r in best["runs"]] == [ids[1], ids[2], ids[0]]  # the lowest loss first, ties as they came
    both = run_cli("lineage", "compare", *ids, "-m", "*loss", "--sort", "eval/sft/loss")
    said = "--sort 'eval/sft/loss': names two columns (posttrain:eval/sft/loss, eval:eval/sft/loss); give STAGE:METRIC"
    assert both.returncode == 2 and said in both.stderr, both.stderr
    by_stage = json.loads(
        run_cli("lineage", "compare", *ids, "-m", "*loss", "--sort", "posttrain:eval/sft/loss", "--json").stdout
    )
    assert [r["id"] for r in by_stage["runs"]] == ids  # 6, 7, 8

    wide = run_cli("lineage", "compare", "--replica", "tiny", env={"COLUMNS": "200"}).stdout.splitlines()
    header = next(line for line in wide if line.startswith("run "))
    assert header.split() == [
        "run",
        "started",
        "state",
        "set.pretrain.lr",
        "backend",
        "eval/code/loss",
        "eval/sft/loss",
    ]
    assert wide[-1].split() == [ids[2], "2026-12-01", "14:00", "COMPLETED", "0.02", "local", "5.25", "6"], wide
    narrow = run_cli("lineage", "compare", "--replica", "tiny", env={"COLUMNS": "80"}).stdout.splitlines()
    assert narrow[:5] == [
        f"{ids[0]}  2026-12-01 12:00  COMPLETED",
        "    set.pretrain.lr: 0.01",
        "    backend: local",
        "    eval/code/loss: 5.5",
        "    eval/sft/loss: 5",
    ], narrow

    for args, message in (
        ((), "error: give pipeline run ids, or filters that pick runs (e.g. --replica tiny --since 1d)"),
        (("--replica", "drops"), "error: no pipeline run matches these filters;"),  # a replica these runs are not
        (("--replica", "nope"), "error: --replica 'nope': no record or recipe has such a replica;"),
        (
            (ids[0], "-m", "eval/cod/loss"),
            "error: -m eval/cod/loss: no metric of these runs matches; did you mean 'eval/code/loss'?",
        ),
        (  # one misspelt beside one that matches: its column was dropped without a word
            (ids[0], "-m", "eval/code/loss", "-m", "eval/sft/los"),
            "error: -m eval/sft/los: no metric of these runs matches; did you mean 'eval/sft/loss'?",
        ),
    ):
        out = run_cli("lineage", "compare", *args)
        text = (out.stderr + out.stdout).strip()
        assert text.splitlines()[-1].startswith(message) and out.returncode == 2, text


def test_compare_of_runs_that_stopped_before_eval_shows_the_held_out_losses_of_their_last_stage(
    run_cli, openlab_home: Path
) -> None:
    """A sweep of a training value `--until pretrain` measured no eval: by default its runs are compared
    on the held-out losses pretrain logged, and the output says whose they are; patterns given are kept."""
    import datetime as dt

    from orchestrator.lineage import LineageStore, PipelineRun, StageRun

    start = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    ids = []
    with LineageStore.open() as store, store.transaction() as tx:
        for i, lr in enumerate((0.01, 0.02)):
            run = tx.add(
                PipelineRun(
                    recipe="marin-535b-a23b",
                    replica="tiny",
                    state="COMPLETED",
                    started_at=start + dt.timedelta(hours=i),
                    params={"recipe": {"run_set": {"pretrain.lr": lr}}},
                )
            )
            ids.append(run.id)
            for j, (stage, metrics) in enumerate(
                (
                    ("tokenize", {"tokens": 1000}),
                    ("pretrain", {"eval/code/loss": 5.5 - i, "train/loss": 5.0}),
                )
            ):
                tx.add(
                    StageRun(
                        pipeline_run_id=run.id,
                        stage=stage,
                        identity=f"{stage}{i}",
                        state="COMPLETED",
                        metrics=metrics,
                        started_at=start + dt.timedelta(hours=i, minutes=j),
                    )
                )

    doc = json.loads(run_cli("lineage", "compare", *ids, "--json").stdout)
    assert [(c["stage"], c["metric"]) for c in doc["columns"]] == [("pretrain", "eval/code/loss")]
    assert [r["metrics"]["pretrain"]["eval/code/loss"] for r in doc["runs"]] == [5.5, 4.5]
    assert "held-out losses pretrain measured" in doc["note"], doc["note"]
    text = run_cli("lineage", "compare", *ids, env={"COLUMNS": "200"}).stdout
    assert "the runs stopped before eval: these are the held-out losses pretrain measured" in text, text
    asked = run_cli("lineage", "compare", *ids, "-m", "eval:*", "--json")  # a pattern given is not replaced
    assert asked.returncode == 2 and asked.stderr.startswith("error: -m eval:*: no metric of these runs matches")


def test_compare_over_seeds_gives_each_setting_its_mean_and_spread(run_cli, openlab_home: Path) -> None:
    """`lineage compare --over seed`: a row per learning rate, its runs' losses as mean ± standard
    deviation, so a difference is read against the noise between seeds; sorted by the mean."""
    import datetime as dt
    import statistics

    from orchestrator.lineage import LineageStore, PipelineRun, StageRun

    start = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    losses = {(0.01, 0): 5.30, (0.01, 1): 5.34, (0.01, 2): 5.32, (0.02, 0): 5.20, (0.02, 1): None, (0.02, 2): 5.26}
    with LineageStore.open() as store, store.transaction() as tx:
        for i, ((lr, seed), loss) in enumerate(losses.items()):
            run = tx.add(
                PipelineRun(
                    recipe="marin-535b-a23b",
                    replica="tiny",
                    state="COMPLETED" if loss is not None else "FAILED",
                    started_at=start + dt.timedelta(minutes=i),
                    params={"recipe": {"run_set": {"pretrain.lr": lr, "seed": seed}}},
                )
            )
            tx.add(
                StageRun(
                    pipeline_run_id=run.id,
                    stage="eval",
                    identity=f"e{i}",
                    state=run.state,
                    metrics={"eval/code/loss": loss} if loss is not None else {},
                    started_at=run.started_at,
                )
            )

    doc = json.loads(run_cli("lineage", "compare", "--replica", "tiny", "--over", "seed", "--json").stdout)
    assert doc["over"] == ["set.seed"] and doc["varies"] == ["set.pretrain.lr"]
    first, second = doc["groups"]
    assert first["asked"] == {"set.pretrain.lr": 0.01} and len(first["runs"]) == 3
    spread = first["metrics"]["eval"]["eval/code/loss"]
    assert spread["n"] == 3 and spread["mean"] == pytest.approx(5.32)
    assert spread["stdev"] == pytest.approx(statistics.stdev([5.30, 5.34, 5.32]))
    assert second["metrics"]["eval"]["eval/code/loss"]["n"] == 2  # the failed run measured nothing

    best = json.loads(
        run_cli(
            "lineage", "compare", "--replica", "tiny", "--over", "seed", "--sort", "eval/code/loss", "--json"
        ).stdout
    )
    assert [g["asked"]["set.pretrain.lr"] for g in best["groups"]] == [0.02, 0.01]  # the lower mean first
    text = run_cli("lineage", "compare", "--replica", "tiny", "--over", "seed", env={"COLUMNS": "200"}).stdout
    assert "each metric: mean ± standard deviation over seed" in text, text
    (row,) = [line for line in text.splitlines() if line.lstrip().startswith("0.02")]
    assert row.split()[1:] == ["3", "5.23", "±", "0.042", "(n=2)"], row
    from orchestrator.cards import render_comparison
    from orchestrator.lineage.compare import DEFAULT_METRICS, compare_runs

    with LineageStore.open() as store:  # the UI sweep's artifact, taken over its seeds
        table = render_comparison(compare_runs(store, store.list(PipelineRun), DEFAULT_METRICS).over(["seed"]), "t")
    assert "| set.pretrain.lr | runs | eval/code/loss |" in table and "| 0.01 | 3 | 5.32 ± 0.02 |" in table, table
    assert "--over seed `` prints it again" in table, table
    bad = run_cli("lineage", "compare", "--replica", "tiny", "--over", "sed")
    assert (
        bad.returncode == 2
        and "--over 'sed': not a value that varies among these runs; did you mean 'seed'?" in bad.stderr
    )


def test_a_config_file_that_is_not_utf8_text_is_one_line_naming_it(run_cli, tmp_path: Path) -> None:
    """A config saved as UTF-16 (it starts \\xff\\xfe) was a `UnicodeDecodeError` traceback."""
    config = tmp_path / "bin.toml"
    config.write_bytes(b"\xff\xfe" + 'home = "/x"\n'.encode("utf-16-le"))
    out = run_cli("lineage", "list", env={"OPENLAB_CONFIG": str(config)})
    assert out.returncode == 2 and not out.stdout, out.stdout
    assert (
        out.stderr.strip()
        == f"error: {config}: not UTF-8 text (byte 0 is b'\\xff'): save it as UTF-8 text, as TOML must be"
    )
    found = tmp_path / "project" / "openlab.toml"  # found from the working directory, not named
    found.parent.mkdir()
    found.write_bytes(b'[artifacts]\nroot = "/data/caf\xe9"\n')
    out = run_cli("lineage", "list", env={"OPENLAB_CONFIG": ""}, cwd=found.parent)
    assert out.returncode == 2 and out.stderr.startswith(f"error: {found}: not UTF-8 text (byte 29 is b'\\xe9')"), (
        out.stderr
    )
