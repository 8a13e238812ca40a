"""Fleet drills: prove on a schedule that restore works, measure it, and keep the reports in the store.

- report.py: the report model and ``drills/<drill_id>.json`` in the store;
- verify.py: the non-disruptive drill (read, verify and check the latest checkpoints of sampled IDs);
- canary.py: a staged node loss of a deterministic workload (canary_workload.py), restored elsewhere
  and compared with an uninterrupted run;
- live.py: a real running task failed on purpose within the opt-in list's limits (fleet.py: the
  running tasks as the core sees them; follow.py: what the recovery after a failure took).
"""
