"""Not slower: an old commit's ``bench/pipeline.py`` against this checkout's, run alternately.

Run with ``make bench-compare`` (``OLD=<commit>``, default 51190ec, the commit before
issue #7's work began; about 4.5 minutes for 3 rounds once the old side is set up) or
``python bench/compare.py --old <commit> --rounds N``.

Each side runs its *own* ``bench/pipeline.py`` with its *own* virtualenv, as a
subprocess, and is read only through the JSON it writes: this script imports nothing
from ``renqueue`` or ``bench/common.py``, so it does not care how either checkout lays
out its package.

- OLD: ``git archive`` of the commit, extracted under
  ``.renqueue/bench-compare/<sha>/src`` (git-ignored; not a ``git worktree``, so the
  repository's worktree list is left alone) with its own venv beside it
  (``python -m venv`` + ``pip install -e '.[dev]'``), kept for the next run. The
  extract has no ``.git``: git is told not to look above it
  (``GIT_CEILING_DIRECTORIES``), so its report's ``git_commit`` reads "unknown", not
  this checkout's commit; the real one is recorded here.
- NEW: this checkout (its working tree, committed or not) and its ``.venv``.

The two run alternately, old, new, old, new, ..., ``--rounds`` times each, so that
what else the machine is doing hits both alike. From every run it takes, per client
concurrency C: requests/s, the added latency p50/p99 (pipeline minus a direct adapter
call at the same C), the end-to-end latency p50/p99, and the broker ceiling that run
measured (``publish_async`` windowed msgs/s; ``js.publish`` one at a time, p50/p99).
Each value is also expressed against that ceiling: req/s as a fraction of the publish
ceiling, added and end-to-end latency in units of one acked publish's latency.

Per metric and reading (raw; against the ceiling) it prints the median over rounds,
min-max, new/old of the medians and a noise band: the larger of the two sides' relative
range over its rounds, (max - min) / median, i.e. how far apart two runs of the same
code landed in this very comparison. A metric is "slower by X %" when both readings
are worse by more than their bands, "inconclusive" when only one is (the ceiling, a
few seconds of its own, is noisy too), else "no worse". An added latency "slower" while
the end-to-end latency of the same percentile is no worse and its raw median not higher
is "baseline moved": the direct call it is measured over got faster (a faster adapter),
no request got slower.
Exit status: 0 nothing slower,
1 something slower, 2 a run or the set-up failed.

Results: a table on stdout, JSON in ``bench/results/compare-<UTC>.json`` and
``bench/results/compare-latest.json``, holding every run's full pipeline report.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / ".renqueue" / "bench-compare"
#: The commit before issue #7's work began (README: make chaos).
DEFAULT_OLD = "51190ec"
DEFAULT_LEVELS = "1,16,64"
#: One pipeline run, set-up included, must end within this (a --quick run takes ~1 min).
RUN_TIMEOUT = 20 * 60


class CompareError(Exception):
    """A set-up step or a benchmark run failed; the message says which and where its log is."""


# ------------------------------------------------------------------ checkouts


@dataclass(frozen=True)
class Checkout:
    """One side of the comparison: where its tree is, which Python runs it."""

    side: str  # "old" or "new"
    ref: str
    commit: str
    root: Path
    python: Path
    #: Options its bench/pipeline.py takes (read from its --help).
    options: frozenset[str]
    #: Extra environment for its runs.
    env: tuple[tuple[str, str], ...] = ()


def git(*args: str, cwd: Path = ROOT) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise CompareError(f"git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.strip()


def run_logged(cmd: list[str], *, cwd: Path, log: Path, env: dict[str, str] | None = None) -> None:
    """Run ``cmd``, appending its output to ``log``; a failure shows the log's tail."""
    with log.open("a") as sink:
        sink.write(f"$ {' '.join(cmd)}\n")
        sink.flush()
        done = subprocess.run(
            cmd, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, env=env, check=False
        )
    if done.returncode != 0:
        raise CompareError(
            f"{' '.join(cmd)} (in {cwd}) exited {done.returncode}; "
            f"last lines of {log}:\n{tail(log)}"
        )


