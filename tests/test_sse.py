"""The event-stream parser (renqueue.backends._sse), fed hostile input piece by piece."""

from __future__ import annotations

import pytest

from renqueue.backends._sse import MAX_EVENT_BYTES, ServerSentEvent, SSEDecoder, SSEError


def parse(*pieces: bytes, **options: int) -> tuple[list[ServerSentEvent], ServerSentEvent | None]:
    """Every dispatched event of a body read as ``pieces``, and what ``finish`` returns."""
    decoder = SSEDecoder(**options)
    events = [event for piece in pieces for event in decoder.feed(piece)]
    return events, decoder.finish()


def datas(*pieces: bytes) -> list[str]:
    events, _ = parse(*pieces)
    return [event.data for event in events]


# A body that exercises every rule at once (BOM, all three line endings, a
# comment, event/id/retry, multi-line data, a data-less block, UTF-8).
RICH = (
    b"\xef\xbb\xbf: keep-alive\r\n"
    b"event: delta\rid: 7\rretry: 1500\r"
    b"data: first\r\ndata:second\r\n\r\n"
    b"id: 8\n\n"
    b"event: ignored\n\n"
    b"data: caf\xc3\xa9 \xe2\x82\xac\n"
    b"data\n\n"
    b"data: [DONE]\n\n"
)
RICH_EVENTS = [
    ServerSentEvent(event="delta", data="first\nsecond", id="7", retry=1500),
    ServerSentEvent(data="café €\n", id="8", retry=1500),
    ServerSentEvent(data="[DONE]", id="8", retry=1500),
]


def test_fields_comments_and_every_line_ending_in_one_read() -> None:
    assert parse(RICH) == (RICH_EVENTS, None)


def test_the_same_body_split_at_every_byte_boundary_parses_the_same() -> None:
    for cut in range(1, len(RICH)):
        assert parse(RICH[:cut], RICH[cut:]) == (RICH_EVENTS, None), f"split at byte {cut}"


def test_the_same_body_one_byte_per_read_parses_the_same() -> None:
    assert parse(*(RICH[i : i + 1] for i in range(len(RICH)))) == (RICH_EVENTS, None)


def test_a_read_returns_the_events_it_completes_and_no_more() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\ndata: b\n\ndata: c") == [
        ServerSentEvent(data="a"),
        ServerSentEvent(data="b"),
    ]
    assert decoder.feed(b"\n") == []  # "c" has its line, not yet its blank line
    assert decoder.feed(b"\n") == [ServerSentEvent(data="c")]


@pytest.mark.parametrize("ending", [b"\n", b"\r", b"\r\n"])
def test_each_line_ending_alone(ending: bytes) -> None:
    body = ending.join([b"data: a", b"data: b", b"", b"data: c", b"", b""])
    assert datas(body) == ["a\nb", "c"]


