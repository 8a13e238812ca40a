"""``@task.checkpointed``: a TaskFlow function run as a managed, checkpointed Python subprocess.

The function's source (like ``@task.virtualenv``) is written to a script in a folder named after
the checkpoint ID, so a retry on another node finds the same paths the restored process still
holds: its arguments (JSON) were read at start, its result (JSON) is written there at the end and
becomes the task's return value. Rules that follow: imports go inside the function, arguments and
the return value must be JSON, and Airflow's context is not passed (templated arguments are).

The folder is ``<taskflow_dir>/<checkpoint_id>``: the same path on every node, and never under a
folder anyone else may write (issue 48). The supervisor runs the script as root, so whoever could
make that folder first (``/tmp`` lets anyone) would read the arguments, aim root's writes through a
symlink and swap the script or forge the result. ``taskflow_dir`` ([cedana] taskflow_dir) defaults to
``/var/lib/cedana-airflow/taskflow`` for a root worker and ``~/.local/state/cedana-airflow/taskflow``
otherwise; every folder on the way must be root's or the worker's and writable by nobody else
(:func:`cedana_airflow.fsafe.secure_base`), and the per-ID folder is the worker's, mode 0700.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory

from cedana_airflow.airflow.config import task_settings
from cedana_airflow.airflow.logsink import prefixed
from cedana_airflow.airflow.task import airflow_errors
from cedana_airflow.airflow_compat import AirflowException, AirflowFailException
from cedana_airflow.fsafe import UnsafePath, private_folder, read_bounded, replace_file, secure_base, unlink
from cedana_airflow.keys import node_trust
from cedana_airflow.operators.checkpointed import CheckpointedCommandOperator
from cedana_airflow.store.transfer import load_manifests

if TYPE_CHECKING:
    from airflow.sdk import Context

    from cedana_airflow.airflow.task import Placement, TaskSetup
    from cedana_airflow.config import Settings
    from cedana_airflow.run.runner import RunResult
    from cedana_airflow.scope.optin import OptInList

__all__ = ["MAX_RESULT_BYTES", "ROOT_TASKFLOW_DIR", "USER_TASKFLOW_DIR", "checkpointed_task", "taskflow_dir",
           "taskflow_folder"]

#: The folders' base for a root worker (the usual one: CRIU needs root) when taskflow_dir is not set.
ROOT_TASKFLOW_DIR = Path("/var/lib/cedana-airflow/taskflow")
#: ... and for any other worker, under its user's home folder.
USER_TASKFLOW_DIR = Path(".local/state/cedana-airflow/taskflow")
#: The largest result.json read back (Airflow's database-backed XCom holds about this much).
MAX_RESULT_BYTES = 48 << 20
#: Where checkpoints taken before issue 48 kept their folder: ``<tempdir>/cedana-taskflow/<checkpoint_id>``.
_LEGACY_PARENT = "cedana-taskflow"

_ARGS, _SCRIPT_NAME, _RESULT = "args.json", "script.py", "result.json"

_SCRIPT = '''\
import json, os, sys

{source}

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        _a = json.load(f)
    _r = {name}(*_a["args"], **_a["kwargs"])
    _t = sys.argv[2] + ".tmp"
    with open(os.open(_t, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as f:
        json.dump(_r, f)
    os.replace(_t, sys.argv[2])
'''


def taskflow_dir(settings: Settings | Any) -> Path:
    """The folders' base: [cedana] taskflow_dir, else root's or the worker's user's default."""
    configured = getattr(settings, "taskflow_dir", None)
    if configured:
        return Path(configured).expanduser()
    return ROOT_TASKFLOW_DIR if os.geteuid() == 0 else Path.home() / USER_TASKFLOW_DIR


@dataclass
class _Folder:
    """``<base>/<checkpoint_id>``, held open: every file in it is reached through ``fd``."""

    path: Path
    base_fd: int
    fd: int

    def write(self, name: str, text: str) -> None:
        try:
            replace_file(self.fd, name, text.encode())
        except OSError as e:  # a full or read-only disk: a retry may do better; a refused name would not
            error = AirflowFailException if isinstance(e, UnsafePath) else AirflowException
            raise error(f"cedana: @task.checkpointed cannot write {self.path / name}: {_why(e)}.") from None

    def remove_result(self) -> None:
        for name in (_RESULT, _RESULT + ".tmp"):
            try:
                unlink(self.fd, name)
            except OSError as e:
                raise AirflowFailException(f"cedana: @task.checkpointed cannot remove {self.path / name} before the "
                                           f"run: {_why(e)}.") from None

    def result(self) -> Any:
        try:
            data = read_bounded(self.fd, _RESULT, MAX_RESULT_BYTES)
        except UnsafePath as e:  # not the function's doing: nothing a retry would change
            raise AirflowFailException(f"cedana: @task.checkpointed's result {self.path / _RESULT} is refused: "
                                       f"{_why(e)}.") from None
        except OSError as e:
            raise AirflowException(f"cedana: the function exited 0 but left no readable result ({_why(e)}).") from None
        if data is None:
            raise AirflowException(f"cedana: the function exited 0 but left no result ({self.path / _RESULT} is "
                                   "missing).")
        try:
            return json.loads(data)
        except ValueError as e:
            raise AirflowException(f"cedana: the function exited 0 but left no readable result ({e}).") from None

    def remove(self) -> None:
        shutil.rmtree(self.path.name, ignore_errors=True, dir_fd=self.base_fd)  # by descriptor: no link followed

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.base_fd)


def taskflow_folder(base: Path, checkpoint_id: str, *, below: Path | None = None) -> _Folder:
    """``<base>/<checkpoint_id>``, made or checked: every folder on the way to ``base`` root's or ours and
    writable by nobody else, the last one ours and 0700. ``below``: see :func:`~cedana_airflow.fsafe.secure_base`.
    Anything else fails the task with one line (AirflowFailException)."""
    path = Path(base) / checkpoint_id
    try:
        base_fd = secure_base(base, below=below)
    except OSError as e:
        raise AirflowFailException(f"cedana: @task.checkpointed's folder base {base} cannot be used: {_why(e)}. Set "
                                   "[cedana] taskflow_dir to a folder that only root (or the worker's user) may write, "
                                   "the same path on every node.") from None
    try:
        fd = private_folder(base_fd, checkpoint_id, path)
    except OSError as e:
        os.close(base_fd)
        raise AirflowFailException(f"cedana: @task.checkpointed's folder {path} cannot be used: {_why(e)}.") from None
    return _Folder(path, base_fd, fd)


def _why(e: OSError) -> str:
    if isinstance(e, UnsafePath):
        return str(e)
    return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")


def _legacy(cwd: str, checkpoint_id: str, folder: Path) -> bool:
    """A working directory of the scheme before issue 48: ``<tempdir>/cedana-taskflow/<checkpoint_id>``."""
    p = PurePosixPath(cwd)
    return cwd != str(folder) and p.name == checkpoint_id and p.parent.name == _LEGACY_PARENT


class _CheckpointedDecoratedOperator(DecoratedOperator, CheckpointedCommandOperator):  # type: ignore[misc]
    custom_operator_name = "@task.checkpointed"
    template_fields = (*DecoratedOperator.template_fields, *CheckpointedCommandOperator.template_fields)

    def __init__(self, *, python_callable: Callable[..., Any], op_args: Collection[Any] | None = None,
                 op_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs,
                         command=[sys.executable], **kwargs)
        self._folder_path: Path | None = None
        self._restored_cwd: str | None = None

    @prefixed
    def execute(self, context: Context) -> Any:
        with airflow_errors():
            cid = self.checkpoint_id_for(context)
            settings, _ = task_settings(self.cedana_overrides())
        try:
            args = json.dumps({"args": list(self.op_args), "kwargs": dict(self.op_kwargs)})
        except TypeError as e:
            raise AirflowFailException(f"cedana: @task.checkpointed arguments must be JSON ({e}).") from None
        folder = taskflow_folder(taskflow_dir(settings), cid)
        try:
            folder.write(_ARGS, args)  # the arguments may be secrets: the folder is 0700, the file 0600
            folder.write(_SCRIPT_NAME, _SCRIPT.format(source=self.get_python_source(),  # type: ignore[no-untyped-call]
                                                      name=self.python_callable.__name__))
            folder.remove_result()
            self.command = [sys.executable, str(folder.path / _SCRIPT_NAME), str(folder.path / _ARGS),
                            str(folder.path / _RESULT)]
            self.cwd = str(folder.path)
            self._folder_path, self._restored_cwd = folder.path, None
            summary = CheckpointedCommandOperator.execute(self, context)
            if self._restored_cwd is not None and self._restored_cwd != str(folder.path):
                raise AirflowFailException(
                    f"cedana: the restored checkpoint of {cid} ran in {self._restored_cwd}, not in {folder.path}, so "
                    "its result is not where this task reads it: give [cedana] taskflow_dir the same path on every "
                    "node; delete the checkpoint ID (Browse > Checkpoints) or trigger a new DAG run to start fresh.")
            context["ti"].xcom_push(key="cedana", value=summary)
            value = folder.result()
            folder.remove()
        finally:
            folder.close()
        return self._handle_output(value)

    def cedana_setup(self, context: Mapping[str, Any], placement: Callable[[OptInList | None, Settings], Placement]
                     ) -> TaskSetup:
        """CedanaTask's, then: no checkpoint of this ID was taken in a folder of the old scheme (``/tmp``)."""
        setup: TaskSetup = super().cedana_setup(context, placement)
        if setup.in_scope and self._folder_path is not None:
            s = setup.settings
            trust = node_trust(s)
            for m in load_manifests(setup.store(), setup.checkpoint_id):
                # only what a restore would accept: a store writer's manifest must not fail the task
                if trust.signature_refusal(m) is None and _legacy(m.process.cwd, setup.checkpoint_id, self._folder_path):
                    raise AirflowFailException(
                        f"cedana: checkpoint {setup.checkpoint_id} seq {m.seq} was taken by an older cedana-airflow, "
                        f"in {m.process.cwd}, a folder anyone on a node could have made first, so it is not restored: "
                        "delete the checkpoint ID (Browse > Checkpoints) and clear the task, or trigger a new DAG "
                        "run, to start fresh.")
        return setup

    def _log_restore(self, cid: str, node: str, result: RunResult) -> None:
        if result.restored_from is not None:
            self._restored_cwd = result.restored_from.process.cwd
        super()._log_restore(cid, node, result)


def checkpointed_task(python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> TaskDecorator:
    """``@task.checkpointed(heartbeat=timedelta(minutes=5), ...)``: takes CheckpointedCommandOperator's arguments."""
    return task_decorator_factory(python_callable=python_callable,
                                  decorated_operator_class=_CheckpointedDecoratedOperator, **kwargs)
