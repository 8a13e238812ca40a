"""``@task.checkpointed``: a TaskFlow function run as a managed, checkpointed Python subprocess.

The function's source (like ``@task.virtualenv``) is written to a script in a folder named after
the checkpoint ID, so a retry on another node finds the same paths the restored process still
holds: its arguments (JSON) were read at start, its result (JSON) is written there at the end and
becomes the task's return value. Rules that follow: imports go inside the function, arguments and
the return value must be JSON, and Airflow's context is not passed (templated arguments are).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from cedana_airflow.operators.checkpointed import CheckpointedCommandOperator

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["checkpointed_task"]

_SCRIPT = '''\
import json, os, sys

{source}

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        _a = json.load(f)
    _r = {name}(*_a["args"], **_a["kwargs"])
    with open(sys.argv[2] + ".tmp", "w") as f:
        json.dump(_r, f)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
'''


class _CheckpointedDecoratedOperator(DecoratedOperator, CheckpointedCommandOperator):  # type: ignore[misc]
    custom_operator_name = "@task.checkpointed"
    template_fields = (*DecoratedOperator.template_fields, *CheckpointedCommandOperator.template_fields)

    def __init__(self, *, python_callable: Callable[..., Any], op_args: Collection[Any] | None = None,
                 op_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs,
                         command=[sys.executable], **kwargs)

    def execute(self, context: Context) -> Any:
        folder = Path(tempfile.gettempdir()) / "cedana-taskflow" / self.checkpoint_id_for(context)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)  # the arguments may be secrets
        try:
            args = json.dumps({"args": list(self.op_args), "kwargs": dict(self.op_kwargs)})
        except TypeError as e:
            raise AirflowFailException(f"cedana: @task.checkpointed arguments must be JSON ({e}).") from None
        (folder / "args.json").write_text(args)
        (folder / "script.py").write_text(_SCRIPT.format(source=self.get_python_source(),  # type: ignore[no-untyped-call]
                                                         name=self.python_callable.__name__))
        result = folder / "result.json"
        result.unlink(missing_ok=True)
        self.command = [sys.executable, str(folder / "script.py"), str(folder / "args.json"), str(result)]
        self.cwd = str(folder)
        summary = CheckpointedCommandOperator.execute(self, context)
        context["ti"].xcom_push(key="cedana", value=summary)
        try:
            value = json.loads(result.read_text())
        except (OSError, ValueError) as e:
            raise AirflowException(f"cedana: the function exited 0 but left no readable result ({e}).") from None
        shutil.rmtree(folder, ignore_errors=True)
        return self._handle_output(value)


def checkpointed_task(python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> TaskDecorator:
    """``@task.checkpointed(heartbeat=timedelta(minutes=5), ...)``: takes CheckpointedCommandOperator's arguments."""
    return task_decorator_factory(python_callable=python_callable,
                                  decorated_operator_class=_CheckpointedDecoratedOperator, **kwargs)
