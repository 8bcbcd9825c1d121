"""Quiver: low-latency, high-throughput GNN serving on CPUs and GPUs.

The public API keeps torch-quiver's core names (``CSRTopo``, ``quiver.pyg.GraphSageSampler``,
``Feature``) so its users can switch. Heavy submodules are imported lazily.
"""

from quiver._version import __version__

__all__ = ["__version__", "CSRTopo", "Feature", "HybridSampler"]

# name -> module that defines it; imported on first attribute access so `import quiver` stays cheap
_LAZY = {"CSRTopo": "quiver.graph", "Feature": "quiver.feature", "HybridSampler": "quiver.hybrid"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'quiver' has no attribute {name!r}")
