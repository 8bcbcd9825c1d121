"""Feature store: tiers (GPU replicas, NVLink clique shards, host RAM, memory-mapped file),
placement policies (FAP, degree, random) and a multi-threaded CPU gather; rows partitioned
across hosts (``DistFeature`` for training, ``PeerFeature`` for serving)."""

from quiver.feature.cliques import detect_cliques
from quiver.feature.dist import DistFeature
from quiver.feature.partition import Partition, Router, load_partition, make_partition
from quiver.feature.partition_info import PartitionInfo
from quiver.feature.peer import PeerConfig, PeerFeature
from quiver.feature.placement import PLACEMENTS, hot_order
from quiver.feature.sizes import parse_bytes
from quiver.feature.store import CACHE_POLICIES, DeviceConfig, Feature

__all__ = [
    "Feature",
    "DistFeature",
    "PeerFeature",
    "PeerConfig",
    "Partition",
    "PartitionInfo",
    "Router",
    "load_partition",
    "make_partition",
    "DeviceConfig",
    "CACHE_POLICIES",
    "PLACEMENTS",
    "detect_cliques",
    "hot_order",
    "parse_bytes",
]
