"""What this machine leaves free for a session: idle cores (its default thread count) and available memory.

A session that gives no thread count runs one thread per core that other processes leave idle. GGML's
CPU threads meet at a spinning barrier after every op of a graph (hundreds per token). A thread that
shares its core with another busy process is descheduled for a whole time slice at a time, and every
other thread spins at the barrier until it comes back: with threads = cores and one competing CPU-bound
process, decode falls from tens of tokens per second to about one (llama.cpp's default does this).
One thread per *idle* core keeps every thread on a core of its own. The idle cores are measured when a
session loads, from the kernel's CPU time counters of the usable cores (``/proc/stat``) over a short
interval, less this process's own CPU time; where those counters cannot be read every usable core
counts as idle.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import cast

#: a core counts as idle when at least this fraction of it was free during the sample
IDLE_FRACTION = 0.75
#: how long the CPU counters are sampled, and how long a sample is reused (sessions loaded together)
SAMPLE_SECONDS = 0.2
_REUSE_SECONDS = 2.0
_last: tuple[float, float] | None = None  # (when, idle cores)


def _usable() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: taskset, cgroup cpusets), else all of them."""
    cores = _usable()
    return len(cores) if cores else os.cpu_count() or 1


def _cpu_times(cores: set[int]) -> tuple[float, float] | None:
    """(busy, total) CPU seconds since boot of ``cores`` together, or None without /proc/stat."""
    busy = total = 0
    seen = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                fields = line.split()
                if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
                    continue
                if not fields[0][3:].isdigit() or int(fields[0][3:]) not in cores:
                    continue
                # user nice system idle iowait irq softirq steal (guest time is inside user and nice)
                ticks = [int(x) for x in fields[1:9]]
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
                seen += 1
    except (OSError, ValueError):
        return None
    if seen != len(cores):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return busy / hz, total / hz


def idle_cores(sample_s: float = SAMPLE_SECONDS) -> float | None:
    """How many of this process's usable cores other processes left idle (a fraction) over the next
    ``sample_s`` seconds; None where the kernel's counters cannot be read."""
    global _last
    now = time.monotonic()
    if _last is not None and now - _last[0] < _REUSE_SECONDS:
        return _last[1]
    cores = _usable()
    if not cores:
        return None
    a = _cpu_times(cores)
    if a is None:
        return None
    own0 = time.process_time()
    time.sleep(sample_s)
    b = _cpu_times(cores)
    own = time.process_time() - own0
    if b is None or b[1] <= a[1]:
        return None
    wall = (b[1] - a[1]) / len(cores)  # the total counts each core's time
    others = max(0.0, (b[0] - a[0]) - own) / wall
    idle = max(0.0, len(cores) - others)
    _last = (time.monotonic(), idle)
    return idle


def default_threads() -> int:
    """Threads for a session that gives none: one per idle usable core (at least one)."""
    usable = usable_cores()
    idle = idle_cores()
    if idle is None:
        return usable
    return max(1, min(usable, math.floor(idle + (1 - IDLE_FRACTION))))


def available_memory() -> int | None:
    """Bytes of memory the kernel estimates can be allocated without swapping (``MemAvailable``); None where
    it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_anon_bytes(status: str = "/proc/self/status") -> int:
    """This process's anonymous resident memory (``RssAnon``: the interpreter's heap, the libraries' data), what a
    run of the same program holds before its model loads; 0 where the system does not say."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text.isdigit() else None  # cgroup v2 says "max" for no limit
    except (OSError, ValueError):
        return None


def _inactive_file(stat_path: str, key: str) -> int:
    try:
        with open(stat_path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory_left(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup still allows (its limit less its working set: usage less the inactive
    page cache the kernel reclaims first, as container runtimes count it); None without a limit. cgroup v1
    (``memory`` controller) and v2; ``proc`` and ``root`` are where the kernel says it (tests point them
    elsewhere)."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1
            base = root + "/memory" + path.rstrip("/")
            limit, usage = _read_int(base + "/memory.limit_in_bytes"), _read_int(base + "/memory.usage_in_bytes")
            inactive = _inactive_file(base + "/memory.stat", "total_inactive_file")
            break
        if controllers == "":  # v2
            base = root + path.rstrip("/")
            limit, usage = _read_int(base + "/memory.max"), _read_int(base + "/memory.current")
            inactive = _inactive_file(base + "/memory.stat", "inactive_file")
            break
    else:
        return None
    if limit is None or usage is None or limit >= 1 << 60:  # v1 reports "no limit" as a huge number
        return None
    return max(0, limit - max(0, usage - inactive))


def release_free_memory() -> bool:
    """Hand the pages the C allocator keeps free back to the system (glibc's ``malloc_trim``); False where the C
    library has no such call (musl, macOS), which changes nothing else.

    A task that allocates millions of small blocks in a worker thread (a tokenizer's encoding of a long text: a
    string and offsets per token) frees them into that thread's heap, where glibc keeps them for later instead of
    returning them: the process's resident memory stayed hundreds of MiB higher after one long request. Called
    after such a task; it takes under 30 ms after the largest one the server allows."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    import ctypes

    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return cast(Callable[[int], int], fn)


def kill_child(proc: subprocess.Popen[bytes]) -> None:
    """End a child process at once (SIGKILL, reaped) and close the pipes this process holds to it; safe twice."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGKILL)
        except OSError:  # it ended in between
            pass
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


__all__ = ["IDLE_FRACTION", "available_memory", "cgroup_memory_left", "default_threads", "idle_cores", "kill_child",
           "process_anon_bytes", "release_free_memory", "usable_cores"]
