"""Hostile inputs to `renqueue submit` (issue 28, a review): bytes that are not
UTF-8 on the line, in a file or on stdin, a stdin that never ends, a messages
file nested past any sense, `/dev/zero`. Each is refused in one line with
exit 2 (or 4, `--wait` run out) before anything is sent: the NATS URL given
has nothing listening, which would be exit 4 had it been tried."""

from __future__ import annotations

import asyncio
import os
import resource
import sys
from pathlib import Path

import pytest
from test_cli import write_config

#: Nothing listens here: a command that got as far as connecting exits 4.
NOWHERE = "nats://127.0.0.1:1"


async def submit(
    *args: str | bytes, stdin: int | None = None, feed: bytes | None = None
) -> tuple[int, str]:
    """``renqueue --nats NOWHERE submit ARGS``: (exit code, stderr). Its
    memory is capped and it is killed if it outlives the test's bound (an
    unbounded read of /dev/zero would otherwise take the machine's memory)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", "--nats", NOWHERE, "submit", *args,
        stdin=asyncio.subprocess.PIPE if feed is not None else stdin,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": ""}, preexec_fn=capped,
    )  # fmt: skip
    try:
        _out, err = await asyncio.wait_for(proc.communicate(feed), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, err.decode(errors="replace")


def capped() -> None:
    """In the child: at most 2 GiB of address space."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def one_line(err: str, words: str) -> None:
    assert "Traceback" not in err, err
    assert words in err, err


@pytest.mark.parametrize("where", ["stdin", "-f", "--messages"])
async def test_bytes_that_are_not_utf8_are_refused_in_one_line(tmp_path: Path, where: str) -> None:
    """A binary prompt ended in a UnicodeDecodeError traceback (exit 1)."""
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"\xff\xfe\x00binary")
    if where == "stdin":
        code, err = await submit("-", feed=binary.read_bytes())
    else:
        code, err = await submit(where, str(binary))
    assert code == 2, err
    one_line(err, "is not UTF-8 text (byte 0)")


@pytest.mark.parametrize("option", [(), ("hi", "--system")])
async def test_an_argument_that_is_not_utf8_is_refused_in_one_line(
    option: tuple[str, ...],
) -> None:
    """A prompt or --system whose bytes are not UTF-8 reached JSON as a lone
    surrogate: a UnicodeEncodeError traceback (exit 1)."""
    code, err = await submit(*option, b"caf\xe9")
    assert code == 2, err
    one_line(err, "is not UTF-8 text (character 4)")


async def test_a_messages_file_nested_too_deeply_or_not_json_is_refused(tmp_path: Path) -> None:
    """A messages file of 100,000 nested lists ended in a RecursionError
    traceback; NaN, which is not JSON, was taken."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    code, err = await submit("--messages", str(deep))
    assert code == 2, err
    one_line(err, "--messages: nested too deeply")
    nan = tmp_path / "nan.json"
    nan.write_text('[{"role": "user", "content": "hi", "x": NaN}]')
    code, err = await submit("--messages", str(nan))
    assert code == 2, err
    one_line(err, "--messages: not JSON")


async def test_a_closed_stdin_is_refused_in_one_line() -> None:
    """`submit - <&-` ended in an AttributeError traceback."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        "import os, sys; os.close(0); from renqueue.cli import main; "
        f"sys.exit(main(['--nats', {NOWHERE!r}, 'submit', '-']))",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": ""},
    )  # fmt: skip
    _out, errb = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2, errb
    one_line(errb.decode(), "cannot read stdin")


async def test_input_that_never_ends_is_refused_at_the_bound_not_read_for_ever(
    tmp_path: Path,
) -> None:
    """`submit -f /dev/zero` (or `yes | submit -`) read until memory ran out;
    a conversation from /dev/zero too. Both stop past what a request may carry."""
    code, err = await submit("-f", "/dev/zero")
    assert code == 2, err
    one_line(err, "/dev/zero holds more than 1,000,000 characters")
    zero = os.open("/dev/zero", os.O_RDONLY)
    try:
        code, err = await submit("-", stdin=zero)
    finally:
        os.close(zero)
    assert code == 2, err
    one_line(err, "stdin holds more than 1,000,000 characters")
    code, err = await submit("--messages", "/dev/zero")
    assert code == 2, err
    one_line(err, "/dev/zero is over 64 MiB")


