"""Route each request to the serving host that holds most of the feature rows it touches.

With a ``quiver partition`` served by K hosts (``quiver serve --host-rank R --hosts K``),
every host answers every request, but a request sent to the host owning (or replicating) most
of the rows its seeds and their in-neighbours read fetches the fewest rows remotely.
:class:`RoutedClient` is that choice on the client side, with
:class:`quiver.feature.Router` (the same rule ``quiver partition`` replicates for)::

    client = RoutedClient(["http://h0:8000", "http://h1:8000"], "data/products-like")
    client.predict([1, 2, 3])        # sent to client.host_for([1, 2, 3])

A load balancer in front of the hosts can call :meth:`RoutedClient.host_for` the same way.
"""

from __future__ import annotations

from quiver.serving.client import Client

__all__ = ["RoutedClient"]


class RoutedClient:
    """A :class:`~quiver.serving.client.Client` per host, choosing one per request.

    Args:
        urls: the hosts' base URLs, indexed by host rank (``urls[r]`` serves
            ``--host-rank r``).
        dataset_dir: the prepared dataset (its in-neighbour topology gives the rows a request
            touches).
        partition_dir: where the partition is (default ``dataset_dir``; see
            :func:`quiver.feature.partition.find_partition`).
        timeout: seconds per request.
    """

    def __init__(self, urls, dataset_dir, partition_dir=None, timeout: float = 30.0):
        from quiver.datasets import load_prepared
        from quiver.feature.partition import Router, find_partition

        part = find_partition(partition_dir or dataset_dir)
        urls = list(urls)
        if len(urls) != part.hosts:
            raise ValueError(f"{len(urls)} URLs for a partition of {part.hosts} hosts")
        self.router = Router(part, load_prepared(dataset_dir).topo)
        self.clients = [Client(u, timeout) for u in urls]
        self.sent = [0] * len(urls)  # requests sent per host

    def host_for(self, nodes) -> int:
        """The host holding most of the rows ``nodes`` and their in-neighbours touch (ties:
        the lowest rank)."""
        return self.router([int(v) for v in nodes])

    def predict(self, nodes, output: str = "class") -> dict:
        """``Client.predict`` on :meth:`host_for`'s host; the answer gains ``"host"``."""
        h = self.host_for(nodes)
        self.sent[h] += 1
        body = self.clients[h].predict(nodes, output)
        body["host"] = h
        return body

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def __enter__(self) -> RoutedClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
