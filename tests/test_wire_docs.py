"""docs/wire-format.md is a contract a client is written from (issue 30).

Every JSON example it shows (and the other pages that show wire messages) is
valid against the JSON Schema ``renqueue schema`` prints; every event kind
(the ``Event`` union's tags) has its row in the events table, which renders as
one table; every ``error_type`` the services can write
(``renqueue.schema.ERROR_TYPES``, the ``ErrorType`` the event constructors
take) is listed, and so is every request error's code; the request's field
table says what the schema says of each field; nats/README.md's tenant table
grants what nats/auth.conf grants. Nothing here is a hand list: each side is
read from the code or the file it must agree with.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest

from renqueue import errors
from renqueue.schema import ERROR_TYPES, SCHEMA_VERSION, TERMINAL_KINDS, ErrorType, Event

ROOT = Path(__file__).parents[1]
WIRE = ROOT / "docs" / "wire-format.md"
#: The pages that show wire messages as JSON examples.
PAGES = (WIRE, ROOT / "docs" / "ab-testing.md")
#: A JSON example that is not one of Ren-Queue's messages: the body of a NATS
#: API request (its schema is the server's), recognised by this key.
NATS_API = "stream_name"
#: Request errors that never reach the log: a client-side check only.
CLIENT_SIDE = {errors.UnknownPriorityError}
#: Their bases, never raised as they are.
BASES = {errors.InvalidRequestError, errors.BackendError}


@cache
def schema_defs() -> dict[str, Any]:
    """``renqueue schema``, as a user runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "renqueue", "schema"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    defs: dict[str, Any] = json.loads(out.stdout)["$defs"]
    return defs


def validator(name: str) -> jsonschema.protocols.Validator:
    schema = {"$defs": schema_defs(), "$ref": f"#/$defs/{name}"}
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def event_kinds() -> dict[str, str]:
    """The ``Event`` union: kind (its tag) -> the struct's name."""
    return {member.__struct_config__.tag: member.__name__ for member in get_args(Event)}


def json_examples(page: Path) -> list[tuple[int, Any]]:
    """Every JSON value in the page's ```json blocks, with the block's line: a
    block may hold one value over several lines, or one per line."""
    found: list[tuple[int, Any]] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() == "```json":
            start = index + 1
            end = next(i for i in range(start, len(lines)) if lines[i].strip() == "```")
            text = "\n".join(lines[start:end])
            decoder, at = json.JSONDecoder(), 0
            while text[at:].strip():
                at += len(text[at:]) - len(text[at:].lstrip())
                value, at = decoder.raw_decode(text, at)
                found.append((start + 1, value))
            index = end
        index += 1
    return found


def message_type(value: Any) -> str | None:
    """Which of Ren-Queue's messages an example is (``None``: a NATS API body)."""
    if isinstance(value, dict):
        if NATS_API in value:
            return None
        if "kind" in value:
            return event_kinds()[value["kind"]]
        if "route" in value and "messages" in value:
            return "InferenceRequest"
        if "request_id" in value and "seq" in value:
            return "TokenChunk"
    if isinstance(value, list):
        return "ChatMessage"  # a request's `messages`
    raise AssertionError(f"an example of no known message: {str(value)[:200]}")


EXAMPLES = [
    pytest.param(value, id=f"{page.name}:{line}")
    for page in PAGES
    for line, value in json_examples(page)
]


def test_the_pages_show_examples_of_each_kind_of_message() -> None:
    shown = {message_type(param.values[0]) for param in EXAMPLES}
    assert {"InferenceRequest", "TokenChunk", "ChatMessage", "CancelRequested", "SplitChanged"} <= (
        shown
    )


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_json_example_is_valid_against_renqueue_schema(example: Any) -> None:
    name = message_type(example)
    if name is None:
        return  # NATS's own API: not ours to check
    values = example if name == "ChatMessage" else [example]
    for value in values:
        problems = [e.message for e in validator(name).iter_errors(value)]
        assert problems == [], f"{name}: {problems}"
        if "v" in value:
            assert value["v"] == SCHEMA_VERSION, f"an example of {name} at an old version"


