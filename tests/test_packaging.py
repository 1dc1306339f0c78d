"""An installed renqueue (a wheel, not a checkout) finds everything it reads at run time.

Issue #6 item 24: the wheel had no stream definitions, so an installed
``renqueue up`` stopped at "stream definitions directory .../site-packages/streams
not found". This test builds the wheel from a copy of the project files with
pip (an isolated build: pip brings the build backend), installs it into a
bare directory, and runs ``python -m renqueue provision`` from an unrelated
working directory with only that directory on the path.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest

from renqueue.broker import EmbeddedServer

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.packaging


async def _run(*args: str, cwd: Path, env: dict[str, str], limit: float) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *args,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), limit)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def _bare_env(**extra: str) -> dict[str, str]:
    """The environment minus anything that would point renqueue at this checkout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "RENQUEUE_STREAMS_DIR", "RENQUEUE_CONFIG", "RENQUEUE_NATS_URL"}
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


async def test_an_installed_wheel_finds_its_stream_definitions(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    # Build from a copy: an in-tree build would leave build/ and *.egg-info
    # behind, and a stale build/lib could hide a file the wheel lacks.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("renqueue", "streams"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    dist, site, cwd = tmp_path / "dist", tmp_path / "site", tmp_path / "elsewhere"
    cwd.mkdir()
    pip = (sys.executable, "-m", "pip", "--quiet")
    code, out = await _run(
        *pip, "wheel", "--no-deps", "-w", str(dist), str(src), cwd=cwd, env=_bare_env(), limit=90
    )
    assert code == 0, out
    (wheel,) = dist.glob("renqueue-*.whl")
    code, out = await _run(
        *pip, "install", "--no-deps", "--target", str(site), str(wheel),
        cwd=cwd, env=_bare_env(), limit=60,
    )  # fmt: skip
    assert code == 0, out

    # Every subpackage of the source tree made it into the wheel.
    packages = {p.parent.relative_to(ROOT) for p in (ROOT / "renqueue").rglob("__init__.py")}
    missing = [str(p) for p in packages if not (site / p / "__init__.py").is_file()]
    assert not missing, f"packages missing from the wheel: {missing}"
    # The gateway's web console is package data, read when a gateway starts.
    for name in ("index.html", "console.js", "console.css"):
        assert (site / "renqueue" / "gateway" / "console" / name).is_file(), name

    env = _bare_env(PYTHONPATH=str(site))
    code, out = await _run(
        sys.executable, "-c",
        "import renqueue, renqueue.broker as p; print(renqueue.__file__); "
        "print(p.find_streams_dir())",
        cwd=cwd, env=env, limit=30,
    )  # fmt: skip
    assert code == 0, out
    module_file, streams = out.split()
    assert Path(module_file).is_relative_to(site)  # the installed copy, not this checkout
    assert Path(streams) == site / "renqueue" / "_streams"
    assert (Path(streams) / "consumers" / "worker.json").is_file()

    code, out = await _run(
        sys.executable, "-m", "renqueue", "--nats", isolated_server.url, "provision",
        cwd=cwd, env=env, limit=30,
    )  # fmt: skip
    assert code == 0, out
    assert "stream RQ_REQUESTS: created" in out
    assert "consumer RQ_REQUESTS/router-normal: created" in out
