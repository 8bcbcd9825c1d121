"""ZeRO-1: the optimizer state sharded across a section's data-parallel replicas.

The (local shards of the) parameters are laid end to end as one flat vector and cut into
``N`` near-equal contiguous slices. Replica ``i`` runs the section's own optimizer on slice
``i`` only: views into the parameters' storage, so a step updates them in place and the
state (AdamW's two moments) exists for 1/N of the elements. After the step the slices are
all-gathered. Optimizers whose update is elementwise (AdamW, Adam, SGD with momentum and
weight decay) give bit-for-bit the update of the unsharded optimizer; gradients are SUM
all-reduced beforehand, as without ZeRO.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from maestro.parallel.grads import local


class ZeroOptimizer:
    """A section optimizer whose state lives on one replica per slice.

    Args:
        params: the section's trainable parameters (plain or DTensor; their local shards are
            sharded further).
        make: ``make(pieces) -> torch.optim.Optimizer`` over this replica's slice.
        group: the data-parallel process group (``None``: the default group).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        group=None,
    ) -> None:
        self.params = list(params)
        self.group = group
        self.world = dist.get_world_size(group)
        self.index = dist.get_rank(group)
        self.sizes = [local(p.detach()).numel() for p in self.params]
        total = sum(self.sizes)
        self.bounds = [(total * i) // self.world for i in range(self.world + 1)]
        self.chunk = max(b - a for a, b in zip(self.bounds, self.bounds[1:]))
        lo, hi = self.bounds[self.index], self.bounds[self.index + 1]
        #: (parameter index, start, stop) of each piece of this replica's slice
        self.spans: list[tuple[int, int, int]] = []
        self.pieces: list[nn.Parameter] = []
        off = 0
        for i, (p, n) in enumerate(zip(self.params, self.sizes)):
            a, b = max(lo, off) - off, min(hi, off + n) - off
            if a < b:
                view = local(p.detach()).reshape(-1)[a:b]  # shares the parameter's storage
                self.spans.append((i, a, b))
                self.pieces.append(nn.Parameter(view, requires_grad=False))
            off += n
        self.optimizer = make(self.pieces) if self.pieces else None

    @property
    def param_groups(self):
        """The inner optimizer's groups (``set_lr`` sets their learning rate)."""
        return self.optimizer.param_groups if self.optimizer is not None else []

    @property
    def state(self):
        """The inner optimizer's state (this replica's slice only)."""
        return self.optimizer.state if self.optimizer is not None else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the parameters' gradients (and the pieces')."""
        for p in self.params:
            p.grad = None
        for q in self.pieces:
            q.grad = None

    def step(self) -> None:
        """Step this replica's slice, then all-gather every slice into the parameters."""
        for q, (i, a, b) in zip(self.pieces, self.spans):
            g = self.params[i].grad
            q.grad = None if g is None else local(g).reshape(-1)[a:b]
        if self.optimizer is not None:
            self.optimizer.step()
        ref = local(self.params[0].detach())
        mine = torch.zeros(self.chunk, dtype=ref.dtype, device=ref.device)
        if self.pieces:
            flat = torch.cat([q.detach() for q in self.pieces])
            mine[: flat.numel()] = flat
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        full = torch.cat([parts[r][: b - a] for r, (a, b) in enumerate(self._slices())])
        off = 0
        with torch.no_grad():
            for p, n in zip(self.params, self.sizes):
                local(p.data).reshape(-1).copy_(full[off : off + n])
                off += n

    def _slices(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds, self.bounds[1:]))

    def local_state_dict(self) -> dict:
        """The state as an unsharded optimizer over the (local shards of the) parameters has
        it: slices gathered from every replica (collective over the group)."""
        import torch.distributed as dist

        mine = {"spans": self.spans, "state": {}, "groups": None}
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            mine["state"], mine["groups"] = sd["state"], sd["param_groups"]
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        state: dict[int, dict] = {}
        groups = next(e["groups"] for e in every if e["groups"] is not None)
        for e in every:
            for j, (i, a, b) in enumerate(e["spans"]):
                st = e["state"].get(j)
                if st is None:
                    continue
                out = state.setdefault(i, {})
                ref = local(self.params[i].detach())
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        buf = out.setdefault(k, torch.zeros(ref.shape, dtype=v.dtype))
                        buf.view(-1)[a:b] = v.cpu()
                    else:
                        out[k] = v
        param_groups = [{**g, "params": list(range(len(self.params)))} for g in groups[:1]]
        return {"state": state, "param_groups": param_groups}

    def load_local_state_dict(self, sd: dict) -> None:
        """Load an unsharded optimizer's state over the (local shards of the) parameters:
        each replica keeps its slices."""
        if self.optimizer is None:
            return
        state = {}
        for j, (i, a, b) in enumerate(self.spans):
            st = sd["state"].get(i)
            if st is None:
                continue
            state[j] = {
                k: (
                    v.reshape(-1)[a:b].clone() if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                )
                for k, v in st.items()
            }
        groups = [{**g, "params": list(range(len(self.pieces)))} for g in sd["param_groups"]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
