import io
import random

import pytest

from freetoken.cli.display import text_width
from freetoken.cli.render import AnswerPrinter, WordWrap


def wrap(text: str, width: int, pieces: int = 1) -> str:
    out: list[str] = []
    w = WordWrap(out.append, width)
    step = max(1, len(text) // pieces)
    for i in range(0, len(text), step):
        w.feed(text[i : i + step])
    w.flush()
    return "".join(out)


def inserted_only(original: str, wrapped: str) -> bool:
    """True when `wrapped` is `original` with some newlines inserted and nothing else changed."""
    i = 0
    for ch in wrapped:
        if i < len(original) and ch == original[i]:
            i += 1
        elif ch != "\n":
            return False
    return i == len(original)


def test_breaks_before_the_word_that_does_not_fit():
    assert wrap("the quick brown fox jumps", 10) == "the quick \nbrown fox \njumps"


def test_no_wrapping_without_width():
    assert wrap("a " * 100, 0) == "a " * 100


def test_long_word_is_split_at_the_width():
    out = wrap("x" * 25, 10)
    assert out == "x" * 10 + "\n" + "x" * 10 + "\n" + "x" * 5


def test_wide_characters_count_two_columns_and_break_anywhere():
    out = wrap("模型" * 6, 8)
    assert all(text_width(line) <= 8 for line in out.split("\n"))
    assert out.replace("\n", "") == "模型" * 6


def test_existing_newlines_reset_the_column():
    assert wrap("aaaa bbbb\ncccc dddd", 10) == "aaaa bbbb\ncccc dddd"


@pytest.mark.parametrize("seed", range(30))
def test_never_drops_or_reorders_characters(seed):
    rng = random.Random(seed)
    alphabet = "abcdefgh  \n\t.,é模😀"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 400)))
    width = rng.randint(2, 30)
    out = wrap(text, width, pieces=rng.randint(1, 40))
    assert inserted_only(text, out)
    for line in out.split("\n"):
        assert text_width(line.rstrip(" \t")) <= width


def test_answer_printer_layout_of_thinking_then_answer():
    out = io.StringIO()
    p = AnswerPrinter(out)
    p.thinking("let me ")
    p.thinking("see")
    p.content("Hello")
    p.content(" world")
    p.finish()
    assert out.getvalue() == "Thinking...\nlet me see\n...done thinking.\n\nHello world\n"


def test_answer_printer_dims_thinking_on_a_terminal():
    out = io.StringIO()
    p = AnswerPrinter(out, color=True)
    p.thinking("hmm")
    p.content("ok")
    p.finish()
    assert out.getvalue() == "\x1b[2mThinking...\nhmm\n...done thinking.\n\n\x1b[0mok\n"


def test_answer_printer_hides_thinking():
    out = io.StringIO()
    p = AnswerPrinter(out, hide_thinking=True)
    p.thinking("secret")
    p.content("answer\n")
    p.finish()
    assert out.getvalue() == "answer\n"


def test_finish_closes_an_interrupted_thought():
    out = io.StringIO()
    p = AnswerPrinter(out, color=True)
    p.thinking("half a thou")
    p.finish()
    assert out.getvalue().endswith("half a thou\n...done thinking.\n\n\x1b[0m")
