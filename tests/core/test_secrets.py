"""Secret values never survive into what openlab records or prints."""

from __future__ import annotations

import json

import pytest

from orchestrator.lineage.models import PipelineRun
from orchestrator.lineage.store import LineageStore
from orchestrator.secrets import is_credential_key, redact_mapping, redact_value, scrub, secret_values
from orchestrator.settings import load_settings


def test_secret_named_values_are_masked() -> None:
    env = {"GITHUB_TOKEN": "ghp_abcdef123456", "WANDB_API_KEY": "k" * 40, "LR": "0.1", "db_password": "hunter22"}
    assert redact_mapping(env) == {"GITHUB_TOKEN": "***", "WANDB_API_KEY": "***", "LR": "0.1", "db_password": "***"}


def test_scrub_removes_secret_values_from_text() -> None:
    env = {"GITHUB_TOKEN": "ghp_abcdef123456", "SHORT_KEY": "ab", "PATH": "/usr/bin"}
    values = secret_values(env)
    assert values == ["ghp_abcdef123456"]
    line = "auth failed for ghp_abcdef123456 on /usr/bin/git (ab)"
    assert scrub(line, values) == "auth failed for *** on /usr/bin/git (ab)"


def test_scrub_defaults_to_this_process(monkeypatch) -> None:
    monkeypatch.setenv("MY_SECRET", "s3cr3t-value")
    assert scrub("value=s3cr3t-value") == "value=***"


