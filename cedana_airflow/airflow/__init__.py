"""The Airflow side of cedana-airflow: provider metadata, the [cedana] config section, the plugin.

Adapters only (DESIGN.md, layers): translate Airflow's configuration, connections and context into
core calls. The operators and sensors live in the top-level ``operators/`` and ``sensors/`` folders.
"""

from __future__ import annotations

from typing import Any

from .. import __version__

__all__ = ["get_provider_info", "CONFIG_OPTIONS"]

#: The [cedana] section: (option, type, default shown by ``airflow config list``, description).
#: Every option except the Airflow-only ones names a core setting (cedana_airflow.config.Settings);
#: an unset option leaves the core default (or CEDANA_* / CEDANA_CONFIG) in force.
CONFIG_OPTIONS: tuple[tuple[str, str, str | None, str], ...] = (
    ("store", "string", None, "Store URL: file:///DIR or s3://bucket/prefix. Unset: file://$AIRFLOW_HOME/cedana/store."),
    ("aws_conn_id", "string", None, "Airflow connection for s3:// stores (amazon provider's S3Hook). Unset: boto3's credential chain."),
    ("heartbeat_seconds", "float", None, "Default seconds between heartbeat checkpoints for operators without `heartbeat`."),
    ("max_checkpoint_bytes", "integer", None, "Skip a heartbeat whose estimated size is above this (default 64 GiB; 0 = no limit)."),
    ("keep_checkpoints", "integer", None, "Complete checkpoints kept per checkpoint ID (default 3)."),
    ("delete_on_success", "boolean", None, "Delete an ID's checkpoints once its task succeeded (default False)."),
    ("checkpoint_on_term", "boolean", None, "Take a final checkpoint when Airflow stops a task (default True)."),
    ("stop_grace_seconds", "float", None, "Seconds between SIGTERM to the workload and SIGKILL (default 10)."),
    ("node", "string", None, "This worker's node name (default: the hostname)."),
    ("work_dir", "string", None, "Local directory for dumps and restores (default: a temp dir per task)."),
    ("criu", "string", None, "Path to criu (default: the private prefix, else PATH)."),
    ("s3_endpoint_url", "string", None, "S3-compatible endpoint when no connection gives one."),
    ("s3_addressing_style", "string", None, "auto, path or virtual."),
    ("s3_sse", "string", None, "Server-side encryption: AES256 or aws:kms."),
    ("s3_sse_kms_key_id", "string", None, "KMS key for s3_sse = aws:kms."),
    ("s3_parallelism", "integer", None, "S3 requests in flight per transfer (default 16)."),
    ("same_node_retry", "string", "allow", "A retry on the node where the previous try failed: 'allow' (log it) or "
     "'fail' (fail fast so the next retry is placed elsewhere)."),
    ("optin_file", "string", None, "The opt-in list (TOML, or YAML): what may be checkpointed. Unset: nothing."),
    ("k8s_route", "string", "cedana", "CedanaKubernetesPodOperator: 'cedana' (runtime class on a Cedana cluster) or "
     "'wrap' (our CLI wrapped around the container's command)."),
    ("k8s_runtime_class", "string", "cedana", "The runtime class of the 'cedana' route."),
)


def get_provider_info() -> dict[str, Any]:
    """What ``airflow providers list`` shows; the ``apache_airflow_provider`` entry point returns it."""
    return {
        "package-name": "cedana-airflow",
        "name": "Cedana checkpointing",
        "description": "Transparent GPU/CPU checkpointing of Airflow tasks with CRIU; restores a retried or cleared task from its latest checkpoint.",
        "versions": [__version__],
        "task-decorators": [{"name": "checkpointed", "class-name": "cedana_airflow.airflow.decorators.checkpointed_task"}],
        "config": {
            "cedana": {
                "description": "cedana-airflow: where checkpoints go and how often they are taken. Also AIRFLOW__CEDANA__<OPTION>.",
                "options": {
                    name: {"description": desc, "version_added": None, "type": typ, "example": None, "default": default}
                    for name, typ, default, desc in CONFIG_OPTIONS
                },
            }
        },
    }
