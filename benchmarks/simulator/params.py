"""What the simulator assumes about a cluster: the nominal NIC rate, the block
size of the pipelined streams, and the overheads the real system has on top of
the wire, which are calibrated against the emulated cluster
(:mod:`benchmarks.simulator.calibrate`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

MiB = 2**20


@dataclass(frozen=True)
class Overheads:
    """The calibration parameters.

    ``efficiency``: the share of the nominal NIC rate a host achieves, each way
    (TCP payload share, CPU per byte on the hosts).
    ``hop_latency``: seconds a pipelined hop adds beyond one block's
    transmission time (wake-ups, scheduling, messages per block); a relay
    stays ``block + hop_latency * rate`` bytes behind its sender.
    ``setup``: seconds from a decision (a sender assigned, a task started) to a
    stream's first byte (request, connection, first message).
    """

    efficiency: float = 0.93
    hop_latency: float = 0.005
    setup: float = 0.002


@dataclass(frozen=True)
class Cluster:
    """A cluster of one worker per host, each with a full-duplex NIC."""

    bandwidth: float  # nominal bytes/s per host and direction
    overheads: Overheads = Overheads()
    block_bytes: int = 512 * 1024  # hoplite.block-bytes
    min_block_bytes: int = 32 * 1024  # hoplite.min-block-bytes
    min_blocks: int = 16  # hoplite.min-blocks

    @property
    def rate(self) -> float:
        """Bytes/s a host achieves each way."""
        return self.bandwidth * self.overheads.efficiency

    def block(self, size: float) -> float:
        """The block size hoplite uses for an object of ``size`` bytes."""
        return max(self.min_block_bytes, min(self.block_bytes, size / self.min_blocks))

    def lag(self, size: float, streams: int = 1) -> float:
        """Bytes a relay holds beyond what it has forwarded, on a stream that
        gets ``1/streams`` of its host's rate (the hop latency is a time: at
        a lower rate fewer bytes arrive meanwhile)."""
        return self.block(size) + self.overheads.hop_latency * self.rate / streams

    def with_overheads(self, **kw: float) -> Cluster:
        return replace(self, overheads=replace(self.overheads, **kw))


def address(i: int) -> str:
    """Worker ``i``'s address, one host each (the directory keys by host)."""
    return f"tcp://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8786"