def test_a_crlf_split_between_reads_is_one_line_ending() -> None:
    # Were the CR and the LF taken as two endings, "a" would be dispatched alone.
    assert datas(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n") == ["a\nb"]
    # CR CR is two endings: a blank line that dispatches.
    assert datas(b"data: a\r", b"\r") == ["a"]


def test_a_lone_lf_after_a_cr_read_is_consumed_and_nothing_else() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n") == []  # the rest of the CRLF, not a blank line
    assert decoder.feed(b"\n") == [ServerSentEvent(data="a")]


def test_field_value_spacing_and_lines_without_a_colon() -> None:
    assert datas(b"data:x\ndata: y\ndata:  z\ndata\ndata:\n\n") == ["x\ny\n z\n\n"]


def test_events_without_data_are_not_dispatched_and_their_type_is_reset() -> None:
    events, _ = parse(b"event: ping\n\nid: 3\n\ndata: x\n\n")
    assert events == [ServerSentEvent(event="message", data="x", id="3")]


def test_unknown_fields_and_comments_are_ignored() -> None:
    assert datas(b": hi\n:\nfoo: bar\nDATA: no\n data: no\ndata: yes\n\n") == ["yes"]


def test_id_with_nul_is_ignored_and_the_last_id_persists() -> None:
    decoder = SSEDecoder()
    events = decoder.feed(b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\ndata: c\n\nid\ndata: d\n\n")
    assert [(event.data, event.id) for event in events] == [
        ("a", "1"),
        ("b", "1"),
        ("c", "1"),
        ("d", ""),
    ]
    assert decoder.last_event_id == ""


def test_retry_takes_ascii_digits_only() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"retry: 250\n")
    for bad in (
        b"retry: 1.5\n",
        b"retry: -3\n",
        b"retry: 12a\n",
        b"retry:\n",
        "retry: ٣\n".encode(),
    ):
        decoder.feed(bad)
    assert decoder.retry == 250


def test_a_last_event_without_its_blank_line_is_not_dispatched_but_handed_to_finish() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\nevent: end\ndata: [DO") == [ServerSentEvent(data="a")]
    assert decoder.feed(b"NE]") == []
    # Its last line has no line ending either: finish parses it all the same.
    assert decoder.finish() == ServerSentEvent(event="end", data="[DONE]")
    assert decoder.finish() is None  # nothing left


def test_finish_returns_none_for_a_cleanly_ended_body() -> None:
    assert parse(b"data: a\n\n") == ([ServerSentEvent(data="a")], None)
    assert parse(b"data: a\n\nevent: x\n") == ([ServerSentEvent(data="a")], None)
    assert parse(b"") == ([], None)


def test_invalid_utf8_becomes_replacement_characters() -> None:
    assert datas(b"data: a\xff\xfeb\xe2\x82\n\n") == ["a\ufffd\ufffdb\ufffd"]
    # An invalid byte in a field name makes it unknown, not an error.
    assert datas(b"da\xffta: x\ndata: y\n\n") == ["y"]


def test_a_multibyte_character_split_between_reads_stays_whole() -> None:
    body = "data: 日本語 🚀\n\n".encode()
    for cut in range(1, len(body)):
        assert datas(body[:cut], body[cut:]) == ["日本語 🚀"], f"split at byte {cut}"


def test_only_one_leading_bom_is_dropped() -> None:
    bom = b"\xef\xbb\xbf"
    assert datas(bom + b"data: a\n\n") == ["a"]
    assert datas(bom[:1], bom[1:2], bom[2:] + b"data: a\n\n") == ["a"]
    # A second BOM is part of the first line's field name: an unknown field.
    assert datas(bom + bom + b"data: a\n\ndata: b\n\n") == ["b"]
    # Not at the start: part of the value.
    assert datas(b"data: a" + bom + b"\n\n") == ["a\ufeff"]


def test_a_line_at_the_bound_passes_and_one_byte_more_raises() -> None:
    limit = 64
    line = b"data: " + b"x" * (limit - 6)
    assert datas_limited(line + b"\n\n", limit=limit) == ["x" * (limit - 6)]
    with pytest.raises(SSEError, match="line longer than 64 bytes"):
        datas_limited(line + b"x\n\n", limit=limit)


def test_a_long_line_arriving_in_many_reads_raises_once_past_the_bound() -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    decoder.feed(b"data: ")
    for _ in range(9):
        decoder.feed(b"x" * 10)  # 96 bytes held, no line ending yet
    with pytest.raises(SSEError, match="line longer"):
        decoder.feed(b"x" * 10)


def test_a_comment_is_bounded_too() -> None:
    with pytest.raises(SSEError):
        datas_limited(b":" + b"k" * 100 + b"\n", limit=64)


def test_an_event_of_many_small_data_lines_is_bounded() -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    with pytest.raises(SSEError, match="event larger than 100 bytes"):
        decoder.feed(b"data: 0123456789\n" * 10)  # never a blank line
    # Dispatched events do not add up: the bound is per event.
    ok = SSEDecoder(max_event_bytes=100)
    events = ok.feed(b"data: 0123456789\n\n" * 50)
    assert len(events) == 50


def test_the_default_bound_is_4_mib_and_a_real_long_answer_fits() -> None:
    assert MAX_EVENT_BYTES == 4 * 1024 * 1024
    answer = b"y" * (1024 * 1024)  # ~250k tokens of text in a single event
    pieces = [b"data: ", *(answer[i : i + 65536] for i in range(0, len(answer), 65536)), b"\n\n"]
    assert datas(*pieces) == [answer.decode()]


def test_finish_resets_for_a_new_stream_but_keeps_the_last_id() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"\xef\xbb\xbfid: 5\ndata: partial")
    assert decoder.finish() == ServerSentEvent(data="partial", id="5")
    # A new body: its BOM is dropped again, its events see the old id.
    assert decoder.feed(b"\xef\xbb\xbfdata: next\n\n") == [ServerSentEvent(data="next", id="5")]


def datas_limited(body: bytes, *, limit: int) -> list[str]:
    events, _ = parse(body, max_event_bytes=limit)
    return [event.data for event in events]
