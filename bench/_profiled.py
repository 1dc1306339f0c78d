"""Run a module under cProfile, timing CPU (not wall-clock) time, and write its stats
when it returns: ``python bench/_profiled.py OUT -m MODULE ARGS...``.

``python -m cProfile`` times the wall clock, so a process that waits (for a core on a
loaded machine, or in a ``send`` that wakes its peer) shows the wait as time spent;
here only the process's own CPU time counts. ``bench/gateway.py --profile`` uses it.
"""

from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main() -> None:
    out, flag, module, *rest = sys.argv[1:]
    if flag != "-m":
        raise SystemExit("usage: _profiled.py OUT -m MODULE [ARGS...]")
    sys.argv = [module, *rest]
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        profiler.disable()
        profiler.dump_stats(out)


if __name__ == "__main__":
    main()
