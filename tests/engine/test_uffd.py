"""The kernel asked directly whether it can restore lazily gives CRIU's answer, without a CRIU process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.engine.uffd import kernel_lazy_pages


@pytest.mark.skipif(os.geteuid() != 0, reason="criu check needs root")
def test_the_kernels_answer_is_criu_checks_answer():
    ours = kernel_lazy_pages()
    assert ours is not None  # an architecture this machine has: asked directly
    criu = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX))).lazy_pages
    assert ours[0] == criu[0], (ours, criu)
