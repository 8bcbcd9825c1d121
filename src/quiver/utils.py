"""torch-quiver's ``quiver.utils`` names on quiver: ``CSRTopo``, the GPU peer-access topology
``Topo`` (exported as ``quiver.p2pCliqueTopo``), ``init_p2p``, ``parse_size``, and
``generate_neighbour_num`` (torch-quiver's per-node sampled-size table, here the PSGS table).

On a machine without CUDA the peer-to-peer helpers do nothing and say so (a ``UserWarning``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from quiver.feature.cliques import detect_cliques
from quiver.feature.sizes import parse_bytes
from quiver.graph import CSRTopo

__all__ = [
    "CSRTopo",
    "Topo",
    "generate_neighbour_num",
    "init_p2p",
    "parse_size",
    "reindex_feature",
]


def _peer(devices: list[int]):
    def peer(i: int, j: int) -> bool:
        return i == j or bool(torch.cuda.can_device_access_peer(devices[i], devices[j]))

    return peer


class Topo:
    """Peer-to-peer (NVLink) cliques of GPUs, torch-quiver's ``quiver.p2pCliqueTopo``.

    Example::

        topo = quiver.p2pCliqueTopo([0, 1])
        print(topo.info())

    Args:
        device_list: CUDA ordinals. Without CUDA no device can read another, so each device
            is its own clique (and a ``UserWarning`` says so).
    """

    def __init__(self, device_list):
        devices = [int(d) for d in device_list]
        if torch.cuda.is_available():
            cliques = detect_cliques(len(devices), _peer(devices))
        else:
            warnings.warn(
                "p2pCliqueTopo: CUDA is not available, so there is no peer-to-peer access; "
                "each device is its own clique",
                stacklevel=2,
            )
            cliques = [[i] for i in range(len(devices))]
        self.p2pClique2Device = {c: [devices[m] for m in ms] for c, ms in enumerate(cliques)}
        self.Device2p2pClique = {d: c for c, ds in self.p2pClique2Device.items() for d in ds}

    def get_clique_id(self, device_id: int) -> int:
        """Clique id of ``device_id``."""
        if device_id not in self.Device2p2pClique:
            raise ValueError(f"device {device_id} is not in this topology's device list")
        return self.Device2p2pClique[device_id]

    def info(self) -> str:
        """One line per clique: ``Devices [0, 1] support p2p access with each other``."""
        return "".join(
            f"Devices {ds} support p2p access with each other\n"
            for ds in self.p2pClique2Device.values()
        )

    @property
    def p2p_clique(self) -> dict[int, list[int]]:
        """``{clique_id: [device ordinals]}``."""
        return self.p2pClique2Device


def init_p2p(device_list) -> None:
    """torch-quiver's ``init_p2p``: enable peer access among ``device_list``.

    PyTorch enables peer access itself on the first device-to-device copy, so with CUDA this
    only checks the ordinals; without CUDA it does nothing and warns.
    """
    if not torch.cuda.is_available():
        warnings.warn(
            "init_p2p: CUDA is not available; there is no peer access to enable", stacklevel=2
        )
        return
    count = torch.cuda.device_count()
    for d in device_list:
        if not 0 <= int(d) < count:
            raise ValueError(f"init_p2p: device {d} out of range for {count} CUDA devices")


def parse_size(size) -> int:
    """torch-quiver's ``parse_size``: bytes from ``int`` or strings like ``"200M"``/``"2GB"``."""
    return parse_bytes(size, "size")


def generate_neighbour_num(
    node_num: int,
    edge_index,
    sizes,
    resultl_path,
    device_list=None,
    parallel: bool = False,
    mode: str = "CPU",
    num_proc: int = 1,
    reverse: bool = False,
    sample: bool = False,
) -> torch.Tensor:
    """torch-quiver's per-node sampled-size table, computed as quiver's PSGS.

    torch-quiver samples every node once and stores ``len(n_id)``; here each entry is the
    *expected* number of nodes sampled for that seed (:func:`quiver.workload.psgs`, counted as
    a tree before deduplication, so it is larger than one sample's distinct count), computed
    for all nodes in one pass per hop. The file name is torch-quiver's:
    ``{resultl_path}/{sizes[0]}_{sizes[1]}_neighbour_num_{reverse}.npy`` (int32, rounded).

    Args:
        node_num: number of nodes.
        edge_index: ``[2, E]`` edges, read as torch-quiver's ``CSRTopo(edge_index)`` does.
        sizes: fanouts, e.g. ``[25, 10]``.
        resultl_path: output directory (created if missing); torch-quiver's spelling.
        device_list, parallel, mode, num_proc, sample: accepted for compatibility; the
            table is exact and cheap, so there is nothing to parallelise or subsample.
        reverse: only names the output file, as in torch-quiver.

    Returns:
        ``[node_num]`` float32 PSGS tensor (the file holds it rounded to int32).
    """
    from quiver.workload import psgs

    sizes = [int(k) for k in sizes]
    if not sizes:
        raise ValueError("sizes must name at least one hop, e.g. [25, 10]")
    topo = CSRTopo(edge_index, num_nodes=int(node_num))
    table = psgs(topo, sizes)
    out = Path(resultl_path)
    out.mkdir(parents=True, exist_ok=True)
    tag = "_".join(str(k) for k in sizes[:2])
    np.save(out / f"{tag}_neighbour_num_{reverse}.npy", np.rint(table.numpy()).astype(np.int32))
    return table


def reindex_feature(graph: CSRTopo, feature, ratio: float, shuffle_only: bool = False):
    """torch-quiver's ``reindex_feature``: rows reordered hottest (highest degree) first.

    Args:
        graph: the :class:`CSRTopo` whose row lengths (degrees) rank the nodes.
        feature: ``[N, F]`` rows in node-id order (with ``shuffle_only``: in the order
            ``graph.feature_order`` already describes).
        ratio: the leading fraction of rows (those a GPU cache would hold) that is shuffled
            among itself (``torch.randperm``, the global RNG), spreading hot rows across GPUs.
        shuffle_only: only shuffle that leading fraction of an already reordered ``feature``
            (and ``graph.feature_order`` with it); no degree sort.

    Returns:
        ``(reordered, feature_order)``: ``reordered[feature_order[v]]`` is node ``v``'s row,
        torch-quiver's ``CSRTopo.feature_order``.
    """
    if not isinstance(graph, CSRTopo):
        raise ValueError(f"reindex_feature expects a CSRTopo, got {type(graph).__name__}")
    feature = torch.as_tensor(feature)
    n = graph.node_count
    if feature.dim() != 2 or feature.shape[0] != n:
        raise ValueError(f"feature must be [{n}, F] (one row per node), got {list(feature.shape)}")
    if not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    hot = int(n * float(ratio))
    shuffle = torch.randperm(hot)
    if shuffle_only:
        order = graph.feature_order
        if order is None:
            raise ValueError("shuffle_only needs graph.feature_order (an earlier reindex)")
        # row r (< hot) takes the row at shuffle[r]: the node there moves to r
        node_at = torch.argsort(order)
        node_at[:hot] = node_at[shuffle]
        new_order = torch.empty(n, dtype=torch.int64)
        new_order[node_at] = torch.arange(n)
        feature = feature.clone()
        feature[:hot] = feature[shuffle]
        graph.feature_order = new_order
        return feature, new_order
    node_at = torch.sort(graph.degree, descending=True, stable=True).indices
    node_at[:hot] = node_at[shuffle]
    new_order = torch.empty(n, dtype=torch.int64)
    new_order[node_at] = torch.arange(n)
    return feature[node_at], new_order