def table_after(page: Path, header: str) -> tuple[list[str], list[str]]:
    """The rows of the table whose header line starts with ``header``, as they
    render (up to the first line that is not a row), and the page's lines after."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    assert lines[start + 1].startswith("|---"), header
    rows: list[str] = []
    for index in range(start + 2, len(lines)):
        if not lines[index].startswith("|"):
            return rows, lines[index:]
        rows.append(lines[index])
    return rows, []


def first_cell(row: str) -> str:
    return row.split("|")[1].strip().strip("`")


def test_every_event_kind_has_a_row_in_the_one_events_table() -> None:
    """The ``rejected``, ``expired`` and ``cancelled`` rows came after two
    paragraphs, and rendered as text."""
    rows, after = table_after(WIRE, "| kind | terminal | extra fields |")
    kinds = {first_cell(row): row.split("|")[2].strip() for row in rows}
    assert sorted(kinds) == sorted(event_kinds())
    assert {kind for kind, terminal in kinds.items() if terminal == "yes"} == TERMINAL_KINDS
    strays = [line for line in after if re.match(r"\| `(\w+)` \|", line)]
    assert not [s for s in strays if first_cell(s) in event_kinds()], strays


def error_codes(base: type[errors.RenQueueError]) -> set[str]:
    """The codes of ``base``'s subclasses that the services raise."""
    found: set[str] = set()
    pending = [base]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls not in BASES | CLIENT_SIDE:
            found.add(cls.code)
    return found


def test_every_request_and_backend_error_code_is_an_error_type() -> None:
    assert error_codes(errors.InvalidRequestError) <= ERROR_TYPES
    assert error_codes(errors.BackendError) <= ERROR_TYPES
    assert set(get_args(ErrorType)) == ERROR_TYPES


def section(page: Path, start: str, end: str) -> str:
    text = page.read_text()
    begin = text.index(start)
    return text[begin : text.index(end, begin)]


def test_every_error_type_is_listed_on_the_wire_page() -> None:
    listed = section(WIRE, "`error_type` values", "`error_class` (on")
    assert sorted(t for t in ERROR_TYPES if f"`{t}`" not in listed) == []


def test_every_rejection_has_its_case_in_the_rejections_table() -> None:
    rows, _ = table_after(WIRE, "| case | `error_type` |")
    given = {row.split("|")[2].strip().strip("`") for row in rows}
    # And the forwarder's: a request sent without its route whose route's
    # subject is full (binding split in groups).
    forwarder = {errors.TenantBacklogFullError.code}
    assert given == error_codes(errors.InvalidRequestError) | forwarder


def test_every_rejection_is_named_on_the_dead_letters_page() -> None:
    rows, _ = table_after(ROOT / "docs" / "dead-letters.md", "| subject | written by | when |")
    [router] = [
        r for r in rows if r.startswith("| `rq.dlq.requests` | the router | a request it rej")
    ]
    missing = [c for c in error_codes(errors.InvalidRequestError) if f"`{c}`" not in router]
    assert sorted(missing) == []


def test_the_request_table_says_what_the_schema_says() -> None:
    """The page marked ``tenant`` and ``priority`` required, while the schema
    gives them defaults (the subject is the authority for both)."""
    request = schema_defs()["InferenceRequest"]
    rows, _ = table_after(WIRE, "| field | type | meaning |")
    fields = {first_cell(row): row.split("|")[2] for row in rows}
    assert sorted(fields) == sorted(request["properties"])
    required = {name for name, kind in fields.items() if "required" in kind}
    assert required == set(request["required"])
    for name in ("tenant", "priority"):
        default = json.dumps(request["properties"][name]["default"])
        assert f"`{default}`" in fields[name], name


def auth_grants(user: str) -> dict[str, set[str]]:
    """What nats/auth.conf allows ``user`` to publish and subscribe to."""
    text = (ROOT / "nats" / "auth.conf").read_text()
    block = text[text.index(f"user: {user}\n") :]
    grants: dict[str, set[str]] = {}
    for verb in ("publish", "subscribe"):
        body = block[block.index(f"{verb}: {{") :]
        allowed = body[body.index("allow: [") : body.index("]")]
        allowed = "\n".join(line.split("#")[0] for line in allowed.splitlines())
        grants[verb] = set(re.findall(r'"([^"]+)"', allowed))
    return grants


def test_the_tenant_permission_table_grants_what_auth_conf_grants() -> None:
    """The table had no row for the cancel permission auth.conf grants."""
    rows, _ = table_after(ROOT / "nats" / "README.md", "| what the client does | permission")
    listed: dict[str, set[str]] = {"publish": set(), "subscribe": set()}
    for row in rows:
        cell = row.split("|")[2].strip()
        verb = cell.split()[0]
        listed[verb] |= set(re.findall(r"`([^`]+)`", cell))
    assert listed == auth_grants("acme")


def test_the_dead_letters_duplicate_window_is_what_the_docs_say() -> None:
    """The DLQ copy's ``Nats-Msg-Id`` is deduplicated within RQ_DLQ's own
    window (the stream definition's; ``nats.duplicate_window`` does not apply)."""
    window = json.loads((ROOT / "streams" / "dlq.json").read_text())["duplicate_window"]
    assert window == 120 * 10**9  # nanoseconds
    assert "duplicate window of 2 minutes" in " ".join(WIRE.read_text().split())
    assert "2-minute duplicate window" in (ROOT / "docs" / "dead-letters.md").read_text()
