"""The ``/hoplite`` page on the scheduler's dashboard, and its JSON route.

``/hoplite`` is a Bokeh document (BokehJS inlined: the page needs nothing from
the internet) whose data sources poll ``/hoplite.json`` every
``POLL_MS`` milliseconds and redraw:

* the live broadcast chains and reduce trees: workers on a circle, one
  segment per stream from sender to receiver, as thick as the share of the
  object sent so far, coloured by status (streaming, stalled, resumed;
  :data:`dask_hoplite.dashboard.state.COLOURS`), with hover details;
* a table of those streams with their bytes so far;
* the latest collectives with their time as a ratio to S/B;
* the counters of the scheduler and of every worker, summed.

``/hoplite.json`` serves :func:`dask_hoplite.dashboard.state.page_state` as it
is, for scripts. :class:`DashboardRoutes` adds both routes to the scheduler's
HTTP server (as an application of its own, removed again by ``restore``); it
gets the state from a callable and never sees the plugin.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tornado import web

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

PAGE = "/hoplite"
JSON = "/hoplite.json"
#: How often the page asks for new data.
POLL_MS = 500

State = Callable[[], dict[str, Any]]


def _source(state: dict[str, Any], name: str) -> Any:
    """A data source holding ``state[name]``, refreshed from the JSON route."""
    from bokeh.models import AjaxDataSource, CustomJS

    return AjaxDataSource(
        name=name,
        data=state[name],
        data_url=JSON,
        polling_interval=POLL_MS,
        mode="replace",
        method="GET",
        adapter=CustomJS(code=f"return cb_data.response.{name}"),
    )


def _stream_plot(workers: Any, edges: Any) -> Any:
    """Workers on a circle, a segment per stream with an arrow head."""
    from bokeh.models import HoverTool, Range1d
    from bokeh.models.annotations import LabelSet
    from bokeh.models.annotations.arrows import Arrow, VeeHead
    from bokeh.plotting import figure

    fig = figure(
        title="Live streams: broadcast chains and reduce trees (sender → receiver)",
        x_range=Range1d(start=-1.6, end=1.6),
        y_range=Range1d(start=-1.3, end=1.3),
        width=640,
        height=520,
        tools="",
        toolbar_location=None,
        name="live",
    )
    fig.axis.visible = False
    fig.grid.visible = False
    seg = fig.segment(
        "x0", "y0", "x1", "y1", source=edges, line_color="colour", line_width="width", alpha=0.8
    )
    heads = Arrow(
        end=VeeHead(size=12, fill_color="#555555", line_color="#555555"),
        x_start="x0",
        y_start="y0",
        x_end="xa",
        y_end="ya",
        source=edges,
    )
    # The segments are the bodies. (Bokeh's type stubs name the property
    # body_line_alpha; Bokeh itself knows it as line_alpha.)
    heads.line_alpha = 0  # type: ignore[attr-defined]
    fig.add_layout(heads)
    fig.scatter("x", "y", source=workers, size=18, color="#636363")
    fig.add_layout(
        LabelSet(x="x", y="y", text="address", source=workers, y_offset=12, text_font_size="9pt")
    )
    tips = [
        ("key", "@key (@kind)"),
        ("edge", "@sender → @receiver"),
        ("bytes", "@progress / @nbytes"),
        ("status", "@status (stalled @stalled s)"),
    ]
    fig.add_tools(HoverTool(renderers=[seg], tooltips=tips))
    return fig


def _table(source: Any, name: str, width: int, height: int, columns: list[tuple]) -> Any:
    """A table of ``source``: ``columns`` as (field, title[, integer?])."""
    from bokeh.models.widgets import DataTable, NumberFormatter, StringFormatter, TableColumn

    integer, text = NumberFormatter(format="0,0"), StringFormatter()
    return DataTable(
        source=source,
        name=name,
        width=width,
        height=height,
        columns=[
            TableColumn(field=c[0], title=c[1], formatter=integer if c[2:] else text)
            for c in columns
        ],
    )


def render_page(state: dict[str, Any]) -> str:
    """The page's HTML: a Bokeh document starting from ``state``."""
    from bokeh.embed import file_html
    from bokeh.layouts import column, row
    from bokeh.models.widgets import Div
    from bokeh.resources import INLINE

    workers, edges = _source(state, "workers"), _source(state, "edges")
    collectives, counters = _source(state, "collectives"), _source(state, "counters")
    edge_table = _table(edges, "edge-table", 640, 200, [
        ("key", "key"), ("kind", "kind"), ("sender", "sender"), ("receiver", "receiver"),
        ("progress", "bytes so far", 1), ("nbytes", "of", 1), ("status", "status"),
    ])  # fmt: skip
    coll_table = _table(collectives, "collective-table", 560, 260, [
        ("kind", "collective"), ("outcome", "outcome"), ("inputs", "inputs"),
        ("nbytes", "bytes", 1), ("seconds", "seconds"), ("ratio", "time / (S/B)"),
    ])  # fmt: skip
    count_table = _table(counters, "counter-table", 560, 300, [
        ("name", "counter"), ("value", "value", 1),
    ])  # fmt: skip
    legend = Div(
        text=(
            "<b>dask-hoplite</b>: colours: <span style='color:#2b8cbe'>streaming</span>, "
            "<span style='color:#e31a1c'>stalled</span>, "
            "<span style='color:#ff7f00'>resumed / repaired</span>; width: share sent. "
            f"S/B with B = {state['bandwidth'] / 1e6:,.0f} MB/s per host "
            f"(<a href='{JSON}'>JSON</a>)"
        ),
        width=1200,
    )
    layout = column(
        legend,
        row(
            column(_stream_plot(workers, edges), edge_table),
            column(Div(text="<b>Recent collectives</b>"), coll_table, count_table),
        ),
    )
    return file_html(layout, INLINE, title="dask-hoplite")


class _JsonHandler(web.RequestHandler):
    def initialize(self, state: State) -> None:
        self.state = state

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(self.state(), default=str))


class _PageHandler(web.RequestHandler):
    def initialize(self, state: State) -> None:
        self.state = state

    def get(self) -> None:
        if importlib.util.find_spec("bokeh") is None:
            self.set_status(501)
            self.write("The /hoplite page needs bokeh (pip install bokeh); /hoplite.json works.")
            return
        self.write(render_page(self.state()))


class DashboardRoutes:
    """``/hoplite`` and ``/hoplite.json`` on the scheduler's HTTP server."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.app: web.Application | None = None
        self.scheduler: Scheduler | None = None

    def install(self, s: Scheduler) -> None:
        http = getattr(s, "http_application", None)
        if http is None or not hasattr(http, "applications"):
            logger.info("the scheduler has no HTTP server: no /hoplite page")
            return
        kwargs = {"state": self.state}
        self.app = web.Application([(PAGE, _PageHandler, kwargs), (JSON, _JsonHandler, kwargs)])
        http.add_application(self.app)
        self.scheduler = s

    def restore(self) -> None:
        s, app = self.scheduler, self.app
        self.scheduler = self.app = None
        if s is not None and app is not None and app in s.http_application.applications:
            s.http_application.applications.remove(app)
