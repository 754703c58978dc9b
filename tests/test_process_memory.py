from __future__ import annotations

import subprocess
import sys

from lcsb_lightning.process_memory import peak_rss_mb


def test_a_child_process_reports_its_own_peak_not_its_parents() -> None:
    """A process started (fork, then exec) by a larger one: the kernel's ``ru_maxrss`` carries the parent's resident
    size over the exec, so a benchmark arm run in a fresh process from a 2.4 GB parent reported 2,468 MiB whatever
    it used itself (1,158 MiB at most, sampled)."""
    ballast = bytearray(800 << 20)  # 800 MiB, every page written
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])
    parent_peak = peak_rss_mb()
    assert parent_peak > 800
    code = "from lcsb_lightning.process_memory import RunMemory, peak_rss_mb; m = RunMemory(); m.close(); " \
           "print(peak_rss_mb(), m.summary()['peak_rss_mib'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    own_peak, summary_peak = map(float, out)
    # the child imports torch with the package (about 220 MiB), far below its parent's peak
    assert own_peak < parent_peak - 400 and summary_peak < parent_peak - 400
    del ballast
