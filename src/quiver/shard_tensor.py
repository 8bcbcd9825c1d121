"""torch-quiver's ``quiver.shard_tensor`` (``ShardTensor``, ``ShardTensorConfig``): one row
space cut into consecutive parts, each held on a device (a GPU) or in host memory.

torch-quiver's code builds it as::

    from quiver.shard_tensor import ShardTensor, ShardTensorConfig

    shard = ShardTensor(0, ShardTensorConfig({}))  # current device 0, no budgets
    shard.append(gpu_rows, 0)  # rows [0, len(gpu_rows)) on GPU 0
    shard.append(cpu_rows, -1)  # the rest in host memory (-1), appended last
    rows = shard[ids]  # on the current device

or splits one host tensor by per-device byte budgets
(``ShardTensor(0, ShardTensorConfig({0: "1G"})).from_cpu_tensor(x)``). Here the parts are
plain tensors and ``shard[ids]`` gathers each part where it lives. Without CUDA only host
parts exist: appending to a GPU, or a budget on one, raises ``ValueError``; ``shard[ids]``
returns a CPU tensor. Quiver's own tiered store is :class:`quiver.feature.Feature`.
"""

from __future__ import annotations

import torch

from quiver.utils import parse_size

__all__ = ["DeviceCollectionJob", "Offset", "ShardTensor", "ShardTensorConfig"]

CPU = -1  # torch-quiver's device id of the host-memory part


class Offset:
    """Rows ``[start, end)`` of the whole held by one device."""

    def __init__(self, start: int, end: int):
        self.start_, self.end_ = int(start), int(end)

    @property
    def start(self) -> int:
        return self.start_

    @property
    def end(self) -> int:
        return self.end_

    def __repr__(self) -> str:
        return f"Offset({self.start_}, {self.end_})"


class DeviceCollectionJob:
    """torch-quiver's record of a gather sent to another device: ``part_orders`` (positions
    in the request) and ``request_nodes`` (the ids asked of it)."""

    def __init__(self, part_orders, request_nodes):
        self.part_orders_, self.request_nodes_ = part_orders, request_nodes

    @property
    def part_orders(self):
        return self.part_orders_

    @property
    def request_nodes(self):
        return self.request_nodes_


def _torch_device(device: int) -> torch.device:
    """The torch device of torch-quiver's id (``-1``: host memory), or ``ValueError``."""
    device = int(device)
    if device == CPU:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"ShardTensor: device {device} is a GPU and CUDA is not available; "
            "use device -1 (host memory)"
        )
    if device >= torch.cuda.device_count():
        raise ValueError(f"ShardTensor: no GPU {device} ({torch.cuda.device_count()} visible)")
    return torch.device("cuda", device)


class ShardTensorConfig:
    """Per-device byte budgets (``{device: "1G" or bytes}``) and, once filled, the rows each
    device holds (``tensor_offset_device[device]``, an :class:`Offset`)."""

    def __init__(self, device_memory_budget):
        self.device_memory_budget = {
            int(d): parse_size(b) for d, b in dict(device_memory_budget or {}).items()
        }
        self.tensor_offset_device: dict[int, Offset] = {}

    @property
    def device_list(self) -> list[int]:
        return list(self.device_memory_budget)


