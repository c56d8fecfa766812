"""The /hoplite page on a real multi-process cluster, with a broadcast held
mid-stream: its sender is SIGSTOPped once the first stream is under way, so
the chain stays live (and stalled) for as long as the test looks at it.

The browser test drives Debian's ``chromium`` through ``chromedriver``
(selenium) against the page and saves a screenshot: set
``HOPLITE_DASHBOARD_SCREENSHOT`` to a path to keep it (the docs' image was
made that way)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.request

import dask
import numpy as np
import pytest
from conftest import process_workers

import dask_hoplite as dh

SIZE = 768 * 2**20  # big enough that the stream is caught before it ends


def _json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _wait(what, predicate, timeout=60.0, every=0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def held_broadcast():
    """A cluster of 3 worker processes and a broadcast from the first to the
    other two whose sender is stopped mid-stream. Yields (client, dashboard
    base URL, key, sender, receivers); the sender resumes at the end and the
    broadcast must then finish with the right values.

    The slow-relay rule is off here. The stopped sender starves the relay,
    and the rule, seeing a relay fall behind a complete copy, moves it out of
    the chain: its receiver resumes from the stopped sender and the relay
    waits for a sender, on no edge. The page then rightly draws one edge, but
    this test wants the chain held as it was built (it failed now and then,
    whenever the rule judged before the page was read). One copy per host is
    off too: the three workers share a host, where the second receiver would
    map the first one's copy once complete instead of streaming from it.

    The sender is stopped once a receiver has bytes; on a loaded machine the
    broadcast may be over by then (the poll's round trips wait on workers
    busy receiving), and then it is tried again with another key."""
    with (
        dask.config.set({"hoplite.broadcast.slow-relay.ratio": 0, "hoplite.host-sharing": False}),
        process_workers(3) as (cluster, client),
    ):
        base = client.dashboard_link.rsplit("/", 1)[0]
        pids = {n.worker_address: n.process.pid for n in cluster.workers.values()}
        src, *receivers = sorted(pids)

        def bytes_in(dask_worker):
            ctx = dask_worker.plugins["hoplite-worker"].parts.ctx
            return sum(s.buf.progress for s in ctx.incoming)

        def unfinished(dask_worker):
            ctx = dask_worker.plugins["hoplite-worker"].parts.ctx
            return any(s.buf.progress < s.buf.nbytes for s in ctx.incoming)

        for attempt in range(5):
            x = client.submit(np.full, SIZE // 8, 3.0, workers=[src], key=f"held-x-{attempt}")
            x.result()
            copies = dh.broadcast(x, receivers)
            _wait(
                "a stream to start", lambda: any(client.run(bytes_in, workers=receivers).values())
            )
            os.kill(pids[src], signal.SIGSTOP)
            time.sleep(0.5)  # bytes in flight land
            if any(client.run(unfinished, workers=receivers).values()):
                break
            os.kill(pids[src], signal.SIGCONT)
            client.gather(copies)  # and the next attempt drops this one
        else:
            pytest.fail("every broadcast was over before its sender could be stopped")
        try:
            yield client, base, x.key, src, receivers
        finally:
            os.kill(pids[src], signal.SIGCONT)
        sums = client.gather(client.map(np.sum, copies, pure=False))
        assert sums == [3.0 * (SIZE // 8)] * len(receivers)


def test_the_json_route_shows_the_running_broadcast_and_its_stall(held_broadcast):
    client, base, key, src, receivers = held_broadcast

    def stalled_edges():
        e = _json(f"{base}/hoplite.json")["edges"]
        rows = list(zip(e["key"], e["sender"], e["receiver"], e["status"], strict=True))
        return [r for r in rows if r[0] == key and r[3] == "stalled"] and rows

    rows = _wait("a stalled edge on /hoplite.json", stalled_edges, every=0.25)
    edges = {(s, r) for k, s, r, _ in rows if k == key}
    # Every receiver is on an edge, and the chain starts at the stopped sender.
    assert {r for _, r in edges} == set(receivers)
    assert src in {s for s, _ in edges}
    state = _json(f"{base}/hoplite.json")
    assert set(state["workers"]["address"]) == {src, *receivers}
    e = state["edges"]
    assert any(0 < p < n for p, n in zip(e["progress"], e["nbytes"], strict=True))


def _browser():
    """A headless Chromium under selenium, or a skip (a failure on CI)."""
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        if os.environ.get("CI"):
            pytest.fail("CI must install chromium and chromium-driver (ci/test.sh does)")
        pytest.skip("needs Debian's chromium and chromium-driver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)


def test_the_page_draws_the_running_broadcast_in_chromium(held_broadcast, tmp_path):
    client, base, key, src, receivers = held_broadcast
    browser = _browser()
    try:
        browser.get(f"{base}/hoplite")

        def drawn():
            # What the page's own data source holds after its latest poll.
            return browser.execute_script(
                """
                const doc = window.Bokeh && Bokeh.documents[0];
                const src = doc && doc.get_model_by_name("edges");
                if (!src) return null;
                const d = src.data;
                return Array.from(d.key).map((k, i) => [k, d.sender[i], d.receiver[i], d.status[i]]);
                """
            )

        rows = _wait(
            "the page to draw a stalled edge",
            lambda: [r for r in (drawn() or []) if r[0] == key and r[3] == "stalled"] and drawn(),
            every=0.25,
        )
        assert {r for k, _, r, _ in rows if k == key} == set(receivers)
        # The rendering itself: a canvas with the plot and the tables' cells.
        assert browser.execute_script("return document.title") == "dask-hoplite"
        shot = os.environ.get("HOPLITE_DASHBOARD_SCREENSHOT") or str(tmp_path / "hoplite.png")
        time.sleep(1.0)  # let the plot repaint after the last poll
        assert browser.save_screenshot(shot)
        assert os.path.getsize(shot) > 20_000
    finally:
        browser.quit()
