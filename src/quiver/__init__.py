"""Quiver: low-latency, high-throughput GNN serving on CPUs and GPUs.

The public API keeps torch-quiver's core names (``CSRTopo``, ``quiver.pyg.GraphSageSampler``,
``Feature``) so its users can switch. Heavy submodules are imported lazily.
"""

from quiver._version import __version__

__all__ = ["__version__"]
