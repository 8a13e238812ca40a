"""The cedana-airflow version that added each [cedana] option: the provider info's ``version_added``, which
Airflow's config reference shows beside the option. Read from git history and docs/changes.md (0.9.0); a new
option adds its line here (tests/airflow/test_provider.py fails until it does)."""

from __future__ import annotations

__all__ = ["VERSION_ADDED"]

VERSION_ADDED: dict[str, str] = {
    # 0.1.0
    "store": "0.1.0", "node": "0.1.0", "work_dir": "0.1.0", "criu": "0.1.0", "criu_prefix": "0.1.0",
    "heartbeat_seconds": "0.1.0", "checkpoint_on_term": "0.1.0", "stop_grace_seconds": "0.1.0",
    "chunk_avg_bytes": "0.1.0", "compression": "0.1.0", "keep_local": "0.1.0", "keep_checkpoints": "0.1.0",
    "delete_on_success": "0.1.0", "max_checkpoint_bytes": "0.1.0", "checkpoint_above_bytes": "0.1.0",
    "s3_endpoint_url": "0.1.0", "s3_addressing_style": "0.1.0", "s3_sse": "0.1.0",
    "s3_sse_kms_key_id": "0.1.0", "s3_parallelism": "0.1.0", "optin_file": "0.1.0", "progress": "0.1.0",
    "aws_conn_id": "0.1.0", "same_node_retry": "0.1.0", "k8s_route": "0.1.0", "k8s_runtime_class": "0.1.0",
    # 0.2.0
    "writer_lease_seconds": "0.2.0", "gpu": "0.2.0", "gpu_lock_timeout_seconds": "0.2.0",
    "restore_mode": "0.2.0", "lazy_pages_via": "0.2.0", "max_restore_gap_seconds": "0.2.0",
    "signing_key": "0.2.0", "signing_key_file": "0.2.0", "store_credentials_dir": "0.2.0",
    "keep_env": "0.2.0", "restore_roots": "0.2.0", "drill_schedule": "0.2.0", "drill_notifier": "0.2.0",
    "drill_api_url": "0.2.0", "drill_api_conn_id": "0.2.0",
    # 0.3.0
    "max_captured_bytes": "0.3.0", "stop_window_seconds": "0.3.0",
    # 0.4.0
    "lease_seconds": "0.4.0", "lease_renew_command": "0.4.0", "k8s_heartbeat_seconds": "0.4.0",
    # 0.5.1
    "s3_read_timeout_seconds": "0.5.1", "s3_connect_timeout_seconds": "0.5.1",
    # 0.5.2
    "full_restore_via": "0.5.2",
    # 0.6.0
    "mode": "0.6.0", "cooperative_signal": "0.6.0", "cooperative_verify_command": "0.6.0",
    "cooperative_timeout_seconds": "0.6.0",
    # 0.7.0
    "heartbeat_min_seconds": "0.7.0", "heartbeat_max_seconds": "0.7.0", "mtbf_hours": "0.7.0",
    "failure_history": "0.7.0", "history_api_url": "0.7.0", "history_api_conn_id": "0.7.0",
    "failure_window_days": "0.7.0", "learned_duration_runs": "0.7.0",
    # 0.8.0
    "io_uring": "0.8.0", "allow_unsigned": "0.8.0", "legacy_key_file": "0.8.0", "taskflow_dir": "0.8.0",
    "restore_deny": "0.8.0", "k8s_key_secret": "0.8.0",
    # 0.8.1
    "agent": "0.8.1", "agent_socket": "0.8.1",
    # 0.8.4
    "agent_coop_dir": "0.8.4", "agent_readers": "0.8.4", "agent_drillers": "0.8.4",
    "agent_max_keep_checkpoints": "0.8.4",
    # 0.9.0
    "task_instance_tab": "0.9.0",
    # 0.11.0
    "s3_conditional_writes": "0.11.0",
    # 0.12.0
    "job_parts": "0.12.0", "job_part": "0.12.0", "job_barrier_seconds": "0.12.0",
}
