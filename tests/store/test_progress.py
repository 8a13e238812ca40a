from __future__ import annotations

import io

from cedana_airflow.store.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal():
    out = _Tty()
    p = Progress("checkpoint job", 10_000_000, "auto", out)
    p.advance(10_000_000)
    p.close()
    assert "checkpoint job: 100.0% of 9.5 MiB" in out.getvalue() and out.getvalue().endswith("\n")


def test_progress_stays_quiet_in_logs():
    out = io.StringIO()
    p = Progress("checkpoint job", 10, "auto", out)
    p.advance(10)
    p.close()
    assert out.getvalue() == ""
