"""A shard actor of a two-shard replica killed under load (issue 21): rank 1 is SIGKILLed while a few greedy
streams run. Rank 0's next collective fails at once (the dead rank's sockets close; a stalled one would be bounded
by the step timeout), so the group is out of lockstep: every stream ends with OpenAI's error event and [DONE], the
replica refuses requests (503 with Retry-After) and fails its health check, Serve replaces it with a fresh pair of
shard actors, and requests are served again. The time from the kill to the first request served is printed."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from serve_app.settings import ServeSettings
from tests.reliability.live_faults import (API_KEY, Live, assert_ended_with_error_events, ready_again, recover,
                                           start_live, streams_then_fault, summary)

pytestmark = [pytest.mark.slow]
NUM_STREAMS = 4


@pytest.fixture(scope="module")
def live(serve_session, tiny_checkpoint) -> Iterator[Live]:
    from ray import serve

    settings = ServeSettings(checkpoint=str(tiny_checkpoint), device="cpu", num_shards=2, api_key=API_KEY,
                             replica_num_cpus=0.5, health_check_period_s=1, graceful_shutdown_timeout_s=1)
    yield start_live(settings, "shard_faults", serve_session, 90)
    serve.delete("shard_faults")


def test_a_rank_1_shard_killed_mid_stream(live):
    shards = live.engine.shard_info.remote().result()
    assert [s["rank"] for s in shards] == [0, 1]
    ends, struck = asyncio.run(streams_then_fault(live.base_url, lambda: os.kill(shards[1]["pid"], signal.SIGKILL),
                                                  NUM_STREAMS))
    assert_ended_with_error_events(ends)
    assert all("a model shard failed mid-step" in e.error["message"] for e in ends), ends[0]
    with pytest.raises(Exception, match="cannot serve"):  # the replica fails its health check: Serve replaces it
        live.engine.check_health.remote().result()
    served_s, statuses = recover(live.base_url, struck)
    ready_s = ready_again(live.base_url, struck)
    new = live.engine.shard_info.remote().result()
    print(f"\nrank 1 of 2 killed under {NUM_STREAMS} streams: all ended with an error event; served again "
          f"{served_s:.1f} s after the kill (statuses meanwhile {summary(statuses)}), /readyz 200 after {ready_s:.1f} s")
    assert [s["rank"] for s in new] == [0, 1]
    assert not {s["pid"] for s in new} & {s["pid"] for s in shards}, "a fresh pair of shard actors"
    live.engine.check_integrity.remote().result()
