"""Line splitting (UTF-8 across reads, \r progress bars), tagging, logs, tails."""

import io

from ddlrun.output import LineSplitter, OutputSink, log_paths


def test_splitter_handles_split_utf8_cr_and_crlf():
    s = LineSplitter()
    data = "héllo\nbar 10%\rbar 20%\rok\r\nend".encode()
    out = []
    for i in range(len(data)):  # one byte at a time
        out += s.feed(data[i:i + 1])
    out += s.flush()
    assert out == ["héllo\n", "bar 10%\r", "bar 20%\r", "ok\r\n", "end"]
    assert LineSplitter().feed(b"\xff\n") == ["\ufffd\n"]


def test_sink_tags_lines_writes_logs_and_keeps_tail(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    logs = log_paths(str(tmp_path), "job1", [0, 1])
    sink = OutputSink(tag=True, logs=logs, stdout=out, stderr=err, tail_lines=2)
    sink.line(0, "stdout", "a\n")
    sink.line(1, "stderr", "b")
    sink.line(0, "stdout", "50%\r")
    sink.line(0, "stdout", "c\n")
    sink.close()
    assert out.getvalue() == "[0] a\n[0] 50%\r[0] c\n"
    assert err.getvalue() == "[1] b\n"
    assert sink.tail(0) == ["50%", "c"]
    assert (tmp_path / "job1" / "rank.0.out").read_bytes() == b"a\n50%\rc\n"
    assert (tmp_path / "job1" / "rank.1.err").read_text() == "b"  # as the rank wrote it
    assert log_paths(None, "j", [0]) == {}
    plain = io.StringIO()
    OutputSink(tag=False, stdout=plain).line(3, "stdout", "x\n")
    assert plain.getvalue() == "x\n"


def split_all(data: bytes, max_line, step: int) -> list[str]:
    s = LineSplitter(max_line)
    out = []
    for i in range(0, len(data), step):
        out += s.feed(data[i:i + step])
    return out + s.flush()


def test_splitter_matches_splitlines_for_any_read_size():
    text = "a\nbb\r\n\r\rccc\r" + "é" * 5 + "\n\n" + "x\r" * 3 + "tail"
    for step in (1, 2, 3, 7, 64):
        assert split_all(text.encode(), None, step) == text.splitlines(keepends=True), step


def test_splitter_cuts_long_lines_into_pieces_and_keeps_every_character():
    text = "0123456789" * 10 + "\n" + "é" * 25 + "\r\nend"
    for step in (1, 5, 1000):
        got = split_all(text.encode(), 16, step)
        assert "".join(got) == text  # nothing lost, nothing added, UTF-8 intact
        assert all(len(p.rstrip("\r\n")) <= 16 for p in got)
        assert got[:2] == ["0123456789012345", "6789012345678901"]
        assert "é" * 16 in got and "é" * 9 + "\r\n" in got and got[-1] == "end"


def test_splitter_is_linear_on_a_huge_unterminated_line():
    # 64 MiB without a newline took minutes when every read rescanned the whole buffer
    import time

    s = LineSplitter()
    chunk = b"y" * 65536
    t0 = time.perf_counter()
    total = sum(len(p) for _ in range(1024) for p in s.feed(chunk))
    total += sum(len(p) for p in s.flush())
    assert total == 64 * 2**20
    assert time.perf_counter() - t0 < 5


def test_long_pieces_are_tagged_on_the_terminal_and_exact_in_the_log(tmp_path):
    out = io.StringIO()
    sink = OutputSink(tag=True, logs=log_paths(str(tmp_path), "j", [0]), stdout=out,
                      stderr=io.StringIO())
    for piece in split_all(b"a" * 10 + b"\n", 4, 3):
        sink.line(0, "stdout", piece)
    sink.close()
    assert out.getvalue() == "[0] aaaa\n[0] aaaa\n[0] aa\n"
    assert (tmp_path / "j" / "rank.0.out").read_text() == "a" * 10 + "\n"
    huge = OutputSink(stdout=io.StringIO(), stderr=io.StringIO())
    huge.line(0, "stdout", "z" * 65536)
    (shown,) = huge.tail(0)
    assert len(shown) < 1100 and shown.endswith("(64536 more characters)")
