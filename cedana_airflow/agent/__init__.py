"""The node agent (issue 49; docs/agent.md): one root process per node that owns CRIU, the node key and
the store's credentials, and serves unprivileged callers (Airflow task processes, Slurm jobs, the CLI)
over a unix socket.

- protocol.py: the wire format and who the caller is (``SO_PEERCRED``); client.py: a caller's side.
- callers.py: what the agent reads of a caller, and which callers it refuses.
- server.py: accept, authenticate, authorize, audit, dispatch.
- workloads.py: one caller's run (run/runner.py in a thread), started or restored under a shim.
- shim.py: the small root process that starts one workload as its caller and outlives the agent.
- trees.py: a non-root caller's tree in namespaces of its own: its dump's mounts, its restore's checks.
- remembered.py: what an agent started after another needs to take its workloads up.
"""

from ..config import Settings

#: Where callers connect unless told otherwise ([cedana] agent_socket; a folder only root may write).
DEFAULT_SOCKET = Settings.model_fields["agent_socket"].default
