"""The distributed runtime: launch, per-rank executors, transfers, the monolithic baseline.

- ``launch(config, nproc, RunOptions(...))``: spawn local ranks and train (``maestro train``).
- ``worker_main(config, opts)``: one rank, from torchrun's environment (``maestro.train``).
- ``reference_train(config)``: the single-process step a Maestro run must equal.
"""

from maestro.runtime.launch import RunOptions, launch, worker_main
from maestro.runtime.local import compound_loss, reference_train

__all__ = ["RunOptions", "compound_loss", "launch", "reference_train", "worker_main"]
