"""torch-quiver's ``quiver.multiprocessing``: quiver objects go to ``torch.multiprocessing``
workers sharing memory.

Importing this module (torch-quiver's ``import quiver`` did it for you; here any access to
``quiver.Feature``, ``quiver.CSRTopo`` or a sampler through ``quiver`` also does) registers
pickling reductions with ``multiprocessing.reduction.ForkingPickler``, the pickler
``torch.multiprocessing`` uses for ``mp.spawn`` arguments, ``Process`` arguments and queues::

    import quiver
    import quiver.multiprocessing  # explicit form
    import torch.multiprocessing as mp

    feature = quiver.Feature(0, [], 0).from_cpu_tensor(x)
    sampler = quiver.pyg.GraphSageSampler(topo, [15, 10])
    mp.spawn(train, args=(feature, sampler), nprocs=4)   # the workers map the same rows

What travels:

- ``quiver.Feature``: its tiers' CPU tensors, its hot order and id map, in shared memory;
  a tier read from a ``.npy`` file is reopened from the file (the page cache is shared);
  GPU tiers as CUDA IPC handles (torch's own reduction).
- ``quiver.CSRTopo``: ``indptr``, ``indices``, ``eid``, ``feature_order`` in shared memory.
- ``quiver.pyg.GraphSageSampler`` / ``MixedGraphSageSampler``: rebuilt in the worker from
  their ``share_ipc()`` handle (as torch-quiver does), so their topology travels as above and
  the sampling threads and workspaces are made anew.

A CPU tensor not yet in shared memory is copied there once, on its first trip; every later
trip, to any worker, maps that one copy (a snapshot: later writes by the parent to its own
tensor are not seen). The parent's objects are left as they were. torch's default reduction
instead moves the tensor's storage into shared memory in place, which frees the memory that
numpy views of it still point at: the store's row views and the sampler's CSR views, so the
parent's next gather or sample read freed memory (a segfault). To share without the copy, put
the tensors in shared memory before building on them (``CSRTopo.share_memory_()`` first).
"""

from __future__ import annotations

import threading
import weakref
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

#: numpy arrays at least this large travel in shared memory; smaller ones are pickled as bytes
_MIN_SHARED_ARRAY_BYTES = 1 << 16

# id(source tensor or array) -> (weakref to it, its copy in shared memory): one copy per
# source, whatever the number of trips (the entry goes when the source does)
_SHARED: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
_LOCK = threading.Lock()


def _once(source, make):
    """``make()``, made on the first call for ``source`` and returned while ``source`` lives."""
    key = id(source)
    with _LOCK:
        hit = _SHARED.get(key)
        if hit is not None and hit[0]() is source:
            return hit[1]
        copy = make()
        _SHARED[key] = (weakref.ref(source, lambda _, k=key: _SHARED.pop(k, None)), copy)
        return copy


def shared(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it is in shared memory (or not on the CPU), else its copy in shared
    memory, made on the first call and returned by every later one while ``t`` lives."""
    if t.device.type != "cpu" or t.is_shared():
        return t

    def make():
        copy = torch.empty_like(t, memory_format=torch.contiguous_format).share_memory_()
        return copy.copy_(t.detach())

    return _once(t, make)


def _shared_array(a: np.ndarray) -> torch.Tensor:
    """A numeric numpy array's copy in shared memory, as a tensor (once per array)."""

    def make():
        dtype = torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype
        copy = torch.empty(a.shape, dtype=dtype).share_memory_()
        copy.numpy()[...] = a
        return copy

    return _once(a, make)


class _SharedArray:
    """A numpy array travelling as a shared-memory tensor; unpacked to a numpy view of it."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _pack(obj):
    """``obj`` with every CPU tensor replaced by its shared copy and every large numeric numpy
    array (not a file mapping, which the store reopens by name) by a :class:`_SharedArray`."""
    if isinstance(obj, torch.Tensor):
        return shared(obj)
    if isinstance(obj, np.ndarray):
        if (
            obj.nbytes >= _MIN_SHARED_ARRAY_BYTES
            and obj.dtype.kind in "biuf"
            and not isinstance(obj, np.memmap)
        ):
            return _SharedArray(_shared_array(obj))
        return obj
    if type(obj) is tuple:
        return tuple(_pack(v) for v in obj)
    if type(obj) is list:
        return [_pack(v) for v in obj]
    if type(obj) is dict:
        return {k: _pack(v) for k, v in obj.items()}
    return obj


def _unpack(obj):
    if isinstance(obj, _SharedArray):
        return obj.tensor.numpy()  # a view: the array keeps the shared tensor alive
    if type(obj) is tuple:
        return tuple(_unpack(v) for v in obj)
    if type(obj) is list:
        return [_unpack(v) for v in obj]
    if type(obj) is dict:
        return {k: _unpack(v) for k, v in obj.items()}
    return obj


def _reduce_shared_array(a: _SharedArray):
    return (_SharedArray, (a.tensor,))


# ------------------------------------------------------------------------------ Feature


def rebuild_feature(cls, state: dict):
    """The worker's side of :func:`reduce_feature`."""
    feature = cls.__new__(cls)
    feature.__setstate__(_unpack(state))
    return feature


def reduce_feature(feature):
    """``quiver.Feature`` -> its state with the rows in shared memory (see the module)."""
    return (rebuild_feature, (type(feature), _pack(feature.__getstate__())))


# ------------------------------------------------------------------------------ CSRTopo


def rebuild_csr_topo(cls, state: dict):
    """The worker's side of :func:`reduce_csr_topo`."""
    topo = cls.__new__(cls)
    topo.__setstate__(_unpack(state))
    return topo


def reduce_csr_topo(topo):
    """``quiver.CSRTopo`` -> its tensors in shared memory."""
    return (rebuild_csr_topo, (type(topo), _pack(dict(topo.__dict__))))


# ----------------------------------------------------------------------------- samplers


def rebuild_pyg_sampler(cls, ipc_handle):
    """torch-quiver's: the sampler of a ``share_ipc()`` handle, in the worker."""
    return cls.lazy_from_ipc_handle(ipc_handle)


def reduce_pyg_sampler(sampler):
    """torch-quiver's: a sampler travels as its ``share_ipc()`` handle."""
    return (rebuild_pyg_sampler, (type(sampler), sampler.share_ipc()))


def init_reductions() -> None:
    """Register the reductions with ``ForkingPickler`` (idempotent; done on import)."""
    import torch.multiprocessing  # noqa: F401  (torch's tensor reductions: shared memory)

    from quiver.feature import Feature
    from quiver.graph import CSRTopo
    from quiver.pyg import GraphSageSampler, MixedGraphSageSampler

    ForkingPickler.register(_SharedArray, _reduce_shared_array)
    ForkingPickler.register(Feature, reduce_feature)
    ForkingPickler.register(CSRTopo, reduce_csr_topo)
    ForkingPickler.register(GraphSageSampler, reduce_pyg_sampler)
    ForkingPickler.register(MixedGraphSageSampler, reduce_pyg_sampler)


init_reductions()
