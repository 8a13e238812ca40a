"""What differs between the Airflow minors we support (3.1.8 and later: 3.1, 3.2, 3.3), in one place.

Every Airflow-facing module takes these names from here, never from a version's own path, so the next
minor's move is one edit. What moved, read in each minor's source:

- ``AirflowFailException``, ``AirflowSkipException`` and ``AirflowNotFoundException`` are in
  ``airflow.sdk.exceptions`` from 3.2; 3.1's has only ``AirflowException`` and keeps the rest in
  ``airflow.exceptions`` (which 3.2+ still has, as deprecated aliases). 3.1's task runner catches
  ``airflow.exceptions.AirflowFailException``, so raising that class there still fails without retry.
- ``DagBag`` is ``airflow.dag_processing.dagbag`` from 3.2, ``airflow.models.dagbag`` in 3.1.
- ``context["task_state_store"]`` exists from 3.3: below it, where earlier tries ran is not known
  (``TaskState.kept``; the command operator's retry says so in one line).
"""

from __future__ import annotations

from typing import Any

try:  # Airflow 3.2+
    from airflow.sdk.exceptions import (AirflowException, AirflowFailException, AirflowNotFoundException,
                                        AirflowSkipException)
except ImportError:  # Airflow 3.1
    from airflow.exceptions import (AirflowException, AirflowFailException,  # type: ignore[no-redef,attr-defined]
                                    AirflowNotFoundException, AirflowSkipException)

__all__ = ["AirflowException", "AirflowFailException", "AirflowNotFoundException", "AirflowSkipException",
           "dag_bag"]


def dag_bag(**kwargs: Any) -> Any:
    """Airflow's DagBag (imported when asked: it loads the ORM models)."""
    try:  # Airflow 3.2+
        from airflow.dag_processing.dagbag import DagBag
    except ImportError:  # Airflow 3.1
        from airflow.models.dagbag import DagBag  # type: ignore[no-redef]
    return DagBag(**kwargs)
