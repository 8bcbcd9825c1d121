"""Point-to-point transfers of per-sample tensors: one coalesced message per destination.

What one producer replica sends one consumer replica for a micro-batch travels as three
messages on the same (source, tag) stream: a 2-int64 size prefix, a header (sample ids, keys,
dtypes, shapes) and one flat byte buffer holding every tensor back to back. Variable-length
samples need no padding on the wire. Gradients travel back with the same format.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from maestro.sections import Outputs

#: every dtype a section may send (codes are positions: append, never reorder)
DTYPES = [
    torch.float32,
    torch.float64,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.complex64,
    torch.complex128,
]
_CODE = {dt: i for i, dt in enumerate(DTYPES)}

#: tensors start at multiples of this many bytes so they can be viewed in place
ALIGN = 16


def message_tags(step: int) -> tuple[int, int]:
    """``(activation tag, gradient tag)`` of a training step."""
    return 2 * step + 1, 2 * step + 2


def pack(
    items: Sequence[tuple[int, Outputs]], device: torch.device | str = "cpu", check: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``[(sample_id, {key: tensor})]`` as ``(header int64, payload uint8)``.

    ``check`` (the sender's fingerprint of the step's global batch) travels in the header so
    the receiver can tell at once when the two ranks' data pipelines disagree.
    """
    head: list[int] = [check, len(items)]
    chunks: list[torch.Tensor] = []
    offset = 0
    for sid, outs in items:
        head += [sid, len(outs)]
        for key in sorted(outs):
            t = outs[key].detach()
            if t.dtype not in _CODE:
                raise ValueError(
                    f"sample {sid}: output {key!r} has dtype {t.dtype}, which cannot be sent "
                    f"between sections (supported: {', '.join(str(d) for d in DTYPES)})"
                )
            kb = key.encode()
            head += [len(kb), *kb, _CODE[t.dtype], t.dim(), *t.shape]
            raw = _bytes_of(t)
            pad = -raw.numel() % ALIGN
            chunks.append(raw)
            if pad:
                chunks.append(raw.new_zeros(pad))
            offset += raw.numel() + pad
    header = torch.tensor(head, dtype=torch.int64, device=device)
    payload = torch.cat(chunks).to(device) if chunks else torch.empty(0, dtype=torch.uint8)
    return header, payload.to(device)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes as a flat uint8 tensor (bool is viewed through uint8)."""
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.uint8)


def header_check(header: torch.Tensor) -> int:
    """The batch fingerprint a message's header carries (see ``pack``)."""
    return int(header[0])


def unpack(header: torch.Tensor, payload: torch.Tensor) -> list[tuple[int, Outputs]]:
    """Inverse of ``pack``; every tensor is a fresh copy (safe to mark ``requires_grad``)."""
    h = header.tolist()
    pos, off = 2, 0
    out: list[tuple[int, Outputs]] = []
    for _ in range(h[1]):
        sid, nkeys = h[pos], h[pos + 1]
        pos += 2
        d: Outputs = {}
        for _ in range(nkeys):
            klen = h[pos]
            key = bytes(h[pos + 1 : pos + 1 + klen]).decode()
            pos += 1 + klen
            dtype, ndim = DTYPES[h[pos]], h[pos + 1]
            shape = h[pos + 2 : pos + 2 + ndim]
            pos += 2 + ndim
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            raw = payload[off : off + nbytes]
            if dtype == torch.bool:
                d[key] = raw.clone().view(torch.bool).reshape(shape)
            else:
                d[key] = raw.view(dtype).reshape(shape).clone()
            off += nbytes + (-nbytes % ALIGN)
        out.append((sid, d))
    assert off == payload.numel(), "payload size does not match its header"
    return out


