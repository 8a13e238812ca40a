"""`[core] hostname_callable` for the two-worker deployment (fleet_stack.py): both workers run on one
machine, so each says which node it stands for, as separate machines would by their own names."""

import os
import socket


def hostname() -> str:
    return os.environ.get("CEDANA_FLEET_HOSTNAME") or socket.getfqdn()
