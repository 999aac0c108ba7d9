"""Line splitting (UTF-8 across reads, \r progress bars), tagging, logs, tails; the
terminal copy (one live line on a TTY, collapsed updates elsewhere), --output-ranks and
TensorFlow's banners once per job."""

import argparse
import io

import pytest

from ddlrun.output import (
    ERASE,
    LineSplitter,
    OutputSink,
    banner_key,
    fit,
    log_paths,
    overwrite,
    parse_ranks,
    strip_ansi,
    tagged_rank,
)


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
    assert out.getvalue() == "[0] a\n[0] c0%\n"  # not a TTY: what the line ends up showing
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


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def screen(written: str) -> list[str]:
    """The rows a terminal shows after ``written``: \\r, \\n, \\b and ESC[K as a VT100 does
    (colours ignored), so a fragment left behind shows up as text."""
    rows, col = [[]], 0
    i = 0
    while i < len(written):
        ch, row = written[i], rows[-1]
        if written.startswith("\x1b[K", i):
            del row[col:]
            i += 3
            continue
        if ch == "\x1b":
            i = written.index("m", i) + 1
            continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            rows.append([])
            col = 0
        elif ch == "\b":
            col = max(0, col - 1)
        else:
            row[col:col + 1] = [ch]
            col += 1
        i += 1
    return ["".join(r) for r in rows]


def keras_bar(steps: int) -> bytes:
    """What Keras 3's Progbar(verbose=1) writes: \\b over the last bar, \\r, a coloured bar,
    padding, and a newline after the last."""
    out, prev = "", 0
    for step in range(1, steps + 1):
        bar = f"\x1b[1m{step}/{steps}\x1b[0m \x1b[32m{'━' * step}\x1b[0m - loss: {1 / step:.4f}"
        width = len(strip_ansi(bar))
        out += "\b" * prev + "\r" + bar + " " * max(0, prev - width)
        prev = width
    return (out + "\n").encode()


def test_overwrite_renders_like_a_terminal():
    assert overwrite("", "plain") == "plain"
    assert overwrite("", "bar\b\b\b") == "bar"  # Keras backs over its bar: nothing erased
    assert overwrite("12345", "ab") == "ab345"
    assert overwrite("", "abc\b\bX") == "aXc"
    assert overwrite("", "x\ry") == "y"
    assert overwrite("", "\x1b[1m1/2\x1b[0m\b\b\b") == "1/2"
    assert overwrite("", "\x1b[1m1/2\x1b[0m\b\b\b", keep_ansi=True) == "\x1b[1m1/2\x1b[0m"
    assert strip_ansi("\x1b[1m1\x1b[0m \x1b]0;title\x07x\x1b[2K") == "1 x"
    assert fit("abcdef", 3) == "abc" and fit("abc", 0) == "abc"
    assert fit("\x1b[1mabcdef\x1b[0m", 4) == "\x1b[1mabcd\x1b[0m"


def test_not_a_tty_collapses_updates_and_strips_escapes():
    out = io.StringIO()
    sink = OutputSink(stdout=out, stderr=io.StringIO(), tty=False)
    feed(sink, 0, b"Epoch 1/1\n" + keras_bar(5))
    feed(sink, 1, b"\x1b[31mred\x1b[0m line\n")
    feed(sink, 1, b"10%\r20%\r30%\rdone\n")
    feed(sink, 0, b"never ended 1\rnever ended 2\r")
    sink.close()
    got = out.getvalue()
    assert not any(c in got for c in "\r\b\x1b"), repr(got)
    assert got.splitlines() == [
        "[0] Epoch 1/1",
        f"[0] 5/5 {'━' * 5} - loss: 0.2000",
        "[1] red line",
        "[1] done",
        "[0] never ended 2",  # held until the job's output ends
    ]


def feed(sink: OutputSink, rank: int, data: bytes, step: int = 7) -> None:
    split = LineSplitter()
    for i in range(0, len(data), step):
        for piece in split.feed(data[i:i + step]):
            sink.line(rank, "stdout", piece)
    for piece in split.flush():
        sink.line(rank, "stdout", piece)


def test_tty_keeps_one_live_line_and_writes_other_ranks_above_it():
    out = FakeTTY()
    sink = OutputSink(stdout=out, stderr=out, tty=True)
    sink.line(0, "stdout", "10%\r")
    sink.line(1, "stdout", "rank 1 says hello\n")
    sink.line(0, "stdout", "20%\r")
    sink.note("a launcher note")
    sink.line(1, "stderr", "a warning\n")
    sink.line(0, "stdout", "\b\b\b\b\b\b\b30% done\n")
    sink.close()
    assert out.getvalue().startswith(f"{ERASE}[0] 10%{ERASE}[1] rank 1 says hello\n[0] 10%")
    assert screen(out.getvalue()) == [
        "[1] rank 1 says hello",
        "ddlrun: a launcher note",
        "[1] a warning",
        "[0] 30% done",
        "",
    ]