async def test_wait_bounds_a_stdin_that_never_ends() -> None:
    """`--wait` bounds the whole command: a stdin whose writer never closes it
    held `submit - --wait 1` for ever. It ends at the bound, exit 4, nothing sent."""
    read_end, write_end = os.pipe()
    try:
        code, err = await submit("-", "--wait", "1", stdin=read_end)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert code == 4, err
    one_line(err, "stdin did not end within the --wait bound: nothing was submitted")


@pytest.mark.parametrize(
    ("param", "says"),
    [
        ("stream=true", "--param: stream cannot be set"),
        ("model=gpt-4o", "--param: model cannot be set"),
        ("n=5", "--param: n cannot be set"),
        ("x=" + "[" * 100 + "]" * 100, "--param: nested deeper than 64 levels"),
        ("x=" + "[" * 50_000 + "]" * 50_000, "--param: x is nested too deeply"),
    ],
    ids=["stream", "model", "n", "deep", "deeper"],
)
async def test_a_param_the_router_would_reject_is_refused_before_sending(
    tmp_path: Path, param: str, says: str
) -> None:
    """`--param stream=true` (or model, n, ...) was published and then rejected
    by the router (exit 3, a rejected request in the log); a value nested
    50,000 deep was a RecursionError traceback. Both are usage errors now."""
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    code, err = await submit("hi", "-c", str(config), "--route", "chat", "--param", param)
    assert code == 2, err
    one_line(err, says)


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--wait", "nan", "must be a finite number"),
        ("--wait", "inf", "must be a finite number"),
        ("--timeout", "nan", "must be a finite number"),
        ("--timeout", "-5", "is not in the range 0<x<=2592000"),
        ("--timeout", "1e300", "is not in the range 0<x<=2592000"),
        ("--max-cost", "nan", "must be a finite number"),
    ],
)
async def test_a_number_no_request_can_carry_is_refused_before_sending(
    tmp_path: Path, option: str, value: str, says: str
) -> None:
    """`--wait nan` ended at once, 'could not submit within nan s' (exit 4);
    `--timeout -5` or `1e300` was published and then expired or rejected
    (exit 3); `--timeout nan` and `--max-cost nan` were sent as they were."""
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    code, err = await submit("hi", "-c", str(config), option, value)
    assert code == 2, err
    one_line(err, says)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("nats://user:secret@host[:4222", "not a NATS URL: 'host[:4222' (Invalid IPv6 URL)"),
        ("nats://host:99999", "not a NATS URL: 'nats://host:99999' (Port out of range"),
    ],
    ids=["bracket", "port"],
)
async def test_a_nats_url_that_does_not_parse_is_a_usage_error(url: str, says: str) -> None:
    """`--nats 'nats://host[:4222'` was a ValueError traceback, a port past
    65535 an AssertionError one: one line, exit 2, the password not shown."""
    code, err = await submit("hi", "--nats", url)
    assert code == 2, err
    one_line(err, says)
    assert "secret" not in err


@pytest.mark.parametrize(
    "content", [b"\xff\xfe" + bytes(range(256)), b"nats://x\x1b[31m:4222\n", b"n" * 5000]
)
async def test_a_damaged_url_file_of_up_is_one_line(tmp_path: Path, content: bytes) -> None:
    """A client command reads the URL `up` wrote in its data_dir: one of binary
    bytes was a UnicodeDecodeError traceback, one with an escape a ValueError
    one (a bracket read as IPv6). It is named as damaged, exit 2."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "nats.url").write_bytes(content)
    config = tmp_path / "renqueue.toml"
    config.write_text(
        f'[nats]\nurl = ""\ndata_dir = "{data}"\n[backends.b]\nbase_url = "http://127.0.0.1:1/v1"'
        '\nmodel = "m"\n[routes.chat]\nbackends = ["b"]\n'
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", "-c", str(config), "submit", "hi",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": "", "RENQUEUE_NATS_URL": ""},
    )  # fmt: skip
    _out, errb = await asyncio.wait_for(proc.communicate(), 60)
    err = errb.decode(errors="replace")
    assert proc.returncode == 2, err
    one_line(err, "nats.url is damaged (not a URL): remove it, or restart `renqueue up`")
    assert "\x1b" not in err
