"""Feature store: tiers (GPU replicas, NVLink clique shards, host RAM, memory-mapped file),
placement policies (FAP, degree, random) and a multi-threaded CPU gather."""

from quiver.feature.cliques import detect_cliques
from quiver.feature.placement import PLACEMENTS, hot_order
from quiver.feature.sizes import parse_bytes
from quiver.feature.store import CACHE_POLICIES, DeviceConfig, Feature

__all__ = [
    "Feature",
    "DeviceConfig",
    "CACHE_POLICIES",
    "PLACEMENTS",
    "detect_cliques",
    "hot_order",
    "parse_bytes",
]
