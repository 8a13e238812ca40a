"""The workload's environment, without the store's own credentials.

A checkpoint is the workload's memory, and its environment is in that memory. If the workload
inherited the credentials the supervisor uses to write the store, anyone who can read the store
could lift keys that write it. So the variables that carry store credentials are left out of the
workload's environment (``keep_env`` names any the workload itself needs back). The supervisor keeps
them: its own memory is never checkpointed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["STORE_CREDENTIALS", "is_store_credential", "workload_env"]

#: boto3's credential chain, and our signing key. Plus every AWS_* name with KEY in it.
STORE_CREDENTIALS = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE", "CEDANA_SIGNING_KEY",
})


def is_store_credential(name: str) -> bool:
    return name in STORE_CREDENTIALS or (name.startswith("AWS_") and "KEY" in name)


def workload_env(inherited: Mapping[str, str], keep: Iterable[str] = ()) -> dict[str, str]:
    """``inherited`` less the store's credentials, except the names in ``keep``."""
    kept = set(keep) - {"CEDANA_SIGNING_KEY"}  # the node key is never the workload's: it would sign anything
    return {k: v for k, v in inherited.items() if k in kept or not is_store_credential(k)}
