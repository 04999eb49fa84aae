"""Following a job's log file: the helper local and Slurm jobs share (orchestrator.launchers.local)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.launchers.local import follow_file


def test_a_log_written_while_asking_whether_the_job_ended_is_still_read(tmp_path: Path) -> None:
    """The race behind a CI flake: the file was absent, then the job started, wrote and ended
    during the status query; the follower must read the file, not report an empty log."""
    path = tmp_path / "slurm-1.log"

    def done() -> bool:
        path.write_text("hello\nworld\n")
        return True

    assert list(follow_file(path, done, follow=True, tail=None, poll=0.01)) == ["hello", "world"]


def test_a_job_that_ended_without_a_log_yields_nothing(tmp_path: Path) -> None:
    assert list(follow_file(tmp_path / "never.log", lambda: True, follow=True, tail=None, poll=0.01)) == []


def test_following_reads_lines_until_the_job_ends_and_drains_a_partial_last_line(tmp_path: Path) -> None:
    path = tmp_path / "job.log"
    path.write_text("one\n")
    calls = {"n": 0}

    def done() -> bool:
        calls["n"] += 1
        if calls["n"] == 1:
            with path.open("a") as fh:
                fh.write("two\nthree")  # the last line has no newline
            return False
        return True

    assert list(follow_file(path, done, follow=True, tail=None, poll=0.01)) == ["one", "two", "three"]


def test_a_log_truncated_or_replaced_while_followed_is_followed_from_its_top(tmp_path: Path) -> None:
    """A restarted job (Slurm's requeue truncates its output; a rotated log is a new file): the
    follower says so and reads the new content, instead of waiting past the old end for ever."""
    path = tmp_path / "job.log"
    path.write_text("first run, a long line\n")
    looks = {"n": 0}

    def done() -> bool:
        looks["n"] += 1
        if looks["n"] == 1:
            path.write_text("run 1\n")  # truncated in place, shorter than what was read
        elif looks["n"] == 2:
            replacement = tmp_path / "new.log"
            replacement.write_text("run 2\nend\n")
            replacement.replace(path)  # a new file under the same name
        return looks["n"] > 3

    lines = list(follow_file(path, done, follow=True, tail=None, poll=0.01))
    content = [line for line in lines if not line.startswith("[openlab]")]
    assert content == ["first run, a long line", "run 1", "run 2", "end"]
    assert sum("was started again" in line for line in lines) == 2, lines
