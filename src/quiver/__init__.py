"""Quiver: low-latency, high-throughput GNN serving on CPUs and GPUs.

The public API keeps torch-quiver's names (``quiver.CSRTopo``, ``quiver.pyg.GraphSageSampler``,
``quiver.Feature``, ``quiver.utils``, ``quiver.p2pCliqueTopo``, ``quiver.init_p2p``,
``quiver.generate_neighbour_num``, ``quiver.HybridSampler``, ``quiver.multiprocessing``,
``quiver.NcclComm``, ``quiver.InferenceServer_Debug``, ``quiver.shard_tensor``) so its users
can switch;
``docs/quiver/torch-quiver.md`` maps each one. Submodules and names are imported on first use, so
``import quiver`` stays cheap.
"""

from quiver._version import __version__

__all__ = [
    "__version__",
    "CSRTopo",
    "DistFeature",
    "Feature",
    "GraphSageSampler",
    "HybridSampler",
    "InferenceServer",
    "InferenceServer_Debug",
    "MixedGraphSageSampler",
    "PartitionInfo",
    "RequestBatcher",
    "SampleJob",
    "generate_neighbour_num",
    "getNcclId",
    "init_p2p",
    "load_quiver_feature_partition",
    "NcclComm",
    "p2pCliqueTopo",
    "quiver_partition_feature",
]

# name -> (module that defines it, its name there); imported on first attribute access
_LAZY = {
    "CSRTopo": ("quiver.graph", "CSRTopo"),
    "DistFeature": ("quiver.feature.dist", "DistFeature"),
    "NcclComm": ("quiver.feature.dist", "NcclComm"),
    "getNcclId": ("quiver.feature.dist", "getNcclId"),
    "PartitionInfo": ("quiver.partition", "PartitionInfo"),
    "load_quiver_feature_partition": ("quiver.partition", "load_quiver_feature_partition"),
    "quiver_partition_feature": ("quiver.partition", "quiver_partition_feature"),
    "Feature": ("quiver.feature", "Feature"),
    "GraphSageSampler": ("quiver.pyg", "GraphSageSampler"),
    "HybridSampler": ("quiver.hybrid", "HybridSampler"),
    "MixedGraphSageSampler": ("quiver.pyg", "MixedGraphSageSampler"),
    "SampleJob": ("quiver.pyg", "SampleJob"),
    "RequestBatcher": ("quiver.serving.queues", "RequestBatcher"),
    "InferenceServer": ("quiver.serving.queues", "InferenceServer"),
    "InferenceServer_Debug": ("quiver.serving.queues", "InferenceServer_Debug"),
    "generate_neighbour_num": ("quiver.utils", "generate_neighbour_num"),
    "init_p2p": ("quiver.utils", "init_p2p"),
    "p2pCliqueTopo": ("quiver.utils", "Topo"),
}
# submodules reachable as attributes after a bare `import quiver` (torch-quiver's `quiver.pyg`)
_SUBMODULES = (
    "comm",
    "datasets",
    "feature",
    "graph",
    "hybrid",
    "models",
    "multiprocessing",
    "partition",
    "pyg",
    "sampling",
    "serving",
    "shard_tensor",
    "utils",
    "workload",
)


# names whose objects go to torch.multiprocessing workers: as torch-quiver's `import quiver`
# does, reaching them registers quiver.multiprocessing's shared-memory reductions
_SHARED_IN_WORKERS = frozenset(
    ("CSRTopo", "DistFeature", "Feature", "GraphSageSampler", "MixedGraphSageSampler")
)


def __getattr__(name):
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        if name in _SHARED_IN_WORKERS:
            importlib.import_module("quiver.multiprocessing")
        return getattr(importlib.import_module(module), attr)
    if name == "pyg":
        importlib.import_module("quiver.multiprocessing")  # quiver.pyg.GraphSageSampler
    if name in _SUBMODULES:
        return importlib.import_module(f"quiver.{name}")
    raise AttributeError(f"module 'quiver' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
