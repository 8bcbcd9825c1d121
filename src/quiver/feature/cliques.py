"""Peer-access cliques among GPUs: devices that can all read each other's memory (NVLink)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["detect_cliques"]


def detect_cliques(num_devices: int, peer_access: Callable[[int, int], bool]) -> list[list[int]]:
    """Partition devices ``0..num_devices-1`` into cliques of mutual peer access.

    Greedy in device order: a device joins the first clique whose every member it can read
    and that can read it back; otherwise it starts a new clique. On the usual topologies
    (all-to-all NVLink; DGX-1's two fully connected quads; PCIe-only boxes) this finds the
    maximal cliques.

    Args:
        num_devices: number of devices.
        peer_access: ``peer_access(i, j)`` is true when device ``i`` can read device ``j``'s
            memory directly (``torch.cuda.can_device_access_peer`` on CUDA).

    Returns:
        Cliques as sorted lists of device positions, covering every device exactly once.
    """
    cliques: list[list[int]] = []
    for d in range(num_devices):
        for c in cliques:
            if all(peer_access(d, m) and peer_access(m, d) for m in c):
                c.append(d)
                break
        else:
            cliques.append([d])
    return cliques


def clique_of(cliques: Sequence[Sequence[int]], device: int) -> list[int]:
    """The clique holding ``device``."""
    for c in cliques:
        if device in c:
            return list(c)
    raise AssertionError(f"device {device} is in no clique")  # cliques cover all devices
