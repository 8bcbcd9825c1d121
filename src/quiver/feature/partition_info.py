"""torch-quiver's ``PartitionInfo`` (``quiver.feature.PartitionInfo``, also
``quiver.PartitionInfo`` and ``quiver.partition.PartitionInfo``): which host owns each feature
row and how a gather is routed; :class:`quiver.feature.DistFeature` reads it."""

from __future__ import annotations

import torch

__all__ = ["PartitionInfo"]


class PartitionInfo:
    """torch-quiver's ``PartitionInfo``: which host holds each row, and this host's rows.

    A host's feature holds, in this order, the rows it owns (ascending ids) and then the
    ``replicate`` rows (in the order given): torch-quiver's local layout.
    ``DistFeature(feature, info, comm)`` (:mod:`quiver.feature.dist`) reads it.

    Args:
        device: where torch-quiver kept its maps (CPU here; a CUDA device is accepted and
            the maps stay on the CPU).
        host: this host's id (its ``torch.distributed`` rank).
        hosts: the number of hosts.
        global2host: ``[N]`` owner host of every node (``partition_book``).
        replicate: ids of remote rows this host also holds (``cache_res``), or None.
    """

    def __init__(self, device, host: int, hosts: int, global2host, replicate=None):
        owner = torch.as_tensor(global2host).to(torch.int64).cpu().reshape(-1)
        self.device = device
        self.host, self.hosts = int(host), int(hosts)
        if not 0 <= self.host < self.hosts:
            raise ValueError(f"host {host} out of range for {hosts} hosts")
        if owner.numel() and (int(owner.min()) < 0 or int(owner.max()) >= self.hosts):
            raise ValueError(f"global2host holds host ids outside [0, {self.hosts})")
        self.owner = owner
        self.size = owner.numel()
        owned = torch.nonzero(owner == self.host).reshape(-1)
        rep = (
            torch.zeros(0, dtype=torch.int64)
            if replicate is None
            else torch.as_tensor(replicate).to(torch.int64).cpu().reshape(-1)
        )
        if rep.numel() and bool((owner[rep] == self.host).any()):
            raise ValueError("replicate holds rows this host owns already")
        #: global ids of this host's feature rows, in its local order
        self.local_order = torch.cat([owned, rep])
        self.replicate = rep if replicate is not None else None
        self.global2host = owner.clone()
        self.global2host[rep] = self.host
        # torch-quiver's global2local: a row's index on the host that will answer it
        self.global2local = torch.empty(self.size, dtype=torch.int64)
        for h in range(self.hosts):
            ids = torch.nonzero(owner == h).reshape(-1)
            self.global2local[ids] = torch.arange(ids.numel())
        self.global2local[rep] = torch.arange(owned.numel(), owned.numel() + rep.numel())

    def dispatch(self, ids):
        """``(host_ids, host_orders)``: per host, the local indices of the ``ids`` it answers
        and their positions in ``ids`` (torch-quiver's routing of a gather)."""
        ids = torch.as_tensor(ids).to(torch.int64).cpu().reshape(-1)
        where = self.global2host[ids]
        host_ids, host_orders = [], []
        for h in range(self.hosts):
            pos = torch.nonzero(where == h).reshape(-1)
            host_orders.append(pos)
            host_ids.append(self.global2local[ids[pos]])
        return host_ids, host_orders