@pytest.mark.parametrize(
    ("key", "credential"),
    [
        ("wandb_api_key", True),
        ("GITHUB_TOKEN", True),
        ("githubToken", True),
        ("db-password", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("tokenizer", False),  # a training config's words are not credentials
        ("max_tokens", False),
        ("n_keys", False),
        ("monkey", False),
    ],
)
def test_credential_keys_are_whole_words(key: str, credential: bool) -> None:
    assert is_credential_key(key) is credential


def test_redact_value_masks_credential_strings_but_keeps_shapes() -> None:
    config = {"model": {"key_dim": 64, "tokenizer": "bpe-4096"}, "auth": [{"api_key": "abcdef123456"}]}
    assert redact_value(config, []) == {"model": {"key_dim": 64, "tokenizer": "bpe-4096"}, "auth": [{"api_key": "***"}]}


def test_the_store_never_writes_a_secret_into_records_or_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENLAB_DB_PASSWORD", "env-secret-999")
    with LineageStore.open(load_settings()) as store:
        with store.transaction() as tx:
            run = tx.add(
                PipelineRun(
                    name="leaky",
                    params={"github_token": "ghp_param_secret_1", "note": "cloned with ghp_param_secret_1"},
                    error="connect failed: password env-secret-999 rejected",
                )
            )
        with store.transaction() as tx:
            tx.update(tx.get(PipelineRun, run.id), params={"nested": {"WANDB_API_KEY": "wandb-secret-22"}})
        stored = store.require(PipelineRun, run.id)
        written = json.dumps([e.payload for e in store.events(run.id)]) + stored.model_dump_json()
    assert stored.error == "connect failed: password *** rejected"
    assert stored.params == {"nested": {"WANDB_API_KEY": "***"}}
    for secret in ("ghp_param_secret_1", "env-secret-999", "wandb-secret-22"):
        assert secret not in written
    assert "cloned with ***" in written  # the param's value was also scrubbed from the other field


#: A process that imports openlab the way ``openlab`` and the flows do, then logs three ways.
_LOGS_A_SECRET = """
import logging, os
import orchestrator.cli.main  # what `openlab` imports
token = os.environ["LAB_GITHUB_TOKEN"]
logging.getLogger("orchestrator.links.github").warning("could not reach https://x:%s@api.github.test", token)
logging.getLogger("urllib3.connectionpool").warning("retrying with %s", token)
try:
    raise RuntimeError(f"backend said: bad credential {token}")
except RuntimeError:
    logging.getLogger("openlab.pipeline").exception("stage failed")
logging.getLogger("orchestrator.x").warning("nothing secret here: %d%%", 5)
"""


def test_no_log_line_carries_a_secret_to_stderr(tmp_path) -> None:
    """Secret values are masked in every log record, the library's and a dependency's, with
    tracebacks, on the way to stderr (no handler of ours involved: Python's last resort prints)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LAB_GITHUB_TOKEN": "ghp_s3cretvalue0123", "OPENLAB_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _LOGS_A_SECRET], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ghp_s3cretvalue0123" not in proc.stderr + proc.stdout
    assert "could not reach https://x:***@api.github.test" in proc.stderr
    assert "retrying with ***" in proc.stderr
    assert "RuntimeError: backend said: bad credential ***" in proc.stderr  # the traceback is kept, masked
    assert "nothing secret here: 5%" in proc.stderr  # a record with no secret is formatted as before


@pytest.mark.parametrize(
    ("typed", "recorded"),
    [
        (["--wandb-key", "abc123xyz", "-b", "slurm"], ["--wandb-key", "***", "-b", "slurm"]),
        (["--token=abc123xyz"], ["--token=***"]),
        (["-e", "WANDB_API_KEY=abc123xyz"], ["-e", "WANDB_API_KEY=***"]),
        (["--env=GITHUB_TOKEN=abc=123"], ["--env=GITHUB_TOKEN=***"]),  # a value with '=' hidden whole
        (["-o", "db_password=hunter22"], ["-o", "db_password=***"]),
        (["MYTOKEN=abc123xyz"], ["MYTOKEN=***"]),  # an environment variable's name: TOKEN anywhere in it
        # an option's or config key's name by whole words: shapes of a model are not secrets
        (["--tokenizer", "bpe", "max_tokens=4096", "--key-dim", "64"], None),
        (["--key-dim=64"], None),
        (["--set", "data.max_token=4096"], None),  # a number is a shape, not a secret
        # a shell script as one argument: each secret assignment alone is masked, the rest kept
        (
            ["bash", "-c", "echo token=abc123xyz hf=1; HF_TOKEN=hf_s3cret python train.py --lr 0.1; exit 1"],
            ["bash", "-c", "echo token=*** hf=1; HF_TOKEN=*** python train.py --lr 0.1; exit 1"],
        ),
        (["bash", "-c", "export HF_TOKEN=$(cat ~/.hf_token); python train.py --lr 0.1"], None),
        # a password written into a URL is a secret whatever names it
        (["--db", "postgresql://bob:pw_URLSECRET_77@db/x"], ["--db", "postgresql://bob:***@db/x"]),
        # a token as a web URL's user, as GitHub documents for cloning; ssh's git@ user is no secret
        (
            ["git", "clone", "https://ghp_URLUSER_123456@github.com/o/r.git"],
            ["git", "clone", "https://***@github.com/o/r.git"],
        ),
        (["git", "clone", "git@github.com:o/r.git"], None),
    ],
)
def test_a_recorded_command_line_masks_secrets_and_keeps_the_rest(typed: list[str], recorded: list[str] | None) -> None:
    from orchestrator.provenance.invocation import command_line

    expected = typed if recorded is None else recorded
    assert command_line(["run", "marin", *typed]) == ["openlab", "run", "marin", *expected]


def test_a_secret_value_of_the_environment_is_scrubbed_from_any_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.provenance.invocation import command_line

    monkeypatch.setenv("HF_TOKEN", "hf_abcdef123456")
    assert command_line(["run", "--note", "hf_abcdef123456 leaked"]) == ["openlab", "run", "--note", "*** leaked"]


def test_the_job_supervisors_copy_of_the_secret_rule_agrees_with_this_one() -> None:
    """The local job supervisor (also the Slurm jobs' output filter) masks a job's secrets in its log
    with its own copy of the rule, since it imports nothing of openlab (launchers/_supervise.py): the
    same words in the same case-blind way (``re.IGNORECASE``, which also reads the Kelvin sign as K,
    the long s as S, and dotted and dotless i as I), the same shortest value, the same mask."""
    import os
    import random
    import re
    import string

    from orchestrator.launchers import _supervise
    from orchestrator.secrets import MASK, MIN_SECRET_LENGTH, SECRET_NAME

    assert set(SECRET_NAME.pattern.split("|")) == set(_supervise.SECRET_WORDS)
    assert SECRET_NAME.flags & re.IGNORECASE
    assert _supervise.MIN_SECRET_LENGTH == MIN_SECRET_LENGTH and _supervise.MASK == MASK.encode()
    # every character re.IGNORECASE takes for a letter of the words, and only those, upper-cases to it
    letters = sorted(set("".join(_supervise.SECRET_WORDS)))
    any_letter = re.compile(f"[{''.join(letters)}]", re.IGNORECASE)
    for code in range(0x110000):
        char = chr(code)
        folded = char.translate(_supervise._UPPER)
        if any_letter.fullmatch(char):
            assert [letter for letter in letters if re.fullmatch(letter, char, re.IGNORECASE)] == [folded], char
        else:
            assert folded not in letters, char

    value = "v4lue-0123"
    names = [
        "GITHUB_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "PASSWD", "GCP_CREDENTIALS",
        "my_token", "ApiKey", "monkey", "KEYBOARD", "tokenizer", "PATH", "LR", "HOME", "SECRETARY",
        "to\u212aen", "\u017fecret", "pa\u017f\u017fword", "PAßWORD", "\ufb06oken", "TOKEN\u0130", "\u0131d_KEY",
    ]  # fmt: skip
    rand = random.Random(7)  # words in any case, cut or whole, among other characters
    for _ in range(500):
        word = "".join(c.lower() if rand.random() < 0.5 else c for c in rand.choice(_supervise.SECRET_WORDS))
        if rand.random() < 0.3:
            word = word[: rand.randrange(1, len(word))]
        names.append("".join(rand.choices(string.ascii_letters + "_", k=3)) + word + rand.choice(["", "_ID", "S"]))
    env = {name: f"{value}-{i}" for i, name in enumerate(names)}
    env.update(SHORT_TOKEN="abcde", EMPTY_KEY="", WIDE_KEY="éééé€", EXACT_KEY="abcdef", NON_UTF8_KEY="caf\udce9-bytes")
    expected = {os.fsencode(value) for value in secret_values(env)}
    assert set(_supervise.secret_values(env)) == expected
    assert b"abcdef" in expected and "éééé€".encode() not in expected  # five characters, though twelve bytes
    assert b"caf\xe9-bytes" in expected  # as the job writes it: the bytes of its environment
    lengths = [len(found) for found in _supervise.secret_values(env)]
    assert lengths == sorted(lengths, reverse=True)  # longest first, as scrub replaces them


def test_a_password_in_a_url_never_reaches_lineage_or_a_log(openlab_home, caplog: pytest.LogCaptureFixture) -> None:
    """``postgresql://bob:PASSWORD@db`` in a job's error, a parameter or a log line: no variable names it,
    so nothing masked it; it was stored, exported and printed as it was."""
    import logging

    from orchestrator.lineage import PipelineRun, open_store
    from orchestrator.secrets import mask_secrets_in_logs

    with open_store() as store, store.transaction() as tx:
        run = tx.add(
            PipelineRun(
                name="x",
                error="could not reach postgresql://bob:pw_URLSECRET_77@db/x",
                params={"db": "https://u:pw2_SECRET@h/"},
            )
        )
    with open_store() as store:
        stored = store.require(PipelineRun, run.id)
    assert stored.error == "could not reach postgresql://bob:***@db/x" and stored.params == {"db": "https://u:***@h/"}
    mask_secrets_in_logs()
    logging.getLogger("openlab.test").error("retrying https://u:%s@api.example/v1", "pw3_SECRET")
    assert caplog.records[-1].getMessage() == "retrying https://u:***@api.example/v1"
