"""``python bench/_traced.py ARGS``: ``renqueue ARGS`` with :mod:`tracemalloc` on, for
bench/soak.py's ``--tracemalloc``. ``SIGUSR2`` writes a snapshot to
``$SOAK_TRACEMALLOC_DIR/<pid>-<n>.snap`` (n counts from 1); frames kept per
allocation: ``$SOAK_TRACEMALLOC_FRAMES`` (default 8)."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import tracemalloc
from pathlib import Path
from types import FrameType


def main() -> None:
    tracemalloc.start(int(os.environ.get("SOAK_TRACEMALLOC_FRAMES", "8")))
    out = Path(os.environ.get("SOAK_TRACEMALLOC_DIR", "."))
    numbers = itertools.count(1)

    def dump(_signum: int, _frame: FrameType | None) -> None:
        path = out / f"{os.getpid()}-{next(numbers)}.snap"
        tracemalloc.take_snapshot().dump(str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").rename(path)

    signal.signal(signal.SIGUSR2, dump)
    from renqueue.cli import main as cli  # noqa: PLC0415 - imported with tracing on

    sys.argv = ["renqueue", *sys.argv[1:]]
    sys.exit(cli())


if __name__ == "__main__":
    main()
