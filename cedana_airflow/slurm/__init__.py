"""The Slurm route's core (no Airflow): ``batch`` (a job's sbatch options and script), ``client`` (submit
and follow, through Slurm's commands here or on a login node), ``jobs`` (what Slurm says about a
job, and when it is over), ``in_job`` (inside the job: protected or not)."""

__all__ = ["batch", "client", "in_job", "jobs"]
