"""The distributed runtime: launch, per-rank executors, transfers, the monolithic baseline.

- ``launch(config, nproc, RunOptions(...))``: spawn local ranks and train (``maestro train``).
- ``worker_main(config, opts)``: one rank, from torchrun's environment (``maestro.train``).
- ``reference_train(config)``: the single-process step a Maestro run must equal.

Imported on first use, so ``maestro.runtime.failures`` (what ``maestro train`` reports with)
loads without torch: the launcher's first line comes before torch's import.
"""

__all__ = ["RunOptions", "compound_loss", "launch", "reference_train", "worker_main"]


def __getattr__(name: str):
    if name in ("RunOptions", "launch", "worker_main"):
        from maestro.runtime import launch as _launch

        return getattr(_launch, name)
    if name in ("compound_loss", "reference_train"):
        from maestro.runtime import local

        return getattr(local, name)
    raise AttributeError(f"module 'maestro.runtime' has no attribute {name!r}")
