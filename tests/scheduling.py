"""How `make test` hands tests to its xdist workers: longest first, whole groups together.

A unit is one test, or every test of a group (a module whose expensive module-scoped fixture, a Slurm
cluster or a browser server, must start once: it says so with ``pytest.mark.xdist_group("name")``).
Units go out longest first (their tests' durations in the last full run, tests/durations.json), each to
the worker that is free, so that no worker starts a long test while the others are done. A worker holds
the test it runs and the next one (it needs to know its next test to finish the one it runs), no more.

xdist's own ``--dist loadgroup`` does the grouping by renaming node IDs, which pytest 9.2's nodes no
longer allow (the group mark is ignored); this scheduler gets each test's unit from the workers'
collection instead: conftest.py writes it to the run's directory (``units.json``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler.loadscope import LoadScopeScheduling

import harness

UNITS_FILE = "units.json"


def write_units(items: list[pytest.Item], durations: dict[str, float]) -> None:
    """A worker's collection, as the controller needs it: each test's unit and weight (seconds)."""
    typical = {True: 10.0, False: 0.5}  # a test not in the table: integration or not
    units = {}
    for item in items:
        group = item.get_closest_marker("xdist_group")
        weight = durations.get(item.nodeid, typical[item.get_closest_marker("integration") is not None])
        units[item.nodeid] = [f"group:{group.args[0]}" if group else item.nodeid, weight]
    path = harness.run_dir() / UNITS_FILE
    tmp = path.with_name(f"{UNITS_FILE}.{harness.worker_id()}")
    tmp.write_text(json.dumps(units))
    tmp.rename(path)  # every worker collects the same tests: the last one's file is as good as the first's


class LongestFirst(LoadScopeScheduling):
    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self._units: dict[str, list[Any]] | None = None

    def _unit(self, nodeid: str) -> list[Any]:
        if self._units is None:
            path = Path(harness.run_dir()) / UNITS_FILE
            self._units = json.loads(path.read_text()) if path.exists() else {}
        return self._units.get(nodeid) or [nodeid, 0.0]

    def _split_scope(self, nodeid: str) -> str:
        return str(self._unit(nodeid)[0])

    def schedule(self) -> None:
        """The first call builds the queue, longest unit first; later calls hand out work as usual."""
        if self.collection is None and self.collection_is_completed and self._check_nodes_have_same_collection():
            collection = list(next(iter(self.registered_collections.values())))
            units: dict[str, dict[str, bool]] = {}
            weight: dict[str, float] = {}
            for nodeid in collection:
                scope = self._split_scope(nodeid)
                units.setdefault(scope, {})[nodeid] = False
                weight[scope] = weight.get(scope, 0.0) + float(self._unit(nodeid)[1])
            self.workqueue = OrderedDict(sorted(units.items(), key=lambda kv: -weight[kv[0]]))
            self.collection = collection
            for node in self.nodes:
                if self.workqueue:
                    self._assign_work_unit(node)
            for node in self.nodes:
                self._reschedule(node)
            if not self.workqueue:
                for node in self.nodes:
                    node.shutdown()
            return
        super().schedule()

    def _reschedule(self, node: Any) -> None:
        """More work only once the node is down to its next test (xdist's own keeps up to 3 queued)."""
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)
