"""The node agent (issue 49, being built behind ``[cedana] agent = off``): one root process per node
that owns CRIU, the node key and the store's credentials, and serves unprivileged callers (Airflow
task processes, Slurm jobs, the CLI) over a unix socket.

- protocol.py: the wire format and who the caller is (``SO_PEERCRED``).
- shim.py: the small root process that starts one workload as its caller's uid and outlives the agent.
"""
