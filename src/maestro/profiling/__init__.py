"""Profiling with real modules and real runs, above the runtime and the simulator.

- ``maestro.profiling.sections``: time and memory of each section alone, against micro-batch
  size and sequence length (``maestro profile CONFIG``).
- ``maestro.profiling.runs``: short traced training runs fitted into a cost-model profile
  (``maestro profile CONFIG --from-run``), and replayed predictions of a run's step time.

Neither the schedulers nor the simulator import this package; the planner and the CLI do.
"""
