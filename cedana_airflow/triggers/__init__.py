"""Airflow triggers (they run in the triggerer): ``slurm`` follows a Slurm job without holding a worker
slot. Not to be confused with the checkpoint triggers of a running workload (heartbeat, memory
watch), which are core: cedana_airflow/run/checkpoint_triggers.py."""