class ShardTensor:
    """Rows cut into parts by device; ``shard[ids]`` gathers them on ``current_device``.

    Args:
        current_device: the GPU the gathered rows go to (torch-quiver's rank); without CUDA,
            or with only host parts, rows come back on the CPU.
        shard_tensor_config: budgets for :meth:`from_cpu_tensor` (or ``None``).
    """

    def __init__(self, current_device: int, shard_tensor_config: ShardTensorConfig | None):
        self.current_device = current_device
        self.shard_tensor_config = shard_tensor_config or ShardTensorConfig({})
        self.cpu_tensor: torch.Tensor | None = None
        self._parts: list[tuple[int, int, torch.Tensor]] = []  # (device, start, rows)
        self._rows = 0

    # -------------------------------------------------------------------------- building

    def append(self, cpu_tensor: torch.Tensor, device: int) -> None:
        """Add ``cpu_tensor``'s rows after those held so far, on ``device`` (``-1``: host
        memory, which must come last; each GPU holds one part)."""
        device = int(device)
        if self.cpu_tensor is not None:
            raise ValueError("ShardTensor: the host-memory part (-1) is appended last, once")
        if device != CPU and any(d == device for d, _, _ in self._parts):
            raise ValueError(f"ShardTensor: device {device} holds a part already")
        if self._parts and cpu_tensor.shape[1:] != self._parts[0][2].shape[1:]:
            raise ValueError(
                f"ShardTensor: rows of shape {tuple(cpu_tensor.shape[1:])} after rows of "
                f"shape {tuple(self._parts[0][2].shape[1:])}"
            )
        rows = cpu_tensor.to(_torch_device(device))
        start = self._rows
        self._parts.append((device, start, rows))
        self._rows += rows.shape[0]
        if device == CPU:
            self.cpu_tensor = rows
        else:
            cfg = self.shard_tensor_config
            cfg.tensor_offset_device[device] = Offset(start, self._rows)
            cfg.device_memory_budget.setdefault(device, rows.numel() * rows.element_size())

    def partition(self, tensor: torch.Tensor, memory_budget: int) -> int:
        """Rows of ``tensor`` that fit in ``memory_budget`` bytes."""
        return int(memory_budget) // (tensor[0].numel() * tensor.element_size())

    def from_cpu_tensor(self, tensor: torch.Tensor) -> None:
        """Fill the devices' budgets in order with ``tensor``'s rows; the rest stay in host
        memory."""
        pos = 0
        for device, budget in list(self.shard_tensor_config.device_memory_budget.items()):
            size = min(self.partition(tensor, budget), tensor.shape[0] - pos)
            if size <= 0:
                break
            self.append(tensor[pos : pos + size], device)
            pos += size
        if pos < tensor.shape[0]:
            self.append(tensor[pos:], CPU)

    # -------------------------------------------------------------------------- reading

    def _out_device(self) -> torch.device:
        on_gpu = any(d != CPU for d, _, _ in self._parts)
        if on_gpu and self.current_device is not None and int(self.current_device) >= 0:
            return torch.device("cuda", int(self.current_device))
        return torch.device("cpu")

    def __getitem__(self, nodes) -> torch.Tensor:
        """``(len(nodes), ...)`` rows of ``nodes`` (global row ids)."""
        out_dev = self._out_device()
        ids = torch.as_tensor(nodes, dtype=torch.int64).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self._rows):
            raise IndexError(f"ShardTensor: row ids must be in [0, {self._rows})")
        if len(self._parts) == 1:
            rows = self._parts[0][2]
            return rows[ids.to(rows.device)].to(out_dev)
        first = self._parts[0][2]
        out = torch.empty((ids.numel(), *first.shape[1:]), dtype=first.dtype, device=out_dev)
        for _, start, rows in self._parts:
            pos = torch.nonzero((ids >= start) & (ids < start + rows.shape[0])).reshape(-1)
            if pos.numel():
                local = (ids[pos] - start).to(rows.device)
                out[pos.to(out_dev)] = rows[local].to(out_dev)
        return out

    @property
    def shape(self) -> list[int]:
        if not self._parts:
            return [0]
        return [self._rows, *self._parts[0][2].shape[1:]]

    @property
    def device(self):
        return self.current_device

    def size(self, dim: int) -> int:
        return self.shape[dim]

    # -------------------------------------------------------------------------- processes

    def share_ipc(self):
        """``(gpu parts, host part, config)`` to rebuild it in another process
        (:meth:`new_from_share_ipc`); the host rows move to shared memory."""
        if self.cpu_tensor is not None:
            self.cpu_tensor.share_memory_()
        gpu = [(d, rows) for d, _, rows in self._parts if d != CPU]
        return gpu, self.cpu_tensor, self.shard_tensor_config

    def from_ipc_handle(self, gpu_ipc_list, cpu_tensor) -> None:
        for device, rows in gpu_ipc_list:
            self.append(rows, device)
        if cpu_tensor is not None:
            self.append(cpu_tensor, CPU)

    @classmethod
    def new_from_share_ipc(cls, ipc_handles, current_device: int) -> ShardTensor:
        gpu, cpu_tensor, config = ipc_handles
        shard = cls(current_device, ShardTensorConfig({}))
        shard.from_ipc_handle(gpu, cpu_tensor)
        shard.shard_tensor_config = config
        return shard
