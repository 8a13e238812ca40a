from __future__ import annotations

import os
import shutil

from cedana_airflow.run.estimate import Estimate, estimate_checkpoint, too_large


def test_estimate_of_this_process_is_its_resident_memory():
    e = estimate_checkpoint([os.getpid()])
    with open(f"/proc/{os.getpid()}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert abs(e.rss_bytes - rss) < 16 << 20 and e.gpu_bytes == 0  # no GPU on this machine
    assert estimate_checkpoint([2**22 + 12345]).total == 0  # a PID that does not exist


def test_threshold_and_free_space(tmp_path):
    assert too_large(Estimate(100, 0), 0, tmp_path) is None  # 0 = no limit
    assert too_large(Estimate(100, 0), 1000, tmp_path) is None
    assert "above max_checkpoint_bytes 150" in too_large(Estimate(100, 60), 150, tmp_path)
    free = shutil.disk_usage(tmp_path).free
    assert "would not fit in the work directory" in too_large(Estimate(free + (1 << 30), 0), 0, tmp_path)
