"""dask-hoplite's features, what each needs, and which of them are on.

dask-hoplite is several features, each resting on its own few private
internals of ``distributed`` and ``dask`` (:data:`dask_hoplite.compat.PRIVATE_INTERNALS`
names which). When a release changes an internal, only the feature that needs
it turns off, and Dask's own way takes over for what that feature did; the
others keep running, and the plugin never stops a scheduler or a worker from
starting because of it.

Every feature needs the transport: with the transport off, everything takes
Dask's path. A worker runs a feature only where the scheduler runs it too; the
scheduler knows which workers run which (a worker without the worker part, or
with a feature off, gets Dask's path for what that feature does there).

Plain data, no I/O: :meth:`FeatureSet.decide` turns the drifts found by
:func:`dask_hoplite.compat.find_drifts` into the set of features that are on,
and :meth:`FeatureSet.reports` into what the plugins log and tell
``client.get_events("hoplite")``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

TRANSPORT = "transport"
FETCH = "fetch"
REPLICATE = "replicate"
COLLECTIVES = "collectives"
AMM_GUARD = "amm-guard"
PROMPT_STEALING = "prompt-stealing"
GRAPH_REDUCTIONS = "graph-reductions"
ACCOUNTING = "accounting"
DASHBOARD = "dashboard"


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature: ``what`` it does, what Dask does ``instead`` while it is
    off, and the features it ``requires``."""

    name: str
    what: str
    instead: str
    requires: tuple[str, ...] = (TRANSPORT,)


#: Every feature, each after the ones it requires.
FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature(
            TRANSPORT,
            "block streams between workers and the object directory on the scheduler",
            "Dask's own transfers for everything",
            requires=(),
        ),
        Feature(
            FETCH,
            "the transparent fetch of large keys (Worker.gather_dep)",
            "Dask's gather_dep fetches every key",
        ),
        Feature(
            REPLICATE,
            "pipelined client.replicate and scatter(broadcast=True)",
            "Dask's replicate and gather endpoint",
        ),
        Feature(
            COLLECTIVES,
            "reduce trees for dask_hoplite.reduce and allreduce",
            "each reduction is one Dask task on one worker",
        ),
        Feature(
            AMM_GUARD,
            "the Active Memory Manager spares the replicas a stream reads or writes",
            "the AMM drops replicas as it chooses; a broken stream resumes from another holder",
        ),
        Feature(
            PROMPT_STEALING,
            "tasks needing a large key move to idle workers within hoplite.stealing.delay",
            "Dask's work stealing moves them at its interval (work-stealing-interval)",
        ),
        Feature(
            GRAPH_REDUCTIONS,
            "dask.array reductions and dask.bag folds as reduce trees",
            "array and bag aggregates run as Dask tasks",
        ),
        Feature(
            ACCOUNTING,
            "hoplite's transfers in Dask's transfer logs, counters and metrics",
            "Dask's tools see only Dask's own transfers",
        ),
        Feature(
            DASHBOARD,
            "the /hoplite page, hoplite's /metrics series and its records in worker logs",
            "no /hoplite page or hoplite series",
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Drift:
    """A private internal that is gone or changed, and the feature needing it."""

    feature: str
    internal: str
    problem: str


@dataclasses.dataclass(frozen=True)
class FeatureOff:
    """Why a feature is off: the ``drift`` that turned it off, or the
    feature it needs that is off (``because``), or the other side's choice."""

    feature: str
    reason: str
    drift: Drift | None = None
    because: str | None = None


@dataclasses.dataclass(frozen=True)
class FeatureSet:
    """The features that are on; for each one off, why."""

    on: frozenset[str]
    off: tuple[FeatureOff, ...] = ()

    @classmethod
    def all_on(cls) -> FeatureSet:
        return cls(frozenset(FEATURES))

    @classmethod
    def decide(
        cls,
        drifts: Iterable[Drift] = (),
        allowed: Iterable[str] | None = None,
        disabled: Mapping[str, str] | None = None,
    ) -> FeatureSet:
        """The features on, given the ``drifts`` found here, the features
        ``allowed`` by the other side (the scheduler's, for a worker; None:
        all) and those ``disabled`` here on purpose (feature -> why)."""
        allowed_set = set(FEATURES) if allowed is None else set(allowed)
        off: dict[str, FeatureOff] = {}
        for d in drifts:
            if d.feature not in off:
                off[d.feature] = FeatureOff(d.feature, f"{d.internal} changed: {d.problem}", d)
        for name, why in (disabled or {}).items():
            off.setdefault(name, FeatureOff(name, why))
        for name in FEATURES:
            if name not in allowed_set:
                off.setdefault(name, FeatureOff(name, "off on the scheduler"))
        for name, f in FEATURES.items():  # requirements come first
            missing = [r for r in f.requires if r in off]
            if missing and name not in off:
                off[name] = FeatureOff(
                    name, f"it needs the {missing[0]}, which is off", because=missing[0]
                )
        on = frozenset(n for n in FEATURES if n not in off)
        return cls(on, tuple(off[n] for n in FEATURES if n in off))

    def __contains__(self, name: object) -> bool:
        return name in self.on

    def drifted(self) -> list[FeatureOff]:
        """The features turned off by a drift here (one warning each)."""
        return [o for o in self.off if o.drift is not None]

    def to_msg(self) -> dict[str, object]:
        return {"on": sorted(self.on), "off": {o.feature: o.reason for o in self.off}}


def announce(
    features: FeatureSet, where: str, version: str, log_event: Callable[[str, Any], Any]
) -> list[str]:
    """For each feature a drift turned off on ``where``: one WARNING and one
    ``hoplite`` event (``log_event``: a scheduler's or worker's
    ``log_event``) naming the feature and the internal. Returns the warnings."""
    texts = []
    for off in features.drifted():
        followers = sorted(o.feature for o in features.off if o.because == off.feature)
        text = warning_text(off, where, version, followers)
        logger.warning(text)
        assert off.drift is not None
        event = {
            "action": "feature-off",
            "feature": off.feature,
            "internal": off.drift.internal,
            "problem": off.drift.problem,
            "also_off": followers,
            # Where it turned off ("the scheduler <address>" or "worker <address>").
            "worker": where,
        }
        try:
            log_event("hoplite", event)
        except Exception as e:  # no scheduler to tell: the warning stays
            logger.debug("could not log the feature-off event: %s", e)
        texts.append(text)
    return texts


def warning_text(off: FeatureOff, where: str, version: str, followers: Iterable[str]) -> str:
    """The one WARNING for a feature a drift turned off on ``where``."""
    f = FEATURES[off.feature]
    then = sorted(followers)
    also = f" With it, off too: {', '.join(then)}." if then else ""
    rest = " The other features keep running." if off.feature != TRANSPORT else ""
    return (
        f"dask-hoplite turns off its {off.feature} ({f.what}) on {where}: {off.reason} "
        f"(distributed {version}). {f.instead[0].upper()}{f.instead[1:]}.{also}{rest}"
    )
