"""Hooks: how the operators reach outside systems through Airflow's connections. ``store`` (a task's
store: an S3 client from an amazon-provider connection, the signing key from a connection's
password) and ``slurm`` (Slurm's commands on this worker, or a login node over an SSH connection)."""
