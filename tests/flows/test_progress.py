"""A stage's progress bar in the UI moves with the job's step lines, without a request per line."""

from __future__ import annotations

from flows.progress import StageProgress


class Recorded(StageProgress):
    """What would be sent to the API, and a send that fails on demand."""

    def __init__(self) -> None:
        super().__init__("pretrain")
        self.sent: list[float] = []
        self.fail = False

    def _create_or_update(self, percent: float) -> None:
        if self.fail:
            raise RuntimeError("API down")
        self.artifact_id = self.artifact_id or "artifact-1"
        self.sent.append(percent)


def test_updates_are_throttled_and_the_end_is_always_sent() -> None:
    bar = Recorded()
    bar.finish()
    assert bar.sent == [], "no bar for a stage that reported no step (a reused stage, a data stage)"
    for step in range(1, 1001):
        bar.update(step, 1000)
    # the first step, then about one update per percent, and 100 at the last step: not 1000 requests
    assert bar.sent[0] == 0.1 and bar.sent[-1] == 100.0 and 95 <= len(bar.sent) <= 102, len(bar.sent)
    assert bar.sent == sorted(bar.sent)
    bar.finish()
    assert bar.sent.count(100.0) == 1


def test_a_failed_update_does_not_fail_the_stage_and_is_retried_later() -> None:
    bar = Recorded()
    bar.fail = True
    bar.update(1, 10)
    assert bar.percent is None
    bar.fail = False
    bar.update(2, 10)
    assert bar.sent == [20.0]
    bar.update(0, 0)  # a malformed total is ignored
    assert bar.sent == [20.0]
