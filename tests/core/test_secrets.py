"""Secret values never survive into what openlab records or prints."""

from __future__ import annotations

from orchestrator.secrets import redact_mapping, scrub, secret_values


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
