"""Real PyTorch jobs through Airflow's scheduler (tests/integration/test_airflow_torch.py), as factories: each
test calls one with its own DAG ID, store and work dir, on the test run's shared Airflow stack
(tests/shared_stack.py). A node name comes from a file the test rewrites between tries: each try parses the
DAG file anew. ``agent`` (SharedStack.agent()), or ``agents`` (node name -> socket) with the node from the
file: the task runs as nobody, through that node's agent."""

import sys
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator
from nobody import nobody_task

TESTS = Path(__file__).resolve().parent.parent
SHAPE = str(TESTS / "integration" / "shapes" / "torch_loader.py")
WORKLOADS = TESTS / "workloads"
NO_CRIU = "/nonexistent/criu"  # this worker "has no CRIU"


def _node(root: str) -> dict[str, str]:
    node = Path(root, "node")
    return {"node": node.read_text().strip()} if node.exists() else {}


def _on_node(root: str, agents: dict[str, str] | None) -> tuple[dict, dict[str, str]]:
    """The operator's arguments and settings of a task on the node ``root``/node names: as nobody through
    that node's agent when ``agents`` (node name -> socket) are given."""
    node = _node(root)
    if agents is None:
        return {}, node
    return nobody_task({"node": node["node"], "socket": agents[node["node"]]})


def torch_dag(dag_id: str, *, root: str, store: str, args: list[str], agents: dict[str, str] | None = None) -> None:
    """DataLoader workers, a dataset, a log and a checkpoint directory outside the working directory, default
    settings (the store and work dir aside: the test's own)."""
    user, here = _on_node(root, agents)
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
             default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
        CheckpointedCommandOperator(
            task_id="train",
            command=[sys.executable, SHAPE, "--data", f"{root}/data", "--log", f"{root}/logs/train.log",
                     "--ckpt", f"{root}/ckpts", *args],
            cwd=f"{root}/job",
            heartbeat=timedelta(seconds=1),
            store=store,
            settings={"work_dir": f"{root}/work", **here},
            **user,
        )


def coop_dag(dag_id: str, *, root: str, store: str, agents: dict[str, str] | None = None) -> None:
    """Two-rank DDP training under torchrun in mode cooperative (as nobody through the node's agent when
    ``agents`` are given); a cooperative workload with mode auto on a worker where CRIU cannot run; and a
    transparent task on that worker, which runs unprotected and says why (those two: in the task's process)."""
    here = {"work_dir": f"{root}/work", **_node(root)}
    user, ddp = _on_node(root, agents)
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
             default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
        CheckpointedCommandOperator(
            task_id="train_ddp", mode="cooperative", heartbeat=timedelta(seconds=1), store=store,
            settings={**here, **ddp}, **user,
            command=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     str(WORKLOADS / "ddp_coop.py"), "--steps", "80", "--step-seconds", "0.1"],
        )
        CheckpointedCommandOperator(
            task_id="auto_no_criu", mode="auto", heartbeat=timedelta(seconds=1), store=store,
            settings={**here, "criu": NO_CRIU},
            command=[sys.executable, str(WORKLOADS / "coop_counter.py"), "--steps", "150", "--step-seconds", "0.1"],
        )
        CheckpointedCommandOperator(
            task_id="transparent_no_criu", store=store, settings={**here, "criu": NO_CRIU}, retries=0,
            command=[sys.executable, "-c", "print('ran to its end')"],
        )


def auto_dag(dag_id: str, *, store: str, work_dir: str, queue: str, args: list[str], heartbeat_max: float,
             agent: dict[str, str] | None = None) -> None:
    """heartbeat = "auto": a training task on its own queue, killed twice; each try chooses its interval from
    what it measured and what Airflow's history of the queue says."""
    user, here = nobody_task(agent)
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
             default_args={"retries": 2, "retry_delay": timedelta(seconds=1)}):
        CheckpointedCommandOperator(
            task_id="train", queue=queue, heartbeat="auto", heartbeat_min=timedelta(seconds=1),
            heartbeat_max=timedelta(seconds=heartbeat_max), store=store,
            settings={"keep_checkpoints": 50, "work_dir": work_dir, **here},
            command=[sys.executable, str(WORKLOADS / "train.py"), *args], **user,
        )


def talk_dag(dag_id: str, *, root: str, store: str, port: int) -> None:
    """Workloads that talk, transparent and with default settings (issue 47): two-rank DDP under torchrun with
    no checkpoint code, and a serving worker holding its state in memory."""
    here = {"work_dir": f"{root}/work", **_node(root)}
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
             default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
        CheckpointedCommandOperator(
            task_id="ddp", heartbeat=timedelta(seconds=2), store=store, settings=here,
            command=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     str(WORKLOADS / "ddp_transparent.py"), "--steps", "150", "--step-seconds", "0.1"],
        )
        CheckpointedCommandOperator(
            task_id="serve", heartbeat=timedelta(seconds=1), store=store, settings=here,
            command=[sys.executable, str(WORKLOADS / "serve_counter.py"), "--port", str(port)],
        )
