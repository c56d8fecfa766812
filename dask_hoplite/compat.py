"""The range of ``distributed`` that dask-hoplite is tested against.

The worker part overrides private internals of ``distributed``
(``Worker.gather_dep``, the ``GatherDep*Event`` classes, ``worker.state.tasks``,
the Active Memory Manager's ``_find_dropper``, ``Scheduler.replicate``). They have
been stable for years, but a release outside the tested range could change them
silently, so the plugin refuses to start there instead of misbehaving.

It also holds the workarounds for behaviour of the tested releases that
dask-hoplite must not rely on (:func:`worker_addresses`).
"""

from __future__ import annotations

__all__ = ["UnsupportedDistributed", "check_distributed_version", "worker_addresses"]

from typing import Any

import distributed
from packaging.version import Version

from dask_hoplite.errors import UnsupportedDistributed

#: Inclusive lower and exclusive upper bound of the tested releases.
TESTED_RANGE = (Version("2026.8.0"), Version("2026.9.0"))


def installed_distributed_version() -> str:
    return distributed.__version__


def check_distributed_version(version: str | None = None) -> None:
    """Raise :class:`UnsupportedDistributed` unless ``version`` (default: the
    installed one) lies in :data:`TESTED_RANGE`."""
    version = version or installed_distributed_version()
    low, high = TESTED_RANGE
    try:
        v = Version(version)
    except Exception as e:
        raise UnsupportedDistributed(f"cannot parse distributed version {version!r}") from e
    if not low <= v < high:
        raise UnsupportedDistributed(
            f"dask-hoplite is tested with distributed >= {low}, < {high}; this process "
            f"runs distributed {version}. Install a tested release "
            f"(pip install 'distributed>={low},<{high}') or a dask-hoplite that supports {version}."
        )


def worker_addresses(client: Any) -> list[str]:
    """The addresses of the cluster's workers, sorted, asked of the scheduler.

    Not ``client.scheduler_info(n_workers=-1)["workers"]``: in the tested
    releases that call refreshes the client's cached identity and returns the
    cache, which the client's periodic refresh (asking for no workers) can
    overwrite in between, so a live cluster sometimes looks empty."""
    return sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
