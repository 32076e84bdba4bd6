import io
import re

from freetoken.cli.progress import Progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_plain_output_prints_each_status_once_and_bars_when_done():
    out = io.StringIO()
    clock = Clock()
    p = Progress(out, tty=False, clock=clock)
    p.event({"status": "pulling manifest"})
    p.event({"status": "pulling manifest"})
    for done in (0, 500_000_000, 1_000_000_000):
        clock.t += 1
        p.event(
            {
                "status": "pulling 0123456789ab",
                "digest": "sha256:0123",
                "total": 1_000_000_000,
                "completed": done,
            }
        )
    p.event({"status": "success"})
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "pulling manifest"
    assert lines[1].startswith("pulling 0123456789ab: 100% ▕") and lines[1].endswith("▏ 1 GB")
    assert lines[2] == "success"
    assert len(lines) == 3


def test_unfinished_bar_is_printed_on_close():
    out = io.StringIO()
    p = Progress(out, tty=False, clock=Clock())
    p.bar("d", "pushing abc", 10, 100)
    assert out.getvalue() == ""
    p.close()
    assert "pushing abc:  10%" in out.getvalue()


def test_bar_shows_speed_and_eta():
    clock = Clock()
    p = Progress(io.StringIO(), tty=False, clock=clock)
    p.bar("d", "pulling x", 0, 100_000_000)
    clock.t = 2.0
    p.bar("d", "pulling x", 20_000_000, 100_000_000)
    line = p._lines["d"].render(120)
    assert "20 MB/100 MB" in line
    assert "10 MB/s" in line
    assert line.endswith("8s")


def test_percent_only_lines_for_create():
    out = io.StringIO()
    p = Progress(out, tty=False, clock=Clock())
    p.bar("sha256:ab", "copying file sha256:ab", 5, 5, percent_only=True)
    assert out.getvalue() == "copying file sha256:ab 100%\n"


def test_terminal_output_redraws_in_place():
    out = io.StringIO()
    clock = Clock()
    p = Progress(out, tty=True, clock=clock)
    p.status("pulling manifest")
    clock.t += 1
    p.bar("a", "pulling a", 1, 2)
    clock.t += 1
    p.bar("b", "pulling b", 1, 2)
    clock.t += 1
    p.bar("a", "pulling a", 2, 2)
    text = out.getvalue()
    # The finished status line is drawn once; the unfinished bars are redrawn in place.
    assert text.count("pulling manifest") == 1
    assert text.count("\x1b[2Kpulling a:") == 3
    assert "\x1b[1F" in text and "\x1b[2F" in text


def test_terminal_redraw_leaves_finished_lines_alone():
    out = io.StringIO()
    clock = Clock()
    p = Progress(out, tty=True, clock=clock)
    for i in range(50):
        p.status(f"step {i}")
    clock.t += 1
    p.bar("a", "pulling a", 1, 2)
    clock.t += 1
    p.bar("a", "pulling a", 2, 2)
    clock.t += 1
    p.status("success")
    # Never moves up more than the one live line, however many lines were printed.
    assert set(re.findall(r"\x1b\[(\d+)F", out.getvalue())) == {"1"}


def test_percent_line_keeps_its_percentage_on_a_narrow_terminal():
    p = Progress(io.StringIO(), tty=True, clock=Clock())
    p.bar("d", "copying file sha256:" + "a" * 64, 1, 2, percent_only=True)
    line = p._lines["d"].render(40)
    assert line.endswith("… 50%") and len(line) == 39