def test_tty_keras_bar_between_other_ranks_lines_leaves_no_fragment():
    out = FakeTTY()
    sink = OutputSink(stdout=out, stderr=out, tty=True)
    bar = keras_bar(6)
    split = LineSplitter()
    for i in range(0, len(bar), 11):
        for piece in split.feed(bar[i:i + 11]):
            sink.line(0, "stdout", piece)
            sink.line(1, "stdout", "rank 1 line\n")
    sink.close()
    rows = screen(out.getvalue())
    assert rows[-1] == ""
    assert [r for r in rows if "[0]" in r] == [f"[0] 6/6 {'━' * 6} - loss: 0.1667"], rows
    assert {r for r in rows[:-1] if "[0]" not in r} == {"[1] rank 1 line"}, rows
    assert "\x1b[32m" in out.getvalue()  # a terminal keeps the colours


def test_tty_and_pipe_show_the_same_final_states():
    pieces = ["12345\r", "ab\r", "\n", "bar\r", "\r", "x\n", "\x1b[1mbold\x1b[0m\n"]
    tty, pipe = FakeTTY(), io.StringIO()
    for stream, is_tty in ((tty, True), (pipe, False)):
        sink = OutputSink(stdout=stream, stderr=stream, tty=is_tty)
        for piece in pieces:
            sink.line(0, "stdout", piece)
        sink.close()
    assert pipe.getvalue() == "[0] ab345\n[0] xar\n[0] bold\n"  # as one terminal shows
    assert screen(tty.getvalue()) == [*pipe.getvalue().splitlines(), ""]


def test_tty_live_line_ends_at_close_and_without_a_tty_stderr_is_plain():
    out, err = FakeTTY(), io.StringIO()
    sink = OutputSink(stdout=out, stderr=err)  # asks each stream: one is a TTY
    sink.line(0, "stdout", "50%\r")
    sink.note("note")
    sink.close()
    assert screen(out.getvalue()) == ["[0] 50%", ""] and err.getvalue() == "ddlrun: note\n"


def test_output_ranks_hide_other_ranks_from_the_terminal_only(tmp_path):
    out = io.StringIO()
    sink = OutputSink(logs=log_paths(str(tmp_path), "j", [0, 1]), stdout=out,
                      stderr=out, ranks=frozenset({0}))
    sink.line(0, "stdout", "zero\n")
    sink.line(1, "stdout", "one\n")
    sink.line(1, "stderr", "Traceback: boom\n")
    sink.raw("stdout", "[1,0]<stdout>:mpirun zero\n")
    sink.raw("stdout", "[1,1]<stdout>:mpirun one\n")
    sink.raw("stdout", " 1: srun one\n")
    sink.raw("stdout", "mpirun's own message\n")
    sink.note("rank 1 failed")  # launcher notes (the failure report) always show
    sink.close()
    assert out.getvalue() == ("[0] zero\n[1,0]<stdout>:mpirun zero\nmpirun's own message\n"
                              "ddlrun: rank 1 failed\n")
    assert sink.tail(1) == ["one", "Traceback: boom"]  # what a failure report quotes
    assert (tmp_path / "j" / "rank.1.out").read_text() == "one\n"


def test_parse_ranks_and_tags():
    assert parse_ranks("0") == {0}
    assert parse_ranks("0,2-3") == {0, 2, 3}
    assert parse_ranks(" 1 , 4-4") == {1, 4}
    for bad in ("", "a", "1-", "3-1", "-1", "0,,1", "0-99999999999"):
        with pytest.raises(argparse.ArgumentTypeError, match="such as '0' or '0,2-3'"):
            parse_ranks(bad)
    assert tagged_rank("[1,3]<stderr>:x") == (3, "x")
    assert tagged_rank("12: x") == (12, "x")
    assert tagged_rank("plain") == (None, "plain")


ONEDNN = ("oneDNN custom operations are on. You may see slightly different numerical results "
          "due to floating-point round-off errors from different computation orders. To turn "
          "them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.")
TF_BANNER = [  # TF 2.21's import on a CPU host, as one process prints it (pid, time vary)
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    f"I0000 00:00:1796307417.030183    {{pid}} port.cc:153] {ONEDNN}",
    "I0000 00:00:1796307417.116372    {pid} cpu_feature_guard.cc:227] This TensorFlow binary "
    "is optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
    "with the appropriate compiler flags.",
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    f"I0000 00:00:1796307421.113376    {{pid}} port.cc:153] {ONEDNN}",
]