def tail(path: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


def clean_env(extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """This environment without anything that would make one side's Python see the other's."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env.update(extra)
    return env


def pipeline_options(python: Path, root: Path, env: dict[str, str]) -> frozenset[str]:
    """The ``--options`` a checkout's bench/pipeline.py accepts (so older ones still run)."""
    out = subprocess.run(
        [str(python), "bench/pipeline.py", "--help"],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        raise CompareError(
            f"{root}/bench/pipeline.py --help failed ({out.returncode}): {out.stderr[-2000:]}"
        )
    return frozenset(word.strip("[],") for word in out.stdout.split() if word.startswith("--"))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (two compare runs do not build one cache at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_old(ref: str, cache: Path, *, fresh: bool) -> Checkout:
    """Extract ``ref`` and give it a venv, or reuse the ones cached for its commit."""
    sha = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    base = cache / sha
    src, venv, ready = base / "src", base / "venv", base / "ready"
    env_extra = (("GIT_CEILING_DIRECTORIES", str(base)),)
    with locked(cache / f"{sha}.lock"):
        if fresh or not (ready.exists() and ready.read_text().strip() == sha):
            started = time.perf_counter()
            print(f"setting up OLD {ref} ({sha[:12]}) in {base} ...", flush=True)
            shutil.rmtree(base, ignore_errors=True)
            src.mkdir(parents=True)
            log = base / "setup.log"
            archive = subprocess.run(
                ["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=False
            )
            if archive.returncode != 0:
                raise CompareError(f"git archive {sha}: {archive.stderr.decode(errors='replace')}")
            with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                tar.extractall(src, filter="data")
            env = clean_env(env_extra)
            run_logged([sys.executable, "-m", "venv", str(venv)], cwd=src, log=log, env=env)
            pip = str(venv / "bin" / "pip")
            run_logged([pip, "install", "--quiet", "--upgrade", "pip"], cwd=src, log=log, env=env)
            run_logged([pip, "install", "--quiet", "-e", ".[dev]"], cwd=src, log=log, env=env)
            ready.write_text(sha + "\n")
            print(f"  done in {time.perf_counter() - started:.0f}s (log: {log})", flush=True)
        else:
            print(f"reusing OLD {ref} ({sha[:12]}) from {base}", flush=True)
    python = venv / "bin" / "python"
    options = pipeline_options(python, src, clean_env(env_extra))
    return Checkout("old", ref, sha, src, python, options, env_extra)


def prepare_new() -> Checkout:
    """This checkout, as it is on disk, with its own .venv."""
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        raise CompareError(f"{python} not found: run `make setup` first")
    sha = git("rev-parse", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        sha += "-dirty"
    options = pipeline_options(python, ROOT, clean_env())
    return Checkout("new", "working tree", sha, ROOT, python, options)


# ----------------------------------------------------------------------- runs


def pipeline_command(checkout: Checkout, out: Path, *, quick: bool, levels: str) -> list[str]:
    cmd = [str(checkout.python), "bench/pipeline.py"]
    wanted: list[tuple[str, list[str], bool]] = [
        ("--quick", ["--quick"], quick),
        ("--levels", ["--levels", levels], True),
        ("--no-profile", ["--no-profile"], True),  # the profile window measures nothing compared
        # Nor does the floor (bench/_floor.py), and a side without it would run its levels
        # back to back where the other ran the floor between them.
        ("--no-floor", ["--no-floor"], True),
        ("--out", ["--out", str(out)], True),
    ]
    for option, words, use in wanted:
        if use and option in checkout.options:
            cmd += words
    return cmd


def run_pipeline(
    checkout: Checkout, out: Path, *, quick: bool, levels: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run of the checkout's own bench/pipeline.py: its report, and how the run went."""
    out.mkdir(parents=True)
    cmd = pipeline_command(checkout, out, quick=quick, levels=levels)
    log = out / "run.log"
    load_before = list(os.getloadavg())
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    start = time.perf_counter()
    with log.open("w") as sink:
        try:
            done = subprocess.run(
                cmd,
                cwd=checkout.root,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=clean_env(checkout.env),
                timeout=RUN_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise CompareError(f"{checkout.side} run timed out; log {log}:\n{tail(log)}") from exc
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise CompareError(
            f"{checkout.side} run exited {done.returncode}; last lines of {log}:\n{tail(log)}"
        )
    # Without --out (an old pipeline.py) it writes into its own checkout.
    folder = out if "--out" in checkout.options else checkout.root / "bench" / "results"
    report: dict[str, Any] = json.loads((folder / "pipeline-latest.json").read_text())
    meta = {
        "command": cmd,
        "cwd": str(checkout.root),
        "started_at": started_at,
        "seconds": round(seconds, 1),
        "loadavg_before": load_before,
        "log": str(log),
    }
    return report, meta


# -------------------------------------------------------------------- metrics


def _rps(report: dict[str, Any], level: str) -> float:
    return float(report["pipeline"]["levels"][level]["requests_per_s"])


def _added(report: dict[str, Any], level: str, pct: str) -> float:
    return float(report["analysis"]["levels"][level]["added_latency_ms"][f"{pct}_ms"])


def _latency(report: dict[str, Any], level: str, pct: str) -> float:
    return float(report["pipeline"]["levels"][level]["latency"][f"{pct}_ms"])


def _publish_ceiling(report: dict[str, Any]) -> float:
    return float(report["broker"]["publish_async_windowed"]["msgs_per_s"])


def _publish_latency(report: dict[str, Any], pct: str) -> float:
    return float(report["broker"]["publish_one_at_a_time"]["latency"][f"{pct}_ms"])


@dataclass(frozen=True)
class Metric:
    """One compared quantity at a level: raw, and against the same run's broker ceiling."""

    key: str
    label: str
    unit: str
    #: True: more is better (throughput); False: less is better (latency).
    higher_is_better: bool
    raw: Callable[[dict[str, Any], str], float]
    ceiling_label: str
    vs_ceiling: Callable[[dict[str, Any], str], float]


# Added latency is counted in acked round trips, i.e. over the p50 of one js.publish
# awaited alone, for p99 too: that ceiling's own p99 (1-2 s of single publishes) swings
# several-fold between runs on this machine, more than anything it would normalise.
METRICS = (
    Metric(
        "requests_per_s",
        "req/s",
        "",
        True,
        _rps,
        "% of publish_async ceiling",
        lambda r, lv: 100 * _rps(r, lv) / _publish_ceiling(r),
    ),
    Metric(
        "added_p50_ms",
        "added p50",
        "ms",
        False,
        lambda r, lv: _added(r, lv, "p50"),
        "in js.publish p50s",
        lambda r, lv: _added(r, lv, "p50") / _publish_latency(r, "p50"),
    ),
    Metric(
        "added_p99_ms",
        "added p99",
        "ms",
        False,
        lambda r, lv: _added(r, lv, "p99"),
        "in js.publish p50s",
        lambda r, lv: _added(r, lv, "p99") / _publish_latency(r, "p50"),
    ),
    Metric(
        "latency_p50_ms",
        "end-to-end p50",
        "ms",
        False,
        lambda r, lv: _latency(r, lv, "p50"),
        "in js.publish p50s",
        lambda r, lv: _latency(r, lv, "p50") / _publish_latency(r, "p50"),
    ),
    Metric(
        "latency_p99_ms",
        "end-to-end p99",
        "ms",
        False,
        lambda r, lv: _latency(r, lv, "p99"),
        "in js.publish p50s",
        lambda r, lv: _latency(r, lv, "p99") / _publish_latency(r, "p50"),
    ),
)

#: Added latency is the pipeline's minus a direct adapter call's at the same C: a new
#: adapter that makes the direct call faster raises it although no request got slower.
#: Such an added-latency "slower" is judged against the end-to-end latency of the same
#: percentile; when that is no worse, the verdict is "baseline moved", not "slower".
BASELINED = {"added_p50_ms": "latency_p50_ms", "added_p99_ms": "latency_p99_ms"}

#: The broker ceiling itself, per run: the same nats-server on both sides, so new/old
#: should be ~1 and its spread is a direct reading of the machine's noise.
CEILINGS: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("publish_async_msgs_per_s", "publish_async msgs/s", _publish_ceiling),
    (
        "publish_one_at_a_time_msgs_per_s",
        "js.publish 1-by-1 msgs/s",
        lambda r: float(r["broker"]["publish_one_at_a_time"]["msgs_per_s"]),
    ),
    ("publish_p50_ms", "js.publish p50 ms", lambda r: _publish_latency(r, "p50")),
    ("publish_p99_ms", "js.publish p99 ms", lambda r: _publish_latency(r, "p99")),
    (
        "fetch100_ack_msgs_per_s",
        "fetch(100)+ack msgs/s",
        lambda r: float(r["broker"]["fetch100_ack"]["msgs_per_s"]),
    ),
)


def _cpu_ms(report: dict[str, Any], level: str) -> float:
    return float(report["pipeline"]["levels"][level]["python_cpu_ms_per_request"])


def spread(values: list[float]) -> dict[str, Any]:
    median = statistics.median(values)
    low, high = min(values), max(values)
    return {
        "median": median,
        "min": low,
        "max": high,
        "relative_range": (high - low) / abs(median) if median else float("inf"),
        "values": values,
    }


def judge(old: list[float], new: list[float], *, higher_is_better: bool) -> dict[str, Any]:
    """new/old of the medians against the noise band (the larger relative range of a side)."""
    a, b = spread(old), spread(new)
    band = max(a["relative_range"], b["relative_range"])
    ratio = b["median"] / a["median"] if a["median"] else float("nan")
    # Positive = worse: less throughput, or more added latency.
    worse = (1 - ratio) if higher_is_better else (ratio - 1)
    return {
        "old": a,
        "new": b,
        "new_over_old": ratio,
        "worse_by": worse,
        "band": band,
        "slower": worse > band,
        "better": -worse > band,
    }


def change(row: dict[str, Any]) -> str:
    word = "worse" if row["worse_by"] > 0 else "better"
    return f"{100 * abs(row['worse_by']):.0f} % {word}, band ±{100 * row['band']:.0f} %"


def verdict(raw: dict[str, Any], vs: dict[str, Any]) -> tuple[str, str]:
    """Both readings beyond their bands the same way -> slower/better; one -> inconclusive."""
    detail = f"raw {change(raw)}; vs ceiling {change(vs)}"
    if raw["slower"] and vs["slower"]:
        worst = min(raw["worse_by"], vs["worse_by"])
        return "slower", f"slower by {100 * worst:.0f} % or more ({detail})"
    if raw["slower"] or vs["slower"]:
        return "inconclusive", f"inconclusive: one reading slower beyond its band ({detail})"
    if raw["better"] and vs["better"]:
        return "better", f"no worse: better ({detail})"
    return "no_worse", f"no worse ({detail})"


def at(
    read: Callable[[dict[str, Any], str], float], level: str
) -> Callable[[dict[str, Any]], float]:
    """``read`` at one concurrency level."""
    return lambda report: read(report, level)


def summarise(
    runs: list[dict[str, Any]], levels: list[str]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    def values(side: str, read: Callable[[dict[str, Any]], float]) -> list[float]:
        return [read(run["report"]) for run in runs if run["side"] == side]

    table: dict[str, Any] = {}
    for level in levels:
        table[level] = {}
        for m in METRICS:
            raw, vs = (
                judge(
                    values("old", at(read, level)),
                    values("new", at(read, level)),
                    higher_is_better=m.higher_is_better,
                )
                for read in (m.raw, m.vs_ceiling)
            )
            outcome, line = verdict(raw, vs)
            table[level][m.key] = {
                "label": m.label,
                "unit": m.unit,
                "ceiling_label": m.ceiling_label,
                "raw": raw,
                "vs_ceiling": vs,
                "outcome": outcome,
                "verdict": line,
            }
        for added, end_to_end in BASELINED.items():
            row, whole = table[level][added], table[level][end_to_end]
            # "No worse" alone would let a real regression through: an end-to-end rise
            # within a wide band is "no worse" while the added latency's narrower band
            # calls it slower, and the direct call had not moved. A moved baseline needs
            # the end-to-end median not higher at all (so the direct call's median fell).
            if (
                row["outcome"] == "slower"
                and whole["outcome"] in ("no_worse", "better")
                and whole["raw"]["worse_by"] <= 0
            ):
                row["outcome"] = "baseline_moved"
                row["verdict"] = (
                    f"baseline moved: {row['verdict']}, but {whole['label']} not higher"
                    f" ({whole['verdict']}), so the direct call it is measured over got"
                    " faster; not slower"
                )
    ceilings = {}
    for key, label, read_ceiling in CEILINGS:
        old, new = spread(values("old", read_ceiling)), spread(values("new", read_ceiling))
        ceilings[key] = {
            "label": label,
            "old": old,
            "new": new,
            "new_over_old": new["median"] / old["median"] if old["median"] else float("nan"),
        }
    # CPU of the benchmark's Python process per request: less moved by waiting on other
    # processes than rates and latencies are, though not immune (caches, clock); shown,
    # not judged.
    cpu = {
        level: judge(
            values("old", at(_cpu_ms, level)),
            values("new", at(_cpu_ms, level)),
            higher_is_better=False,
        )
        for level in levels
    }
    return table, ceilings, cpu


# ---------------------------------------------------------------------- report


def num(value: float) -> str:
    """About three significant digits, never in exponent form."""
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def cell(s: dict[str, Any]) -> str:
    return f"{num(s['median'])} [{num(s['min'])}-{num(s['max'])}]"


def print_report(result: dict[str, Any]) -> None:
    old, new = result["old"], result["new"]
    print()
    print(f"Ren-Queue bench compare  {result['timestamp']}")
    print(f"  OLD {old['ref']} = {old['commit'][:12]}   NEW {new['ref']} = {new['commit'][:12]}")
    machine = result["machine"]
    print(
        f"  {machine['cpu_count']} cpus ({machine['cpu_model']}), {result['settings']['rounds']}"
        f" rounds each, alternating, mode {result['settings']['mode']},"
        f" loadavg {machine['loadavg_start'][0]:.2f} at start, "
        f"{machine['loadavg_end'][0]:.2f} at end"
    )
    print(
        "  median [min-max] over rounds; band = the larger relative range (max-min)/median"
        " of the two sides"
    )

    head = f"  {'':<30} {'old':>24} {'new':>24} {'new/old':>8} {'band':>6}"
    print("\nBroker ceiling measured in each run (the same nats-server on both sides)")
    print(head[:-7])
    for row in result["ceilings"].values():
        print(
            f"  {row['label']:<30} {cell(row['old']):>24} {cell(row['new']):>24}"
            f" {row['new_over_old']:>8.2f}"
        )

    for level, rows in result["table"].items():
        print(f"\nC={level}")
        print(head)
        for row in rows.values():
            for label, judged in (
                (f"{row['label']} {row['unit']}".strip(), row["raw"]),
                (f"  {row['ceiling_label']}", row["vs_ceiling"]),
            ):
                band = "±" + format(100 * judged["band"], ".0f") + "%"
                print(
                    f"  {label:<30} {cell(judged['old']):>24} {cell(judged['new']):>24}"
                    f" {judged['new_over_old']:>8.2f} {band:>6}"
                )
            print(f"  -> {row['label']}: {row['verdict']}")

    print(
        "\nPython CPU per request, ms (the process running client, routers and workers; not judged)"
    )
    print(head)
    for level, judged in result["python_cpu_ms_per_request"].items():
        band = "±" + format(100 * judged["band"], ".0f") + "%"
        print(
            f"  {'C=' + level:<30} {cell(judged['old']):>24} {cell(judged['new']):>24}"
            f" {judged['new_over_old']:>8.2f} {band:>6}"
        )
    summary = result["verdict"]
    print()
    if summary["slower"]:
        print("VERDICT: slower beyond the noise in " + "; ".join(summary["slower"]))
    else:
        print("VERDICT: no worse (no metric slower beyond its noise band both raw and vs ceiling)")
    if summary["inconclusive"]:
        print("  inconclusive (one reading only): " + "; ".join(summary["inconclusive"]))
    if summary["baseline_moved"]:
        print("  baseline moved (not slower): " + "; ".join(summary["baseline_moved"]))
    for run in result["runs"]:
        if run["pipeline_errors"]:
            print(f"  WARNING: {run['side']} round {run['round']} errors {run['pipeline_errors']}")


# ------------------------------------------------------------------------ main


def machine() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": list(os.getloadavg()),
    }


def one_line(report: dict[str, Any], levels: list[str]) -> str:
    rates = ", ".join(f"C={lv} {_rps(report, lv):.0f}" for lv in levels)
    return f"req/s {rates}; publish ceiling {_publish_ceiling(report):,.0f} msgs/s"


def compare(args: argparse.Namespace) -> dict[str, Any]:
    levels = [str(int(x)) for x in args.levels.split(",")]
    info = machine()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    old = prepare_old(args.old, args.cache_dir, fresh=args.fresh)
    new = prepare_new()
    runs: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="renqueue-bench-compare-"))
    try:
        for rnd in range(1, args.rounds + 1):
            for checkout in (old, new):
                label = f"round {rnd}/{args.rounds} {checkout.side} {checkout.commit[:12]}"
                print(f"{label} ...", flush=True)
                report, meta = run_pipeline(
                    checkout,
                    work / f"{rnd}-{checkout.side}",
                    quick=not args.full,
                    levels=args.levels,
                )
                errors = {
                    lv: report["pipeline"]["levels"][lv].get("errors", 0)
                    for lv in levels
                    if report["pipeline"]["levels"][lv].get("errors", 0)
                }
                print(f"  {one_line(report, levels)} ({meta['seconds']:.0f}s)", flush=True)
                runs.append(
                    {
                        "side": checkout.side,
                        "round": rnd,
                        "commit": checkout.commit,
                        **meta,
                        "pipeline_errors": errors,
                        "report": report,
                    }
                )
    finally:
        if args.keep:
            print(f"run logs and reports kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = list(os.getloadavg())
    table, ceilings, cpu = summarise(runs, levels)

    def where(outcome: str) -> list[str]:
        return [
            f"C={lv} {row['label']} ({row['verdict']})"
            for lv, rows in table.items()
            for row in rows.values()
            if row["outcome"] == outcome
        ]

    return {
        "benchmark": "compare",
        "timestamp": stamp,
        "old": {
            "ref": old.ref,
            "commit": old.commit,
            "root": str(old.root),
            "python": str(old.python),
        },
        "new": {
            "ref": new.ref,
            "commit": new.commit,
            "root": str(new.root),
            "python": str(new.python),
        },
        "settings": {
            "rounds": args.rounds,
            "order": "old, new alternately, old first in every round",
            "mode": "full" if args.full else "quick",
            "levels": levels,
            "commands": {"old": runs[0]["command"], "new": runs[1]["command"]},
        },
        "machine": info,
        "ceilings": ceilings,
        "table": table,
        "python_cpu_ms_per_request": cpu,
        "verdict": {
            "slower": where("slower"),
            "inconclusive": where("inconclusive"),
            "baseline_moved": where("baseline_moved"),
            "no_worse": not where("slower"),
            "rule": (
                "per reading (raw; vs the same run's broker ceiling): new/old of the medians,"
                " band = max over the sides of (max-min)/median over its rounds; a metric is"
                " slower when both readings are worse by more than their bands, inconclusive"
                " when one is; an added latency slower while the end-to-end latency of the"
                " same percentile is no worse and its raw median not higher is 'baseline"
                " moved' (the direct call it is measured over got faster), not slower"
            ),
        },
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument(
        "--old", default=DEFAULT_OLD, help=f"the commit to compare against ({DEFAULT_OLD})"
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side (3)")
    parser.add_argument("--levels", default=DEFAULT_LEVELS, help=f"C levels ({DEFAULT_LEVELS})")
    parser.add_argument(
        "--full", action="store_true", help="pipeline.py's full windows, not --quick (~2x longer)"
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=CACHE, help="where OLD's extract and venv are kept"
    )
    parser.add_argument("--fresh", action="store_true", help="rebuild OLD's extract and venv")
    parser.add_argument("--keep", action="store_true", help="keep the runs' logs and JSON")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the noise band comes from the rounds' spread)")
    try:
        result = compare(args)
    except CompareError as exc:
        print(f"bench compare: {exc}", file=sys.stderr)
        sys.exit(2)
    print_report(result)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"compare-{result['timestamp']}.json"
    text = json.dumps(result, indent=2) + "\n"
    path.write_text(text)
    (args.out / "compare-latest.json").write_text(text)
    print(f"\n  JSON: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    sys.exit(1 if result["verdict"]["slower"] else 0)


if __name__ == "__main__":
    main()
