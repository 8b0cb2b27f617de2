"""memory: what a benchmarked process costs in memory: a process tree's peak, sampled in a thread while it
runs (TreeMemory, for the workers), and one command's wall time and peak RSS (timed_command, for the tooling)."""

import os
import subprocess
import threading
import time
from pathlib import Path


class TreeMemory:
    """Peak memory of a process and its children, sampled in a thread: the sum of RSS (shared pages count
    once per process) every `every` s, and the sum of PSS (shared pages split) every 4th sample."""

    def __init__(self, pid: int, every: float = 0.25):
        import psutil

        self.root, self.every = psutil.Process(pid), every
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import psutil

        i = 0
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            rss = pss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    if i % 4 == 0:
                        pss += p.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            i += 1
            self._stop.wait(self.every)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_rss_mib": self.peak_rss / 2**20, "peak_pss_mib": self.peak_pss / 2**20}


def timed_command(args: list, cwd: Path | None = None) -> dict:
    """Wall time and the process's own peak RSS (getrusage through wait4) of one command."""
    t = time.perf_counter()
    proc = subprocess.Popen([str(a) for a in args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None  # stdout=PIPE
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    rc = os.waitstatus_to_exitcode(status)
    result = {"command": " ".join(str(a) for a in args), "seconds": wall, "peak_rss_mib": usage.ru_maxrss / 1024}
    if rc != 0:
        result["error"] = f"exit {rc}: " + output.decode(errors="replace").strip()[-1500:]
    return result