def test_tensorflow_banners_once_per_job():
    err = io.StringIO()
    sink = OutputSink(stdout=io.StringIO(), stderr=err)
    for rank in (0, 1, 2):
        for line in TF_BANNER:
            sink.line(rank, "stderr", line.format(pid=100 + rank) + "\n")
        sink.line(rank, "stderr", "W0000 00:00:1.2 7 some_op.cc:1] a real warning\n")
    lines = err.getvalue().splitlines()
    assert len(lines) == 4 + 3, lines  # 4 distinct banners, then every rank's warning
    assert sum("oneDNN" in ln for ln in lines) == 1
    assert banner_key("2024-01-01 10:00:00.1: I tensorflow/core/util/port.cc:113] " + ONEDNN)
    assert banner_key("oneDNN is great") is None and banner_key("print('hello')") is None


PROGRESS = r"""
import os, sys, time
rank = int(os.environ["RANK"])
prev = 0
for epoch in (1, 2, 3):
    for step in range(1, 6):
        bar = f"\x1b[1mrank {rank} epoch {epoch} {step}/5\x1b[0m " + "=" * (8 * step)
        width = len(bar) - 8
        end = "\n" if step == 5 else ""
        sys.stdout.write("\b" * prev + "\r" + bar + " " * max(0, prev - width) + end)
        sys.stdout.flush()
        prev = 0 if end else width
        time.sleep(0.01)
    print(f"r{rank} e{epoch}", flush=True)  # shorter than the bar: no fragment of it
if rank == int(sys.argv[1]):
    sys.exit(f"rank {rank} fails on purpose")
"""


def final_states(rank: int) -> list[str]:
    """What rank ``rank`` of PROGRESS leaves on screen (Keras-like: a bar per epoch)."""
    return [ln for e in (1, 2, 3)
            for ln in (f"[{rank}] rank {rank} epoch {e} 5/5 " + "=" * 40, f"[{rank}] r{rank} e{e}")]


def test_two_real_ranks_output_captured_has_no_fragments():
    from ddlrun_testlib import PY, run_ddlrun

    res = run_ddlrun("-n", "2", PY, "-c", PROGRESS, "-1")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert not any(c in res.stdout for c in "\r\b\x1b"), repr(res.stdout[:300])
    for rank in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[{rank}] ")]
        assert mine == final_states(rank)  # every update collapsed to its final state
    assert len(lines) == 12, lines  # and no line holds a fragment of another's


def test_output_ranks_show_rank_0_and_still_report_a_failing_rank_1():
    from ddlrun_testlib import PY, run_ddlrun

    res = run_ddlrun("-n", "2", "--output-ranks", "0", PY, "-c", PROGRESS, "1")
    assert res.returncode == 1
    assert res.stdout.splitlines() == final_states(0) and "[1]" not in res.stderr
    assert "rank 1" in res.stderr and "fails on purpose" in res.stderr  # the report
    bad = run_ddlrun("-n", "2", "--local-ranks-filter", "x", PY, "-c", "pass")
    assert bad.returncode == 2 and "--output-ranks" in bad.stderr and "got 'x'" in bad.stderr


def test_two_real_ranks_on_a_terminal_keep_one_live_line():
    import os
    import pty
    import subprocess

    from ddlrun_testlib import PY, ddlrun_argv

    main, sub = pty.openpty()
    proc = subprocess.Popen(ddlrun_argv("-n", "2", PY, "-c", PROGRESS, "-1"), stdin=sub,
                            stdout=sub, stderr=sub, env={**os.environ, "TERM": "xterm"})
    os.close(sub)
    data = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        data += chunk
    os.close(main)
    assert proc.wait(timeout=60) == 0
    rows = [r for r in screen(data.decode().replace("\r\n", "\n")) if r]
    assert "\x1b[1m" in data.decode()  # a terminal keeps the colours
    assert sorted(rows) == sorted(final_states(0) + final_states(1)), rows


def test_tagged_ranks_keep_their_own_progress_line():
    """Under mpirun/srun (lines already tagged) one rank's "\\r" progress and another
    rank's line stay apart; the piece after a tagged "\\r" is still that rank's."""
    out, err = io.StringIO(), io.StringIO()
    sink = OutputSink(tag=False, stdout=out, stderr=err, tty=False, ranks=frozenset({0}))
    sink.raw("stdout", "[1,0]<stdout>: epoch 1  45% |#####     |\r")
    sink.raw("stdout", "[1,1]<stdout>: hi\n")
    sink.raw("stdout", "[1,0]<stdout>: epoch 1  90% |######### |\r")
    sink.raw("stdout", " done\n")
    # rank 1 is not chosen; rank 0's line in its final state, as a terminal shows it (the
    # untagged " done" written over the line's start after its "\r")
    assert out.getvalue() == " done<stdout>: epoch 1  90% |######### |\n", out.getvalue()
