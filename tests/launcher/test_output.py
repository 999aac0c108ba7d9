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
    assert (tmp_path / "job1" / "rank.1.err").read_text() == "b\n"
    assert log_paths(None, "j", [0]) == {}
    plain = io.StringIO()
    OutputSink(tag=False, stdout=plain).line(3, "stdout", "x\n")
    assert plain.getvalue() == "x\n"
