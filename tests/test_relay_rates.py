"""Judging relays by their rate, without a network: which relay holds its
chain back, and that a chain moving together is never judged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_hoplite.core.relay_rates import REROUTE_OP, RelayRates

MB = 2**20


def feed(rates: RelayRates, tid: int, speed: float, seconds: float, start: int = 0) -> None:
    """Reports of ``tid`` every 0.1 s for ``seconds`` at ``speed`` bytes/s."""
    for i in range(round(seconds * 10) + 1):
        rates.observe(tid, start + int(speed * i / 10), i / 10)


def test_no_rate_before_a_whole_window_of_reports():
    r = RelayRates(window=0.5, ratio=0.4, min_lag=2 * MB)
    feed(r, 1, 30e6, 0.4)
    assert r.rate(1) is None
    feed(r, 1, 30e6, 0.5)
    rate = r.rate(1)
    assert rate is not None and rate.bytes_per_s == pytest.approx(30e6, rel=0.01)


def test_a_relay_at_a_quarter_of_its_senders_rate_lags():
    r = RelayRates(window=0.5, ratio=0.4, min_lag=2 * MB)
    feed(r, 1, 31e6, 1.0)  # the sender, itself receiving
    feed(r, 2, 31e6 / 4, 1.0)  # the relay below it
    assert r.lagging(2, 1, reference=None)
    # At half the sender's rate (a chain slowed by a busy CPU), it does not.
    feed(r, 3, 31e6 / 2, 1.0)
    assert not r.lagging(3, 1, reference=None)


def test_a_relay_its_sender_is_barely_ahead_of_is_held_back_not_lagging():
    r = RelayRates(window=0.5, ratio=0.4, min_lag=2 * MB)
    feed(r, 1, 31e6, 1.0, start=0)
    # Slow, but its sender is only 1 MiB ahead: the sender holds it back.
    feed(r, 2, 1e6, 1.0, start=31_000_000 - 2 * 10**6)
    assert not r.lagging(2, 1, reference=None)


def test_below_a_complete_copy_the_measured_bandwidth_is_the_reference():
    r = RelayRates(window=0.5, ratio=0.4, min_lag=2 * MB)
    feed(r, 1, 31e6 / 4, 1.0)
    assert r.lagging(1, None, reference=31e6)
    assert not r.lagging(1, None, reference=None)  # nothing measured: no judgement
    assert not r.lagging(1, None, reference=15e6)


def test_a_restarted_stream_starts_a_new_rate_and_forget_drops_it():
    r = RelayRates(window=0.5, ratio=0.4, min_lag=0)
    feed(r, 1, 30e6, 1.0)
    r.observe(1, 0, 1.1)  # from byte 0 again
    assert r.rate(1) is None
    r.forget(1)
    assert len(r) == 0
    feed(r, 2, 1e6, 1.0)
    r.keep_only({3})
    assert len(r) == 0


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"ratio": 0}, {"ratio": 1}, {"min_lag": -1}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        RelayRates(**{"window": 0.5, "ratio": 0.4, "min_lag": 0, **kwargs})


@settings(max_examples=200, deadline=None)
@given(
    speed=st.floats(1e6, 2e9),
    jitter=st.lists(st.floats(0.5, 1.5), min_size=12, max_size=40),
    lag=st.integers(0, 64 * MB),
)
def test_a_relay_keeping_up_with_its_sender_is_never_judged(speed, jitter, lag):
    """Reports of a sender and a relay that receive at the same rate, with
    each report interval stretched or shrunk up to 50% (a busy event loop),
    and the relay any distance behind: the relay is never lagging."""
    r = RelayRates(window=0.5, ratio=0.4, min_lag=2 * MB)
    t = pos = 0.0
    for j in jitter:
        t += 0.1 * j
        pos += speed * 0.1 * j
        r.observe(1, int(pos) + lag, t)
        r.observe(2, int(pos), t + 0.01)
        assert not r.lagging(2, 1, reference=speed)


def _service_over_a_chain(clock):
    """src -> r0 -> r1 -> r2 in a DirectoryService judging relays, and the
    reroutes it sends."""
    from dask_hoplite.config import HopliteConfig
    from dask_hoplite.core.directory import ObjectDirectory
    from dask_hoplite.core.network_model import NetworkModel
    from dask_hoplite.scheduler.directory_service import DirectoryService

    d = ObjectDirectory(fanout=1)
    for i in range(3):
        d.request("k", f"r{i}", holders=["src"])
    sent = []
    service = DirectoryService(
        d,
        NetworkModel(),
        HopliteConfig.from_dask_config(),
        task=lambda key: None,
        send=lambda worker, msg: sent.append((worker, msg)),
        clock=clock,
    )
    tid = {r: d.objects["k"].incoming[r].transfer_id for r in ("r0", "r1")}
    return service, tid, sent


@pytest.mark.parametrize("own_clock", [True, False])
def test_a_relay_whose_reports_arrive_late_is_judged_by_its_own_clock(own_clock):
    # r0 and r1 both receive at 100 MB/s, each reporting every 50 ms. r1's
    # host is busy: its reports of 0.15-0.45 s reach the scheduler in one
    # bunch at 0.45 s. On its own clock r1 kept up; on arrival it looks stuck
    # at a quarter of r0's rate, and (the counter-case) would be moved.
    now = [0.0]
    service, tid, sent = _service_over_a_chain(lambda: now[0])
    late = []
    for step in range(10):
        t = step * 0.05
        now[0] = t
        service.progress(tid["r0"], int(200e6 + t * 100e6), at=t if own_clock else None)
        report = (tid["r1"], int(t * 100e6), t)
        if 0.15 <= t < 0.45:
            late.append(report)
            continue
        for r in [*late, report]:
            service.progress(r[0], r[1], at=r[2] if own_clock else None)
        late = []
    rerouted = [m for _, m in sent if m.get("op") == REROUTE_OP]
    assert (rerouted == []) is own_clock
