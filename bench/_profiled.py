"""``python bench/_profiled.py ARGS``: ``renqueue ARGS`` with :mod:`cProfile` ready, for
``bench/pipeline.py --procs``. ``SIGUSR1`` starts the profiler; ``SIGUSR2`` stops it and
writes its stats (pstats; times are the main thread's CPU seconds) to
``$PIPELINE_PROFILE_DIR/<pid>.prof`` (written to a temporary name and renamed, so a reader
sees the whole file or none). Until ``SIGUSR1`` nothing is profiled: the process runs as
``renqueue ARGS`` does."""

from __future__ import annotations

import cProfile
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType


def main() -> None:
    out = Path(os.environ.get("PIPELINE_PROFILE_DIR", "."))
    # CPU time of the main thread, not wall time: on a shared machine a wall clock
    # charges the time the process waited for a core (or in epoll) to whatever ran then.
    profiler = cProfile.Profile(time.thread_time)

    def start(_signum: int, _frame: FrameType | None) -> None:
        profiler.enable()

    def stop(_signum: int, _frame: FrameType | None) -> None:
        profiler.disable()
        path = out / f"{os.getpid()}.prof"
        profiler.dump_stats(str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").rename(path)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    from renqueue.cli import main as cli  # noqa: PLC0415 - after the handlers are set

    sys.argv = ["renqueue", *sys.argv[1:]]
    sys.exit(cli())


if __name__ == "__main__":
    main()
