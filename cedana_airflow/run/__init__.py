"""One managed workload, from start (or restore) to exit.

- ``workload``: the process tree itself: started in its own PID namespace, adopted after a restore,
  or run unprotected (out of scope); its output pumped to the caller;
- ``checkpointer``: the engine and the store together, for one checkpoint ID;
- ``triggers``: what takes a checkpoint while the workload runs (heartbeat, memory watch);
- ``estimate``: the size of a checkpoint before it is taken;
- ``runner``: the whole run, as ``cedana-airflow run`` and the operators drive it.
"""

__all__ = ["workload", "checkpointer", "triggers", "estimate", "runner"]
