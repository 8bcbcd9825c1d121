"""Checkpoints and saved states of a ``MaestroWorker`` (``maestro.runtime.executor``).

Whole-tensor checkpoints in a single-rank run's format (``maestro.parallel.state``), DCP
sharded ones (``maestro.parallel.dcp``), a colocated group's per-member states and a
pipelined section's stages gathered into one (``maestro.runtime.pipeline``), so any layout
resumes from any other.
"""

from __future__ import annotations

import torch.distributed as dist


class WorkerCheckpoints:
    """Mixin of ``MaestroWorker``: what its rank writes and loads."""

    def checkpoint_state(self) -> dict[str, tuple[dict, dict | None]]:
        """``{section: (module state, optimizer state)}`` this rank writes: replica 0's TP
        leader, whole tensors in a single-rank run's format (``maestro.parallel.state``), so
        any layout can resume from it. Collective over the section's ranks when it shards."""
        if self.stage is not None:
            from maestro.runtime.pipeline import checkpoint_parts

            return checkpoint_parts(self, full=True)
        if self.member_comm is not None:
            from maestro.parallel import state as pstate

            # every rank of the group takes part (a TP member's tensors are DTensors)
            out = {
                m: (
                    pstate.full_module_state(module),
                    None if opt is None else pstate.full_optimizer_state(opt, params),
                )
                for m, module, opt, params in self._member_states()
            }
            return out if self.replica == 0 and self.leader else {}
        sharded = self.strategy is not None or self.optimizer_is_zero
        if not sharded:
            if self.replica != 0:
                return {}
            return {
                m: (module.state_dict(), None if opt is None else opt.state_dict())
                for m, module, opt, _ in self._member_states()
            }
        from maestro.parallel import state as pstate

        module = pstate.full_module_state(self.section.module)
        opt = None
        if self.optimizer is not None:
            opt = pstate.full_optimizer_state(self.optimizer, self.params)
        return {self.name: (module, opt)} if self.replica == 0 and self.leader else {}

    def _member_states(self):
        """``(section, module, optimizer or None, parameters)`` of each real section this rank
        runs (its own, or every member of its colocated group)."""
        if len(self.members) == 1:
            return [(self.name, self.section.module, self.optimizer, self.params)]
        opts = {m: (opt, ps) for m, _, ps, opt in self.optimizer.parts} if self.optimizer else {}
        return [(m, self.real_graph[m].module, *opts.get(m, (None, []))) for m in self.members]

    @property
    def _members_sharded(self) -> bool:
        """Whether a member of this rank's colocated group holds sharded state (FSDP, TP,
        ZeRO)."""
        secs = [self.config.sections[m] for m in self.members]
        return len(secs) > 1 and any(sc.tp > 1 or sc.fsdp > 1 or sc.zero for sc in secs)

    def _layout_dict(self, member: str | None = None) -> dict:
        sc = self.config.sections[member] if member is not None else self.unit_config
        return {"dp": sc.dp, "fsdp": sc.fsdp, "tp": sc.tp, "zero": sc.zero}

    def _checkpoint_group(self):
        """The process group over this section's ranks (DCP's), created on first use by
        every rank for every multi-rank section in the same order (so call on all ranks)."""
        if not hasattr(self, "_ck_groups"):
            self._ck_groups = {}
            for spec in self.specs:
                ranks = self.layout[spec.name]
                if len(ranks) > 1:
                    self._ck_groups[spec.name] = dist.new_group(ranks)
        return self._ck_groups.get(self.name)

    def save_sharded(self, d, next_step: int) -> list[str]:
        """``--checkpoint-format sharded``: write this section's DCP directory of step
        ``next_step`` (every rank of a sharded section its own shards; a replicated
        section's replica 0 alone). Call on every rank; returns the sections this rank
        wrote (as coordinator)."""
        from maestro.parallel import dcp as pdcp
        from maestro.runtime.checkpoint import section_dir

        if any(sc.pp > 1 for sc in self.config.sections.values()):
            raise ValueError(
                "--checkpoint-format sharded: pipelined sections (pp > 1) write full "
                "checkpoints only; use --checkpoint-format full"
            )
        group = self._checkpoint_group()
        final = section_dir(d, next_step, self.name)
        opt, lay = self.optimizer, self._layout_dict()
        if self.strategy is not None or self.optimizer_is_zero:
            pdcp.save_section(final, self.section.module, opt, self.params, group=group, layout=lay)
            return [self.name] if group is None or dist.get_rank(group) == 0 else []
        if self._members_sharded:
            for m, module, mopt, params in self._member_states():
                pdcp.save_section(
                    section_dir(d, next_step, m),
                    module,
                    mopt,
                    params,
                    group=group,
                    layout=self._layout_dict(m),
                )
            return list(self.members) if dist.get_rank(group) == 0 else []
        if self.replica != 0 or not self.leader:  # cp ranks hold the same state: one writes
            return []
        if len(self.members) > 1:
            for m, module, mopt, params in self._member_states():
                pdcp.save_section(
                    section_dir(d, next_step, m), module, mopt, params, layout=self._layout_dict(m)
                )
            return list(self.members)
        pdcp.save_section(final, self.section.module, opt, self.params, layout=lay)
        return [self.name]

    @property
    def optimizer_is_zero(self) -> bool:
        """Whether this section's optimizer state is sharded by ZeRO-1."""
        from maestro.parallel.zero import ZeroOptimizer

        return isinstance(self.optimizer, ZeroOptimizer)

    def load_checkpoint(self, ckpt) -> None:
        """Load this section's module and optimizer state from a ``checkpoint.Checkpoint``
        (written under any layout; a colocated group loads each member's own state)."""
        if len(self.members) > 1:
            self._load_members(ckpt)
            return
        if self.name not in ckpt.sections:
            raise ValueError(f"checkpoint has no state for section {self.name!r}")
        if self.stage is not None:
            if getattr(ckpt, "format", "full") == "sharded":
                raise ValueError(
                    f"sections.{self.name}.pp: a pipelined section resumes from full "
                    "checkpoints only (--checkpoint-format full)"
                )
            from maestro.runtime.pipeline import load_checkpoint

            load_checkpoint(self, ckpt.section(self.name))
            return
        if getattr(ckpt, "format", "full") == "sharded":
            from maestro.parallel import dcp as pdcp
            from maestro.runtime.checkpoint import section_dir

            pdcp.load_section(
                section_dir(ckpt.dir, ckpt.next_step, self.name),
                self.section.module,
                self.optimizer,
                self.params,
                where=f"section {self.name!r}",
                layout=self._layout_dict(),
            )
            return
        st = ckpt.section(self.name)
        if self.optimizer is not None and st["optimizer"] is None:
            raise ValueError(f"checkpoint has no optimizer state for section {self.name!r}")
        if self.strategy is None and not self.optimizer_is_zero:
            self.section.module.load_state_dict(st["module"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(st["optimizer"])
            return
        from maestro.parallel import state as pstate

        pstate.load_module_state(self.section.module, st["module"])
        if self.optimizer is not None:
            pstate.load_optimizer_state(self.optimizer, self.params, st["optimizer"])

    def _load_members(self, ckpt) -> None:
        """``load_checkpoint`` of a colocated group: member by member, by member name."""
        for m, module, opt, params in self._member_states():
            if m not in ckpt.sections:
                raise ValueError(f"checkpoint has no state for section {m!r}")
            if getattr(ckpt, "format", "full") == "sharded":
                from maestro.parallel import dcp as pdcp
                from maestro.runtime.checkpoint import section_dir

                pdcp.load_section(
                    section_dir(ckpt.dir, ckpt.next_step, m),
                    module,
                    opt,
                    params,
                    where=f"section {m!r}",
                    layout=self._layout_dict(m),
                )
                continue
            st = ckpt.section(m)
            if opt is not None and st["optimizer"] is None:
                raise ValueError(f"checkpoint has no optimizer state for section {m!r}")
            if self._members_sharded:
                from maestro.parallel import state as pstate

                pstate.load_module_state(module, st["module"])
                if opt is not None:
                    pstate.load_optimizer_state(opt, params, st["optimizer"])
                continue
            module.load_state_dict(st["module"])
            if opt is not None:
                opt.load_state_dict(st["optimizer"])

    def state_dicts(self) -> dict[str, dict]:
        """``{section: state_dict}`` this rank saves (replica 0's TP leader), whole tensors;
        collective over the section's ranks when it shards."""
        if self.stage is not None:
            from maestro.runtime.pipeline import checkpoint_parts

            return {n: sd for n, (sd, _) in checkpoint_parts(self, full=False).items()}
        if self._members_sharded:
            from maestro.parallel.state import full_module_state

            out = {m: full_module_state(module) for m, module, _, _ in self._member_states()}
            return out if self.replica == 0 and self.leader else {}
        if self.strategy is None:
            if self.replica != 0:
                return {}
            return {m: module.state_dict() for m, module, _, _ in self._member_states()}
        from maestro.parallel.state import full_module_state

        sd = full_module_state(self.section.module)
        return {self.name: sd} if self.replica == 0 and self.leader else {}
