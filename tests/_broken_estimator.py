"""A module that fails as it loads (tests/test_complexity.py: a learned scorer named
by import path whose module raises is a clear error, not a traceback)."""

1 / 0  # noqa: B018
