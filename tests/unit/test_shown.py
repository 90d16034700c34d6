"""What reaches the terminal: control characters from folders are escaped in every verb's output."""

from __future__ import annotations

import io
import sys

from hypothesis import given
from hypothesis import strategies as st

from automodel_ckpt.cli import main as cli_main
from automodel_ckpt.shown import EscapingStream, escaped

TITLE = "\x1b]0;pwned\x07"  # an OSC sequence that retitles the terminal


def test_escapes_controls_and_keeps_lines_tabs_and_text():
    assert escaped(f"a{TITLE}b\n\tc\u202ed é") == "a\\x1b]0;pwned\\x07b\n\tc\\u202ed é"
    assert escaped("\x9b31m") == "\\x9b31m"  # a C1 control sequence introducer


@given(st.text())
def test_nothing_unsafe_is_left(text):
    out = escaped(text)
    assert not any(ord(c) < 0x20 and c not in "\n\t" or 0x7f <= ord(c) <= 0x9f or c == "\u202e" for c in out)


def test_the_stream_lets_progress_redraws_and_asked_for_colours_through():
    plain, colored = io.StringIO(), io.StringIO()
    EscapingStream(plain).write("\r\x1b[32mok\x1b[0m\rx")
    EscapingStream(colored, colors=True).write("\r\x1b[32mok\x1b[0m\x1b[2J")
    assert plain.getvalue() == "\r\\x1b[32mok\\x1b[0m\\x0dx"
    assert colored.getvalue() == "\r\x1b[32mok\x1b[0m\\x1b[2J"  # colours only: no screen clearing


def test_a_verb_prints_a_name_from_a_folder_escaped(tmp_path, capsys):
    hostile = tmp_path / f"epoch_0_step_1{TITLE}"
    hostile.mkdir()
    code = cli_main(["verify", str(hostile)])
    out, err = capsys.readouterr()
    assert code != 0 and "\x1b" not in out + err and "\x07" not in out + err
    assert "\\x1b]0;pwned\\x07" in err and len(err.strip().splitlines()) == 1
    assert not isinstance(sys.stdout, EscapingStream)  # the streams are given back when the verb returns


def test_an_error_naming_a_name_with_a_newline_stays_one_line(tmp_path, capsys):
    hostile = tmp_path / "a\nerror: forged"
    hostile.mkdir()
    code = cli_main(["verify", str(hostile)])
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1 and "a\\nerror: forged" in err
