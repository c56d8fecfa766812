"""dask-hoplite's logging: warnings visible by default, and the worker part's
records in the worker's own log.

Everything logs through ``logging.getLogger(__name__)`` under the
``dask_hoplite`` logger. :func:`show_warnings` makes its WARNING and worse
records reach standard error in a process where nobody configured logging
for them (Python would otherwise show them only while the logger has no
handler at all, and the worker's log handler is one), in Dask's log format;
:func:`to_worker_log` adds a worker's log handler (what
``client.get_worker_logs()`` reads) while the plugin runs there.
"""

from __future__ import annotations

import logging
import sys

import dask.config

#: The package's logger.
package_logger = logging.getLogger("dask_hoplite")


class _StderrHandler(logging.StreamHandler):
    """The handler :func:`show_warnings` adds (recognised, so added once)."""


def show_warnings() -> None:
    """Show ``dask_hoplite``'s warnings on standard error, unless logging is
    configured for them already: a handler on the root logger, or a stream or
    file handler on the package's (a worker's log handler is neither)."""
    configured = logging.getLogger().handlers or any(
        isinstance(h, logging.StreamHandler) for h in package_logger.handlers
    )
    if configured:
        return
    handler = _StderrHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(dask.config.get("distributed.admin.log-format")))
    package_logger.addHandler(handler)


def to_worker_log(handler: logging.Handler | None) -> None:
    """Also send the package's records to ``handler`` (a worker's log; None:
    the worker has none)."""
    if handler is not None:
        package_logger.addHandler(handler)


def off_worker_log(handler: logging.Handler | None) -> None:
    if handler is not None:
        package_logger.removeHandler(handler)
