"""The object directory, without a network: sender assignment, trees, queueing,
cleanup, and invariants under random event sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dask_hoplite.core.directory import (
    Assign,
    Missing,
    ObjectDirectory,
    ObjectRecord,
    Queued,
    Reroute,
    host_of,
)

K = "x"


def test_simultaneous_receivers_form_a_chain_with_fanout_1():
    d = ObjectDirectory(fanout=1)
    senders = {}
    for i in range(7):
        a = d.request(K, f"r{i}", holders=["src"])
        assert isinstance(a, Assign)
        senders[a.receiver] = a.sender
    # src -> r0 -> r1 -> ... -> r6: the source sends exactly one copy.
    assert senders == {"r0": "src", **{f"r{i}": f"r{i - 1}" for i in range(1, 7)}}
    rec = d.objects[K]
    assert rec.peak_uploads == 1
    assert list(d.upstream(K, "r6")) == ["r5", "r4", "r3", "r2", "r1", "r0", "src"]


def test_fanout_2_builds_a_binary_tree():
    d = ObjectDirectory(fanout=2)
    senders = {}
    for i in range(6):
        a = d.request(K, f"r{i}", holders=["src"])
        assert isinstance(a, Assign)
        senders[a.receiver] = a.sender
    assert senders["r0"] == senders["r1"] == "src"
    # Next receivers hang below the shallowest partial copies, two each.
    assert sorted(senders[f"r{i}"] for i in range(2, 6)) == ["r0", "r0", "r1", "r1"]
    assert d.objects[K].peak_uploads == 2


def test_idle_complete_copy_is_preferred_over_partial():
    d = ObjectDirectory(fanout=1)
    a = d.request(K, "r0", holders=["src"])
    assert d.transfer_finished(a.transfer_id, ok=True) == []
    # r0 is complete now: two idle complete copies serve two new receivers.
    b = d.request(K, "r1", holders=["src"])
    c = d.request(K, "r2", holders=["src"])
    assert {b.sender, c.sender} == {"src", "r0"}


def test_receiver_never_streams_from_itself_or_a_descendant():
    d = ObjectDirectory(fanout=1)
    d.request(K, "a", holders=["src"])
    d.request(K, "b", holders=["src"])  # a -> b
    d.request(K, "c", holders=["src"])  # b -> c
    # The source dies; a asks again. Its only candidates depend on it.
    d.worker_removed("src")
    decision = d.request(K, "a", holders=[])
    assert decision == Queued(K, "a")
    # Giving up leaves no trace of the queued request.
    d.cancel_request(K, "a")
    assert "a" not in d.objects[K].queue


def test_unknown_key_is_missing_and_leaves_no_entry():
    d = ObjectDirectory()
    assert d.request("nope", "r0", holders=[]) == Missing("nope", "r0")
    assert len(d) == 0


def test_queued_receiver_is_assigned_when_capacity_frees():
    d = ObjectDirectory(fanout=1)
    a = d.request(K, "a", holders=["src"])  # src -> a
    d.request(K, "b", holders=["src"])  # a -> b
    d.worker_removed("src")  # a's stream is cut; a's copy is partial forever
    assert d.request(K, "a", holders=[]) == Queued(K, "a")
    assert d.copy_released(K, "nobody") == []  # no change: still queued
    assert d.transfer_finished(a.transfer_id, ok=False) == []  # stale id: ignored
    # A new complete copy appears (Dask recomputed the key on "new").
    out = d.copy_added(K, "new")
    assert out == [Assign(K, "a", "new", out[0].transfer_id)]


def test_forget_drops_everything_and_releases_waiters():
    d = ObjectDirectory(fanout=1)
    d.request(K, "a", holders=["src"])
    d.request(K, "b", holders=["src"])
    d.worker_removed("src")
    d.request(K, "a", holders=[])
    out = d.forget(K)
    assert out == [Missing(K, "a")]
    assert len(d) == 0 and not d.transfers


def test_a_lost_key_keeps_its_running_chain_and_the_recomputed_copy_joins_it():
    """The only complete copy dies mid-broadcast: src -> a -> b -> c -> d.
    a's stream breaks; b, c and d keep streaming from the partial copies
    above them. The recomputed copy serves a, and a newcomer attaches at the
    tail: no relay is given a second receiver (fanout 1)."""
    d = ObjectDirectory(fanout=1)
    for r in "abcd":
        d.request(K, r, holders=["src"])  # src -> a -> b -> c -> d
    d.worker_removed("src")  # a's stream is cut
    assert d.lost(K) == []
    assert list(d.upstream(K, "d")) == ["c", "b", "a"]  # still on record
    assert d.copy_added(K, "new") == []  # Dask recomputed the key on "new"
    a = d.request(K, "a", holders=["new"], exclude=["src"])
    assert (a.sender, a.receiver) == ("new", "a")
    e = d.request(K, "e", holders=["new"])
    assert (e.sender, e.receiver) == ("d", "e")  # not a, which already feeds b
    assert set(d.objects[K].uploads.values()) == {1}


def test_a_lost_key_releases_its_queue_and_goes_once_its_streams_end():
    d = ObjectDirectory(fanout=1)
    d.request(K, "a", holders=["src"])
    b = d.request(K, "b", holders=["src"])  # a -> b
    d.worker_removed("src")
    assert d.request(K, "a", holders=[]) == Queued(K, "a")  # only b, a descendant
    assert d.lost(K) == [Missing(K, "a")]
    assert K in d.objects  # b still streams from a
    d.transfer_finished(b.transfer_id, ok=False)
    assert len(d) == 0 and not d.transfers


def test_a_queued_receiver_is_never_served_by_a_sender_it_gave_up_on():
    d = ObjectDirectory(fanout=1)
    a = d.request(K, "a", holders=["s1", "s2"])  # s1 -> a
    # b gave up on s2 and on a (stalled): s1 is busy, so b waits.
    assert d.request(K, "b", holders=["s1", "s2"], exclude=["s2", "a"]) == Queued(K, "b")
    # Something changes: s2 is idle, but b gave it up.
    assert d.copy_released(K, "nobody") == []
    assert "b" in d.objects[K].queue
    # s1 frees: b is served by it, still not by s2 or a.
    out = d.transfer_finished(a.transfer_id, ok=True)
    assert [(o.sender, o.receiver) for o in out] == [("s1", "b")]


def test_released_copies_and_finished_transfers_leave_no_entry():
    d = ObjectDirectory(fanout=1)
    for i in range(4):
        d.request(K, f"r{i}", holders=["src"])
    for tid in list(d.transfers):
        d.transfer_finished(tid, ok=True)
    assert d.objects[K].complete == {"r0", "r1", "r2", "r3"}
    for r in ["r0", "r1", "r2", "r3", "src"]:
        d.copy_released(K, r)
    assert len(d) == 0


def test_pinned_lists_senders_and_receivers_of_active_streams():
    d = ObjectDirectory(fanout=1)
    a = d.request(K, "a", holders=["src", "other"])
    assert d.pinned(K) == {a.sender, "a"}
    d.transfer_finished(a.transfer_id, ok=True)
    assert d.pinned(K) == set()


def test_bad_fanout_is_rejected():
    with pytest.raises(ValueError, match="fanout"):
        ObjectDirectory(fanout=0)


# ----------------------------------------------------------------- properties

# Three hosts of two workers each, and one worker alone on its host.
workers = st.sampled_from([f"tcp://10.0.0.{i // 2}:{4000 + i}" for i in range(6)] + ["w6"])
keys = st.sampled_from(["k1", "k2"])
events = st.lists(
    st.one_of(
        st.tuples(
            st.just("request"),
            keys,
            workers,
            st.sets(workers, max_size=2),
            st.sets(workers, max_size=2),
        ),
        st.tuples(st.just("finish"), st.integers(0, 30), st.booleans()),
        st.tuples(st.just("release"), keys, workers),
        st.tuples(st.just("add"), keys, workers),
        st.tuples(st.just("remove"), workers),
        st.tuples(st.just("forget"), keys),
        st.tuples(st.just("lost"), keys),
        st.tuples(st.just("cancel"), keys, workers),
        st.tuples(st.just("reroute"), keys, workers),
    ),
    max_size=60,
)


def check_invariants(d: ObjectDirectory) -> None:
    for key, rec in d.objects.items():
        # Upload counts are exactly the active streams, and within fanout.
        counts: dict[str, int] = {}
        for r, t in rec.incoming.items():
            assert t.receiver == r and t.key == key
            assert d.transfers[t.transfer_id] is t
            assert t.sender != r
            counts[t.sender] = counts.get(t.sender, 0) + 1
        assert counts == rec.uploads
        # Per NIC (streams leaving a host) and per holder within its host.
        nic: dict[str, int] = {}
        local: dict[str, int] = {}
        for t in rec.incoming.values():
            if host_of(t.sender) == host_of(t.receiver):
                local[t.sender] = local.get(t.sender, 0) + 1
            else:
                nic[host_of(t.sender)] = nic.get(host_of(t.sender), 0) + 1
        assert nic == rec.nic_uploads and local == rec.local_uploads
        assert all(n <= d.fanout for n in [*nic.values(), *local.values()])
        assert rec.peak_uploads <= 2 * d.fanout
        # No cycles: walking upstream always ends.
        for r in rec.incoming:
            chain = list(d.upstream(key, r))
            assert r not in chain
        assert len(set(rec.queue)) == len(rec.queue)
        assert not set(rec.queue) & set(rec.incoming)
    assert sum(len(rec.incoming) for rec in d.objects.values()) == len(d.transfers)


@settings(max_examples=300, deadline=None)
@given(fanout=st.integers(1, 3), evs=events)
@example(  # a relay whose receiver's stream is cut: its receivers were streaming before
    fanout=1,
    evs=[
        ("request", "k1", "tcp://10.0.0.0:4000", {"tcp://10.0.0.1:4002"}, set()),
        ("request", "k1", "tcp://10.0.0.0:4001", set(), set()),
        ("request", "k1", "tcp://10.0.0.1:4002", set(), set()),
        ("finish", 0, False),
        ("reroute", "k1", "tcp://10.0.0.0:4001"),
    ],
)
def test_invariants_hold_under_any_event_sequence(fanout, evs):
    d = ObjectDirectory(fanout=fanout)
    excluded: dict[tuple[str, str], set[str]] = {}  # what each waiting receiver gave up on

    def check(decisions) -> None:
        for out in decisions:
            if isinstance(out, Assign):
                assert out.sender != out.receiver
                assert out.receiver not in d.upstream(out.key, out.sender)
                # never a sender the receiver gave up on, even served from the queue
                assert out.sender not in excluded.get((out.key, out.receiver), set())

    for ev in evs:
        kind = ev[0]
        if kind == "request":
            _, key, w, holders, exclude = ev
            if w not in d.objects.get(key, ObjectRecord(key)).queue:
                excluded[(key, w)] = set()
            excluded[(key, w)] |= exclude
            check([d.request(key, w, holders, exclude)])
        elif kind == "finish":
            ids = sorted(d.transfers)
            if ids:
                check(d.transfer_finished(ids[ev[1] % len(ids)], ev[2]))
        elif kind == "add":
            check(d.copy_added(ev[1], ev[2]))
        elif kind == "release":
            check(d.copy_released(ev[1], ev[2]))
        elif kind == "remove":
            check(d.worker_removed(ev[1]))
            for rec in d.objects.values():
                assert all(ev[1] not in (t.sender, t.receiver) for t in rec.incoming.values())
        elif kind == "forget":
            d.forget(ev[1])
            assert ev[1] not in d.objects
        elif kind == "lost":
            running = {t.transfer_id for t in d.transfers.values() if t.key == ev[1]}
            d.lost(ev[1])
            rec = d.objects.get(ev[1])
            # the streams between partial copies stay on record, nothing else
            assert running == {t.transfer_id for t in d.transfers.values() if t.key == ev[1]}
            assert rec is None or not (rec.complete or rec.holders or rec.queue)
        elif kind == "cancel":
            d.cancel_request(ev[1], ev[2])
        elif kind == "reroute":
            rec = d.objects.get(ev[1])
            streaming = set(() if rec is None else rec.incoming)  # before the reroute
            moved = d.reroute(ev[1], ev[2])
            # the relay's own stream and its receivers' streams end, nothing else
            assert all(r.transfer_id not in d.transfers for r in moved)
            assert {r.receiver for r in moved[:-1]} <= {ev[2]} | streaming
            assert all(r.sender == ev[2] for r in moved[:-1])
            for r in moved:  # each asks again, without the sender if it lags
                gone = [r.sender] if r.sender_lags else []
                excluded[(r.key, r.receiver)] = set(gone)
                check([d.request(r.key, r.receiver, rec.holders if rec else (), gone)])
                check(d.drain(r.key))
        check_invariants(d)
    # Dask forgetting every key leaves nothing behind.
    for key in list(d.objects):
        d.forget(key)
    assert len(d) == 0 and not d.transfers


def test_a_resuming_receiver_never_gets_the_sender_it_gave_up_on():
    d = ObjectDirectory(fanout=1)
    d.request(K, "a", holders=["src", "src2"])  # src -> a
    d.request(K, "b", holders=["src", "src2"])  # src2 -> b
    d.request(K, "c", holders=["src", "src2"])  # a -> c (partial, depth 2)
    # a's sender stalls: a asks again, excluding it. src2 is busy with b, c
    # depends on a: b's partial copy (fed by src2) is the one to resume from.
    decision = d.request(K, "a", holders=["src", "src2"], exclude=["src"])
    assert isinstance(decision, Assign) and decision.sender == "b"
    # Excluding every holder but a descendant leaves nothing to resume from.
    assert d.request(K, "a", holders=["src", "src2"], exclude=["src", "src2", "b"]) == Queued(
        K, "a"
    )


def test_partial_copies_fed_by_an_excluded_sender_are_not_assigned():
    d = ObjectDirectory(fanout=2)
    d.request(K, "a", holders=["src"])  # src -> a
    # b gives up on src: a's partial copy also waits on src, so it is no help.
    assert d.request(K, "b", holders=["src"], exclude=["src"]) == Missing(K, "b")


def test_a_holder_on_the_receivers_host_is_preferred():
    d = ObjectDirectory(fanout=1)
    h1, h2 = "tcp://10.0.0.1:4000", "tcp://10.0.0.2:4000"  # Dask's holders
    # By address h1 would come first; the receiver on 10.0.0.2 gets h2.
    a = d.request(K, "tcp://10.0.0.2:5000", [h1, h2])
    assert isinstance(a, Assign) and a.sender == h2
    b = d.request(K, "tcp://10.0.0.1:5000", [h1, h2])
    assert isinstance(b, Assign) and b.sender == h1
    # Both holders busy: of the two relays, the one on the receiver's host,
    # although the other was assigned first.
    c = d.request(K, "tcp://10.0.0.1:6000", [h1, h2])
    assert isinstance(c, Assign) and c.sender == "tcp://10.0.0.1:5000"


def test_on_its_own_host_a_receiver_gets_a_copy_that_came_through_hoplite():
    """Of two idle holders on the receiver's host, the one that received the
    key (on a host whose workers share, its copy is in a region that maps as
    it is) before the one Dask alone knows of (its task's output), whatever
    their addresses' order."""
    d = ObjectDirectory(fanout=1)
    src, b, c = "tcp://10.0.0.1:4000", "tcp://10.0.0.1:5000", "tcp://10.0.0.1:6000"
    first = d.request(K, b, holders=[src])
    assert isinstance(first, Assign) and first.sender == src
    d.transfer_finished(first.transfer_id, ok=True)
    later = d.request(K, c, holders=[src, b])
    assert isinstance(later, Assign) and later.sender == b


@pytest.mark.parametrize(
    "address, host",
    [
        ("tcp://10.0.0.1:8786", "10.0.0.1"),
        ("tls://node-3.cluster:40123", "node-3.cluster"),
        ("tcp://[::1]:8786", "::1"),
        ("inproc://10.0.0.1/123/4", "10.0.0.1"),
    ],
)
def test_host_of(address, host):
    assert host_of(address) == host


def _host_workers(hosts: int, per_host: int) -> list[str]:
    return [f"tcp://10.0.0.{h}:{4000 + j}" for h in range(hosts) for j in range(per_host)]


@settings(max_examples=200, deadline=None)
@given(
    fanout=st.integers(1, 3),
    per_host=st.integers(1, 4),
    data=st.data(),
)
def test_a_broadcast_enters_each_host_once(fanout, per_host, data):
    """Whatever the order receivers arrive and streams end in, every host but
    the source's receives the key over its NIC exactly once, and the source's
    other workers take it over loopback."""
    everyone = _host_workers(4, per_host)
    src, receivers = everyone[0], everyone[1:]
    d = ObjectDirectory(fanout=fanout)
    waiting = data.draw(st.permutations(receivers))
    while waiting or d.transfers:
        if waiting and (not d.transfers or data.draw(st.booleans())):
            d.request(K, waiting.pop(), holders=[src])
        else:
            ids = sorted(d.transfers)
            d.transfer_finished(ids[data.draw(st.integers(0, len(ids) - 1))], ok=True)
        check_invariants(d)
    rec = d.objects[K]
    assert rec.complete == set(receivers)
    into = [host_of(r) for s_, r in rec.edges if host_of(s_) != host_of(r)]
    assert sorted(into) == sorted({host_of(r) for r in receivers} - {host_of(src)})


def test_the_fanout_limit_counts_per_nic():
    d = ObjectDirectory(fanout=1)
    a1, a2, b, c = "tcp://10.0.0.1:1", "tcp://10.0.0.1:2", "tcp://10.0.0.2:1", "tcp://10.0.0.3:1"
    # Two complete copies on host 10.0.0.1, one NIC: b takes a1; c may not
    # take a2 over the same NIC, and takes b's partial copy instead.
    assert d.request(K, b, holders=[a1, a2]) == Assign(K, b, a1, 1)
    assert d.request(K, c, holders=[a1, a2]).sender == b
    # More workers on b's host take the key from b's partial copy over
    # loopback (b serves one stream over its NIC and one locally), then
    # from one another, although a2 is an idle complete copy.
    b2, b3 = "tcp://10.0.0.2:2", "tcp://10.0.0.2:3"
    assert d.request(K, b2, holders=[a1, a2]).sender == b
    assert d.request(K, b3, holders=[a1, a2]).sender == b2
    # A worker on the source's host takes the idle local copy.
    a3 = "tcp://10.0.0.1:3"
    assert d.request(K, a3, holders=[a1, a2]).sender == a2


def test_a_receiver_waits_for_its_hosts_copy_rather_than_cross_the_nic_twice():
    d = ObjectDirectory(fanout=1)
    src, b, b2, b3 = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1", "tcp://10.0.0.2:2", "tcp://10.0.0.2:3"
    t = d.request(K, b, holders=[src])  # src -> b over the NIC
    d.transfer_finished(t.transfer_id, ok=True)
    t2 = d.request(K, b2, holders=[src])  # b -> b2 locally
    assert t2.sender == b
    # b3 gave up on b2; b is busy with b2. src's NIC is idle, yet b3 waits
    # for b rather than pull the key into the host a second time.
    assert d.request(K, b3, holders=[src], exclude=[b2]) == Queued(K, b3)
    assert d.transfer_finished(t2.transfer_id, ok=True) == [Assign(K, b3, b, 3)]


# ------------------------------------------------------------ lagging relays


def chain(n: int) -> ObjectDirectory:
    """src -> r0 -> r1 -> ... -> r(n-1), all streaming."""
    d = ObjectDirectory(fanout=1)
    for i in range(n):
        assert d.request(K, f"r{i}", holders=["src"]).sender == ("src" if i == 0 else f"r{i - 1}")
    return d


@pytest.mark.parametrize("relay_first", [True, False])
@pytest.mark.parametrize("n, relay", [(5, "r2"), (4, "r2"), (5, "r0")])
def test_a_lagging_relay_leaves_its_chain_for_the_tail_and_its_receiver_takes_its_place(
    relay_first, n, relay
):
    d = chain(n)
    i = int(relay[1:])
    before, child, tail = ("src" if i == 0 else f"r{i - 1}"), f"r{i + 1}", f"r{n - 1}"
    moved = d.reroute(K, relay)
    # The child drops its stream from the relay (which lags), the relay its own.
    assert moved == [
        Reroute(K, child, relay, moved[0].transfer_id, sender_lags=True),
        Reroute(K, relay, before, moved[1].transfer_id, sender_lags=False),
    ]
    asks = [(relay, []), (child, [relay])]
    senders = {}
    for receiver, exclude in asks if relay_first else asks[::-1]:
        decision = d.request(K, receiver, holders=["src"], exclude=exclude)
        for a in [decision, *d.drain(K)]:
            if isinstance(a, Assign):
                senders[a.receiver] = a.sender
    # The chain closes over the gap, and the relay hangs below its tail.
    assert senders == {child: before, relay: tail}
    assert list(d.upstream(K, relay))[0] == tail
    assert relay not in d.upstream(K, tail)
    check_invariants(d)


def test_a_lagging_relay_serves_nobody_else_while_another_copy_can():
    d = chain(4)
    d.reroute(K, "r1")
    d.request(K, "r2", holders=["src"], exclude=["r1"])  # r0 -> r2
    d.request(K, "r1", holders=["src"])  # r3 -> r1
    # A newcomer waits rather than hang below r1 (the tail, which lags).
    assert isinstance(d.request(K, "r4", holders=["src"]), Queued)
    # r1 serves once it is the only copy that can.
    d.cancel_request(K, "r4")
    for r in ["r0", "r2", "r3"]:
        d.transfer_finished(d.objects[K].incoming[r].transfer_id, ok=False)
    d.copy_released(K, "src")
    b = d.request(K, "r5", holders=[])
    assert isinstance(b, Assign) and b.sender == "r1"


def test_rerouting_a_leaf_or_an_unknown_key_does_nothing_to_others():
    d = chain(3)
    assert d.reroute("unknown", "r0") == []
    assert d.reroute(K, "nobody") == []
    moved = d.reroute(K, "r2")  # the tail: only its own stream
    assert [(m.receiver, m.sender) for m in moved] == [("r2", "r1")]
    assert set(d.objects[K].incoming) == {"r0", "r1"}
