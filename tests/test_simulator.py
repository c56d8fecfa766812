"""The flow-level simulator (``benchmarks/simulator``): max-min fair sharing,
pipelining that never lets a receiver overtake its sender, resumption after a
failure, and the shape of the results a user reads off it (a chain takes about
S/B plus its hop latencies, Dask's star (N-1) S/B, 1,024 workers in bounds)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.simulator.broadcast import HopliteBroadcast, dask_broadcast
from benchmarks.simulator.network import EPS, Buffer, Flow, Network
from benchmarks.simulator.params import Cluster, MiB, Overheads, address
from benchmarks.simulator.reduce import HopliteReduce, SplitReduce
from dask_hoplite.core.tree_shape import ReduceTree

S = 64 * MiB
CLUSTER = Cluster(125e6, Overheads(efficiency=1.0, hop_latency=0.002, setup=0.001))


def rates(net: Network) -> dict[tuple[str, str], float]:
    net.update_rates(0.0)
    return {(f.src, f.dst): f.rate for f in net.flows}


def flow(src: str, dst: str, sources: tuple[Buffer, ...] = ()) -> Flow:
    return Flow(src, dst, Buffer(100.0), sources=sources)


def test_max_min_shares_an_uplink_and_a_downlink_fairly():
    net = Network(10.0)
    for src, dst in [("a", "b"), ("a", "c"), ("d", "c")]:
        net.add(flow(src, dst))
    assert rates(net) == {("a", "b"): 5.0, ("a", "c"): 5.0, ("d", "c"): 5.0}


def test_max_min_gives_what_a_slow_receiver_leaves_to_the_others():
    net = Network(10.0)
    net.set_capacity("c", up=10.0, down=2.0)
    for src, dst in [("a", "b"), ("a", "c"), ("d", "e")]:
        net.add(flow(src, dst))
    assert rates(net) == pytest.approx({("a", "b"): 8.0, ("a", "c"): 2.0, ("d", "e"): 10.0})


def test_a_relay_that_caught_up_goes_no_faster_than_its_own_sender():
    net = Network(10.0)
    net.set_capacity("b", up=10.0, down=3.0)  # the relay's ingress is slow
    into_b = net.add(flow("a", "b"))
    net.add(flow("b", "c", sources=(into_b.into,)))  # b has no byte yet: caught up
    assert rates(net) == pytest.approx({("a", "b"): 3.0, ("b", "c"): 3.0})


def test_a_flow_held_by_a_stalled_source_within_a_byte_waits_instead_of_stepping_in_place():
    """Seen at 1,024 workers under the night's fit (the simulation did not
    settle in 10 million events): a flow stopped by two sources within a
    byte of it, one moving, one stalled, was given an unblock time below the
    clock's resolution, so the loop stepped in place. It now waits for the
    stalled source, and everything completes."""
    from benchmarks.simulator.engine import Engine

    net = Network(1e9)
    engine = Engine(net)
    engine.now = 1.0  # late enough that 3e-8 bytes at 1e9 B/s is below the clock's step
    moving = Buffer(1000.0, pos=500.0)
    stalled = Buffer(1000.0, pos=500.0 + 1e-7)
    net.add(Flow("a", "x", moving, start=1.0))
    net.add(Flow("d", "y", stalled, start=5.0))  # stalled until t = 5
    lag = 100.0
    reader = net.add(
        Flow("x", "z", Buffer(1000.0, pos=500.0 - lag + 3e-8), sources=(moving, stalled), lag=lag)
    )
    assert engine.run(max_events=10_000) >= 5.0
    assert reader.into.complete and reader.into.pos == 1000.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 4)).filter(lambda e: e[0] != e[1]),
        min_size=1,
        max_size=12,
    ),
    st.lists(st.floats(1.0, 100.0), min_size=10, max_size=10),
)
def test_max_min_never_overloads_a_link_and_every_flow_has_a_bottleneck(edges, caps):
    net = Network(1.0)
    for h in range(5):
        net.set_capacity(str(h), up=caps[h], down=caps[5 + h])
    for src, dst in edges:
        net.add(flow(str(src), str(dst)))
    net.update_rates(0.0)
    load: dict[tuple[str, str], float] = {}
    for f in net.flows:
        for k in f.keys:
            load[k] = load.get(k, 0.0) + f.rate
    cap = {("u", str(h)): caps[h] for h in range(5)} | {
        ("d", str(h)): caps[5 + h] for h in range(5)
    }
    assert all(load[k] <= cap[k] * (1 + 1e-9) for k in load)
    for f in net.flows:
        # Max-min: some link of f is full and no flow on it gets more than f.
        assert any(
            load[k] >= cap[k] * (1 - 1e-9)
            and all(g.rate <= f.rate * (1 + 1e-9) for g in net.flows if k in g.keys)
            for k in f.keys
        )


def test_a_two_receiver_chain_takes_s_over_b_plus_one_hop():
    out = HopliteBroadcast(CLUSTER, 3, S).run()
    hop = CLUSTER.lag(S) / CLUSTER.rate
    expected = CLUSTER.overheads.setup + S / CLUSTER.rate + hop
    assert out.depth == 2  # source -> r1 -> r2: the directory made a chain
    assert out.seconds == pytest.approx(expected, rel=1e-6)


def test_pipelining_never_lets_a_receiver_overtake_its_sender():
    arrivals = {address(i): 0.05 * i for i in range(1, 12)}
    sim = HopliteBroadcast(CLUSTER, 12, S)
    violations: list[str] = []

    def check(now: float) -> None:
        for f in sim.net.flows:
            for b in f.sources:
                if not b.complete and f.into.pos > b.pos + EPS:
                    violations.append(f"{f.dst} at {f.into.pos} ahead of {b.pos} at t={now}")
        if now < 2.0:
            sim.engine.at(now + 0.013, check)

    sim.engine.at(0.0, check)
    out = sim.run(arrivals)
    assert violations == []
    assert len(out.finish) == 11


def test_a_receiver_whose_relay_dies_resumes_from_the_byte_it_reached():
    sim = HopliteBroadcast(CLUSTER, 4, S)  # chain: w0 -> w1 -> w2 -> w3
    relay, orphan = address(1), address(2)
    t_fail = 0.3
    out = sim.run(failures={relay: t_fail})
    assert out.resumes == 1
    reached = out.bytes_kept
    assert 0.5 * t_fail * CLUSTER.rate < reached < S
    # Every byte reached the orphan once: nothing was sent again from byte 0.
    carried = sum(f.carried for f in sim.history if f.dst == orphan)
    assert carried == pytest.approx(S, abs=1e3)
    assert orphan in out.finish and address(3) in out.finish
    # It waited for a free complete copy (the source serves its chain), and
    # then only had to receive the rest.
    assert out.finish[orphan] < S / CLUSTER.rate + (S - reached) / CLUSTER.rate + 0.1


def test_dask_star_takes_n_minus_one_copies_through_the_source_uplink():
    for n in (2, 5, 9):
        out = dask_broadcast(CLUSTER, n, S)
        assert out.seconds == pytest.approx(
            (n - 1) * S / CLUSTER.rate + CLUSTER.overheads.setup, rel=1e-6
        )


def test_a_reduce_chain_takes_s_over_b_plus_its_hops_and_survives_a_failure():
    sim = HopliteReduce(CLUSTER, 6, S, planner_latency=1e-6)  # a chain of 6
    hop = CLUSTER.lag(S) / CLUSTER.rate
    assert sim.tree.depth == 0
    out = sim.run()
    assert out.seconds == pytest.approx(
        CLUSTER.overheads.setup + S / CLUSTER.rate + 4 * hop, rel=1e-6
    )
    root = address(sim.tree.root)
    victim = next(address(i) for i in range(6) if address(i) != root)
    out = HopliteReduce(CLUSTER, 6, S, planner_latency=1e-6).run(failures={victim: 0.2})
    assert out.repairs == 1 and out.resumes == 0
    assert out.seconds < 2 * S / CLUSTER.rate


def test_1024_workers_broadcast_in_sane_bounds():
    # About the overheads calibrated on the emulated cluster (a chain of 1,023
    # relays, each a block plus ~10 ms behind its sender).
    cluster = Cluster(1.25e9, Overheads(efficiency=0.92, hop_latency=0.01, setup=0.002))
    out = HopliteBroadcast(cluster, 1024, 1e9).run()
    bound = 1e9 / cluster.rate
    assert len(out.finish) == 1023
    assert bound < out.seconds <= bound + 1023 * cluster.lag(1e9) / cluster.rate + 0.01


def test_a_split_broadcast_is_log_deep_and_each_uplink_sends_the_object_once():
    cluster = Cluster(1.25e9, Overheads(efficiency=1.0, hop_latency=0.02, setup=0.0))
    n, size, parts = 256, 1e9, 4
    chain = HopliteBroadcast(cluster, n, size).run()
    sim = HopliteBroadcast(cluster, n, size, parts=parts)
    out = sim.run()
    assert len(out.finish) == n - 1
    assert out.depth <= 5  # log4(255) + 1, not 255 hops
    # Every uplink carried at most the object once (parts streams of S/parts).
    sent: dict[str, float] = {}
    for f in sim.history:
        sent[f.src] = sent.get(f.src, 0.0) + f.carried
    assert max(sent.values()) <= size * (1 + 1e-9)
    assert sent[address(0)] == pytest.approx(size)
    bound = size / cluster.rate
    # Four streams share a NIC, so a hop costs parts x the latency at most.
    assert (
        bound
        < out.seconds
        <= bound + out.depth * parts * cluster.lag(size / parts, parts) / (cluster.rate)
    )
    assert out.seconds < chain.seconds / 3


def test_a_split_broadcast_survives_failures_without_overloading_a_nic():
    cluster = Cluster(1.25e9, Overheads(efficiency=1.0, hop_latency=0.02, setup=0.001))
    n, size, parts = 128, 1e9, 4
    base = HopliteBroadcast(cluster, n, size, parts=parts).run()
    rng = random.Random(1)
    victims = rng.sample([address(i) for i in range(1, n)], 6)
    fails = {w: rng.uniform(0.1, 0.9) * base.seconds for w in victims}
    sim = HopliteBroadcast(cluster, n, size, parts=parts)
    peak: dict[str, int] = {}
    add = sim.net.add

    def counted(flow):
        out = add(flow)
        busy = sum(1 for f in sim.net.flows if f.src == flow.src)
        peak[flow.src] = max(peak.get(flow.src, 0), busy)
        return out

    sim.net.add = counted
    out = sim.run(failures=fails)
    assert max(peak.values()) <= parts
    assert set(out.finish) == {address(i) for i in range(1, n)} - set(victims)
    assert out.resumes > 0
    # The orphans took the slots the dead freed: no NIC ever sent more
    # than ``parts`` streams at once, so the time stays near the bound.
    assert out.seconds < 1.25 * base.seconds


def test_a_split_reduce_is_log_deep_and_survives_a_failure():
    cluster = Cluster(1.25e9, Overheads(efficiency=1.0, hop_latency=0.02, setup=0.001))
    n, size, parts = 128, 1e9, 4
    chain = HopliteReduce(cluster, n, size, planner_latency=1e-6).run()
    split = SplitReduce(cluster, n, size, parts)
    out = split.run()
    assert out.depth <= 5 and out.seconds < chain.seconds / 2
    # Each host takes in at most ``parts`` segment streams: the object once.
    into: dict[str, int] = {}
    for r in split.trees:
        for p in r.tree.parent:
            if p is not None:
                into[r.host[p]] = into.get(r.host[p], 0) + 1
    assert max(into.values()) <= parts
    victim = address(5)
    failed = SplitReduce(cluster, n, size, parts).run(failures={victim: 0.3})
    assert failed.repairs == parts  # its node in every segment's tree
    assert out.seconds < failed.seconds < 2 * out.seconds


def test_calibration_recovers_hop_latency_and_setup_from_several_cluster_sizes(tmp_path):
    from benchmarks.simulator import calibrate

    truth = Overheads(efficiency=0.9, hop_latency=0.004, setup=0.03)
    entries = []
    for n, mbit, collective, op in [
        (4, 1000.0, "broadcast", "hoplite"),
        (8, 1000.0, "broadcast", "hoplite"),
        (16, 500.0, "broadcast", "hoplite"),
        (8, 1000.0, "reduce", "hoplite"),
        (8, 1000.0, "broadcast", "dask"),
    ]:
        m = calibrate.Measurement("x", collective, op, n, 256 * MiB, mbit, 1.0)
        entries.append(
            {
                "op": op,
                "collective": collective,
                "n_workers": n,
                "size": 256 * MiB,
                "rate_mbit": mbit,
                "seconds": calibrate.predict(m, truth),
            }
        )
    path = tmp_path / "scaling.json"
    path.write_text(json.dumps(entries))
    data = calibrate.load([str(path)])
    assert len(data) == 5
    best, fitted = calibrate.fit(data)
    assert fitted == ["efficiency", "hop_latency", "setup"]
    assert best.efficiency == pytest.approx(0.9, rel=1e-3)
    assert best.hop_latency == pytest.approx(0.004, rel=0.05)
    assert best.setup == pytest.approx(0.03, rel=0.05)
    assert all(abs(r.error) < 0.1 for r in calibrate.compare(data, best))


@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_rates_match_a_full_recomputation_at_every_event(seed, monkeypatch):
    cluster = Cluster(1.25e9, Overheads(efficiency=0.92, hop_latency=0.002, setup=0.002))
    rng = random.Random(seed)
    n = 32
    arrivals = {address(i): rng.uniform(0, 0.5) for i in range(n)}
    fails = {address(i): rng.uniform(0.1, 1.0) for i in rng.sample(range(2, n), 3)}

    def runs() -> list[object]:
        tree = HopliteReduce(cluster, n, 1e9, planner_latency=0.05, seed=seed)
        root = tree.host_of_node_before_start(tree.tree.root)
        return [
            HopliteBroadcast(cluster, n, 1e9).run(arrivals, fails).finish,
            HopliteBroadcast(cluster, n, 1e9, fanout=2).run(arrivals, None).finish,
            tree.run(None, {w: t for w, t in fails.items() if w != root}).seconds,
            dask_broadcast(cluster, n, 1e8).finish,
        ]

    fast = runs()
    monkeypatch.setattr(Network, "incremental_default", False)
    for got, full in zip(fast, runs(), strict=True):
        assert got == pytest.approx(full, rel=1e-9)


def test_runs_of_one_configuration_are_pooled_by_their_median(tmp_path):
    """A configuration measured on several days is fitted once, at its median:
    one slow day does not pull the fit, and another configuration's runs are
    not mixed in."""
    from benchmarks.simulator import calibrate

    def entry(n, mbit, seconds, collective="broadcast"):
        return {
            "op": "hoplite",
            "collective": collective,
            "n_workers": n,
            "size": 256 * MiB,
            "rate_mbit": mbit,
            "seconds": seconds,
        }

    (tmp_path / "a.json").write_text(json.dumps([entry(16, 500.0, 5.3), entry(8, 1000.0, 2.4)]))
    (tmp_path / "b.json").write_text(json.dumps([entry(16, 500.0, 7.8), entry(16, 250.0, 10.2)]))
    (tmp_path / "c.json").write_text(
        json.dumps([entry(16, 500.0, 5.8), entry(16, 500.0, 5.6, "reduce")])
    )
    data = calibrate.load([str(tmp_path / f) for f in ("a.json", "b.json", "c.json")])
    pooled = {(m.collective, m.n_workers, m.rate_mbit): m for m in calibrate.pool(data)}
    assert len(pooled) == 4
    b16 = pooled["broadcast", 16, 500.0]
    assert b16.seconds == 5.8 and sorted(b16.runs) == [5.3, 5.8, 7.8]
    assert b16.source == "a.json,b.json,c.json"
    assert pooled["reduce", 16, 500.0].runs == (5.6,)
    assert pooled["broadcast", 8, 1000.0].seconds == 2.4

    # Fitting on N = 16 only leaves a far-off N = 8 entry out of the fit.
    truth = Overheads(efficiency=0.9, hop_latency=0.004, setup=0.002)
    only16 = [
        dataclasses.replace(m, seconds=calibrate.predict(m, truth))
        for m in pooled.values()
        if m.n_workers == 16
    ]
    off8 = dataclasses.replace(pooled["broadcast", 8, 1000.0], seconds=9.0)
    # One size: setup is held at the start value (the truth's); the rest is fitted.
    start = Overheads(efficiency=0.7, hop_latency=0.02, setup=truth.setup)
    best, _ = calibrate.fit([*only16, off8], start=start, workers=[16])
    assert all(abs(r.error) < 0.5 for r in calibrate.compare(only16, best))
    with pytest.raises(ValueError, match="no hoplite measurement at N = \\[32\\]"):
        calibrate.fit(only16, workers=[32])
    best_all, _ = calibrate.fit([*only16, off8], start=start)
    assert max(abs(r.error) for r in calibrate.compare(only16, best_all)) > 5


@pytest.mark.parametrize("parts", [1, 8])
def test_a_spread_repair_keeps_every_live_node_on_a_path_to_the_root(parts):
    """The proposed repair (benchmarks/simulator/spread_repair.py): a dead
    node's children move to live nodes outside its subtree, so every live node
    still reaches the root without a cycle, and the reduction completes."""
    from benchmarks.simulator.spread_repair import SpreadReduce

    cluster = Cluster(1.25e9, Overheads(efficiency=0.9, hop_latency=0.0, setup=0.001))
    n, size = 64, 2e8
    split = SplitReduce(cluster, n, size, parts, tree_class=SpreadReduce)
    victims = {address(i): t for i, t in [(5, 0.03), (17, 0.08), (40, 0.12)]}
    out = split.run(failures=victims)
    assert out.repairs == 3 * parts  # each victim's node in every segment's tree
    for tree in split.trees:
        assert isinstance(tree, SpreadReduce)
        dead = {v for v, h in enumerate(tree.host) if h in victims}
        assert tree.gone == dead
        for v in set(range(n)) - dead:
            seen = set()
            while v != tree.tree.root:
                assert v not in seen and v not in dead
                seen.add(v)
                v = tree.parent[v]


def test_spreading_a_dead_node_costs_less_than_replacing_it_when_every_nic_is_full():
    """In split trees every NIC is full. Replacing a dead node on the worker that
    recomputed its input doubles that worker's load for the rest of the run;
    spreading its children and merging its input does not."""
    from benchmarks.simulator.spread_repair import SpreadReduce

    cluster = Cluster(1.25e9, Overheads(efficiency=0.9, hop_latency=0.0, setup=0.001))
    n, size, parts = 128, 4e8, 8
    base = SplitReduce(cluster, n, size, parts).run()
    assert SplitReduce(cluster, n, size, parts, tree_class=SpreadReduce).run().seconds == (
        pytest.approx(base.seconds)
    )
    fail = {address(9): 0.2 * base.seconds}
    replaced = SplitReduce(cluster, n, size, parts).run(failures=fail)
    spread = SplitReduce(cluster, n, size, parts, tree_class=SpreadReduce).run(failures=fail)
    assert replaced.repairs == spread.repairs == parts
    assert replaced.seconds > 1.4 * base.seconds  # 1.76x measured: about (2 - 0.2) x
    assert base.seconds < spread.seconds < 1.2 * base.seconds  # 1.01x measured


def _small_spread_tree():
    """Root 0 with children 1 and 4; node 1 with children 2 and 3; 4 with 5."""
    from benchmarks.simulator.spread_repair import SpreadReduce

    tree = ReduceTree.of((None, 0, 1, 1, 0, 4))
    cluster = Cluster(1.25e8, Overheads(efficiency=1.0, hop_latency=0.0, setup=0.001))
    return SpreadReduce(cluster, 6, 1e8, tree=tree, seed=3)


def test_a_spread_node_s_children_and_input_reach_the_root_through_patches():
    """Node 1 dies at 0.3 s (a third of the run): its parent, the root, reads
    patches in its place, from the byte it had; its children are adopted by
    nodes outside its subtree, which add them from the byte they had sent."""
    sim = _small_spread_tree()
    base = _small_spread_tree().run()
    out = sim.run(failures={address(1): 0.3})
    [(dead, b, adopted)] = sim.spreads
    assert dead == 1 and 0 < b < 1e8
    assert set(adopted) == {2, 3} and set(adopted.values()) <= {0, 4, 5}
    assert all(sim.parent[c] == a for c, a in adopted.items())
    root_sources = sim.sources[0]
    assert all(buf.complete for buf in root_sources)
    assert sim.recv[1] not in root_sources
    patches = [f for fs in sim.patches.values() for f in fs]
    assert patches and all(f.dst == address(0) and f.into.size > b for f in patches)
    assert all(f.into in root_sources for f in patches)
    # Here faster than without the failure (1.31 s against 1.61 s): the root
    # took two full streams; the dead node's input now rides in W's stream.
    assert out.seconds < 1.5 * base.seconds


def test_a_failure_the_spread_model_does_not_cover_is_an_error_not_a_result():
    sim = _small_spread_tree()
    with pytest.raises(RuntimeError, match="does not cover"):
        sim.run(failures={address(1): 0.3, address(2): 0.3})


def test_the_simulation_refuses_a_measurement_file_that_does_not_exist(capsys, tmp_path):
    """A mistyped --measurements path is an error, not a calibration on fewer runs."""
    from benchmarks import simulate

    missing = str(tmp_path / "scaling-typo.json")
    for flag in ("--measurements", "--calibrate"):
        with pytest.raises(SystemExit):
            simulate.main([flag, missing])
        assert f"no such measurement file: {missing}" in capsys.readouterr().err


def test_the_simulation_repairs_as_the_library_does_by_default(tmp_path):
    """Without --reduce-repair the simulator repairs as hoplite.reduce.repair's
    default does: a dead node spread in a reduce in parts, replaced in one tree."""
    from benchmarks import simulate

    out = str(tmp_path / "sim")
    simulate.main(
        [
            "--workers", "8", "--size", "8MiB", "--gbit", "1", "--parts", "1", "2",
            "--scenarios", "ac", "--collectives", "reduce", "--no-dask",
            "--hop-latency", "0", "--out", out,
        ]
    )  # fmt: skip
    with open(out + ".json") as f:
        rows = json.load(f)["rows"]
    methods = {r["method"] for r in rows if r["scenario"].startswith("c")}
    assert methods == {"hoplite", "hoplite-parts2-spread"}
    assert all(r["repairs"] >= 1 for r in rows if r["scenario"].startswith("c"))


def test_by_default_the_simulation_runs_the_shape_the_library_s_planner_chooses(tmp_path):
    """Without --parts the simulator asks core/shape_choice.py, as the
    library does: one chain or tree at 8 workers, split trees at 512 (faster
    there than one chain or tree). A broadcast the planner splits is received
    in byte ranges, one buffer; one cut by dask_hoplite.broadcast(parts=k)
    pays its join and its cut tasks besides."""
    from benchmarks import simulate
    from dask_hoplite.core.shape_choice import choose_parts

    def run(n, *extra):
        out = str(tmp_path / f"sim-{n}")
        simulate.main(
            [
                "--workers", str(n), "--size", "256MiB", "--gbit", "10", "--scenarios", "a",
                "--no-dask", "--hop-latency", "0.001", "--out", out, *extra,
            ]
        )  # fmt: skip
        with open(out + ".json") as f:
            data = json.load(f)
        rate = 10e9 / 8 * data["overheads"]["efficiency"]
        return rate, {(r["collective"], r["method"]): r for r in data["rows"]}

    _, small = run(8)
    assert set(small) == {("broadcast", "hoplite-auto"), ("reduce", "hoplite-auto")}
    rate, big = run(512, "--parts", "auto", "1")
    chosen = {}
    for collective in ("broadcast", "reduce"):
        parts = chosen[collective] = choose_parts(
            collective, 512, 256 * MiB, rate, 0.001, Cluster.block_bytes
        )
        assert parts > 1
        auto = big[
            collective, f"hoplite-parts{parts}-auto" + ("-spread" if collective == "reduce" else "")
        ]
        assert auto["seconds"] < big[collective, "hoplite"]["seconds"]
    k = chosen["broadcast"]
    _, cut = run(512, "--parts", str(k), "--collectives", "broadcast")
    ranges = big["broadcast", f"hoplite-parts{k}-auto"]["seconds"]
    joined = cut["broadcast", f"hoplite-parts{k}"]["seconds"]
    costs = 256 * MiB / simulate.COPY_RATE + (k + 2) * simulate.TASK_SECONDS
    assert joined - ranges == pytest.approx(costs)