class Transport:
    """Sends coalesced messages and receives them in per-source order, buffering by sample.

    Receiving is demand-driven: ``get(src, tag, sample_id)`` reads messages from ``src`` (in the
    order that rank sent them) until ``sample_id`` has arrived, keeping the others for later.
    Sends are asynchronous (``isend``); ``flush()`` waits for all of them.

    Args:
        device: where message tensors live (CPU for gloo, the rank's GPU for NCCL).
        on_wait: optional ``callback(seconds, src, nbytes)`` for the trace.
    """

    def __init__(self, device: torch.device, on_wait=None) -> None:
        self.device = device
        self.pending: deque = deque()
        self.inbox: dict[tuple[int, int], dict[int, Outputs]] = {}
        self.on_wait = on_wait
        self.bytes_sent = 0
        self.num_sends = 0
        #: ``step -> fingerprint`` of this rank's global batch; messages carry the sender's
        #: and a receiver compares (``ValueError`` on a mismatch); steps without one are not checked
        self.batch_checks: dict[int, int] = {}
        #: this process's rank (for error messages)
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def send(self, dst: int, tag: int, items: Sequence[tuple[int, Outputs]], step: int = 0) -> None:
        """Asynchronously send ``[(sample_id, outputs)]`` to rank ``dst`` as one message."""
        header, payload = pack(items, self.device, self.batch_checks.get(step, 0))
        size = torch.tensor(
            [header.numel(), payload.numel()], dtype=torch.int64, device=self.device
        )
        self.num_sends += 1
        for t in (size, header, payload):
            if t.numel():
                self.pending.append((step, dist.isend(t, dst, tag=tag), t, self.num_sends))
        self.bytes_sent += payload.numel()

    def in_flight(self) -> int:
        """Messages sent whose receive has not completed (each holds its payload in memory)."""
        return len({entry[3] for entry in self.pending if not entry[1].is_completed()})

    def limit_in_flight(self, max_messages: int) -> None:
        """Block until at most ``max_messages`` sent messages are still in flight.

        A forward-only producer calls this before each micro-batch: its outputs stay in memory
        until the consumer receives them, so bounding the messages in flight bounds how far
        (and with how much memory) it runs ahead of its consumers.
        """
        if max_messages < 0:
            raise ValueError(f"max_messages must be >= 0, got {max_messages}")
        while self.pending:
            ids = list(dict.fromkeys(entry[3] for entry in self.pending))
            if len(ids) <= max_messages:
                return
            oldest = ids[0]
            while self.pending and self.pending[0][3] == oldest:
                self.pending.popleft()[1].wait()

    def _recv_message(self, src: int, tag: int) -> None:
        size = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.recv(size, src, tag=tag)
        nh, npay = size.tolist()
        header = torch.empty(nh, dtype=torch.int64, device=self.device)
        dist.recv(header, src, tag=tag)
        step = (tag - 1) // 2
        mine, theirs = self.batch_checks.get(step, 0), header_check(header)
        if mine and theirs and mine != theirs:
            raise ValueError(
                f"step {step}: ranks {src} and {self.rank} built different global batches "
                f"(fingerprints {theirs:#x} vs {mine:#x}): every rank must read the same data "
                "in the same order (check the data files, the seed and the job's dataset)"
            )
        payload = torch.empty(npay, dtype=torch.uint8, device=self.device)
        if npay:
            dist.recv(payload, src, tag=tag)
        box = self.inbox.setdefault((src, tag), {})
        for sid, outs in unpack(header, payload):
            assert sid not in box, f"sample {sid} received twice from rank {src}"
            box[sid] = outs

    def get(self, src: int, tag: int, sample_id: int) -> Outputs:
        """The outputs of ``sample_id`` sent by ``src`` with ``tag`` (blocks until they arrive)."""
        box = self.inbox.setdefault((src, tag), {})
        while sample_id not in box:
            self._recv_message(src, tag)
        return box.pop(sample_id)

    def flush(self, before_step: int | None = None) -> None:
        """Wait until every send (of the steps before ``before_step``, if given) has completed.

        A gloo send completes only once its receiver has posted the matching receive, so a
        producer that flushed its own step's sends would wait for its consumers to catch up;
        flushing only earlier steps lets it run one step ahead.
        """
        while self.pending and (before_step is None or self.pending[0][0] < before_step):
            self.pending.popleft()[1].wait()
