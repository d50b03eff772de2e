"""A rank that dies or stops answering makes the others fail with RankFailure within the collective timeout, and
the spawning parent names every rank's outcome; nothing hangs."""

from __future__ import annotations

import time

import placed_ranks
import pytest

from poot_core.distributed import Coordinator, RankFailure


@pytest.mark.parametrize(("placement", "how", "timeout"), [("tensor", "die", 30.0), ("pipeline", "hang", 4.0)])
def test_a_failing_rank_fails_the_others(tiny_checkpoint, tmp_path, placement, how, timeout):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as err:
        Coordinator.spawn(2, placed_ranks.fail_while_decoding, str(tiny_checkpoint("llama")), placement, how,
                          str(tmp_path / "gave-up"), timeout=120.0, collective_timeout=timeout, threads=1)
    assert "rank 1: exited with code 3 without a result" in str(err.value)
    survivor = err.value.results[0]
    assert survivor["type"] == "RankFailure" and "rank 0 of 2" in survivor["error"], survivor
    assert "died or stopped answering" in survivor["error"]
    if how == "die":  # a closed connection is seen at once, long before the timeout
        assert survivor["seconds"] < timeout / 2
    else:  # a silent peer: the collective gives up at its timeout
        assert timeout - 1 < survivor["seconds"] < 3 * timeout and f"timeout {timeout:g} s" in survivor["error"]
    assert time.monotonic() - t0 < 100
