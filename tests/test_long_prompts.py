"""The long-trace target's data and format check (eagle3_assets/demo/long_prompts.py): what the target is taught to
write, and how a generation that leaves it is named. Pure: no model, no server."""

from __future__ import annotations

import re

from eagle3_assets.demo.long_prompts import FAMILIES, MAX_COMPLETION_TOKENS, format_break, make_conversations

CONVERSATIONS = make_conversations(600, 0)  # the target's own training conversations (LongTargetSpec's count and seed)


def test_only_the_last_line_of_every_trace_carries_the_capital_mark_and_every_trace_keeps_its_own_format():
    """The stop is read from one capital tag on the line counting 0, decided by the three digits just before it.
    Fails when the mark is dropped (the stop then read from the hundreds digit again: on the AVX2 build, 6 of 57
    generations went on past ``n 0 0 0`` to the 8,192 cap, 45 times in all counting 99 more lines) or put on
    another line, and when a trace of the families breaks the format check."""
    for messages, reasoning, answer in CONVERSATIONS:
        lines = reasoning.split("\n")
        tags = [line.split(" ")[4] for line in lines]
        assert all(tag.islower() for tag in tags[:-1]) and tags[-1].isupper() and lines[-1].startswith("n 0 0 0 ")
        assert format_break(messages[-1]["content"], reasoning, answer, "stop") is None


def test_the_format_check_names_a_trace_that_goes_on_past_zero_or_stops_before_it():
    """The two ways the trained target was seen to miss its stop, as the check must report them; the mark's case is a
    line's content (a wrong token), not the format."""
    messages, reasoning, answer = next(c for c in CONVERSATIONS if c[0][-1]["content"].startswith("Roll six dice"))
    question, lines = messages[-1]["content"], reasoning.split("\n")
    past_zero = "\n".join([*lines, "n 9 9 0 r 1 2 3 4 5 6"])  # the count wrapped to 099 instead of the close
    assert "counts 99 after 0" in format_break(question, past_zero, answer, "stop")
    closed_at_d00 = "\n".join(lines[:-100])  # closed on n 0 0 1: 100 lines early
    assert lines[-101].startswith("n 0 0 1 ") and "the last line counts 100, not 0" in format_break(question, closed_at_d00, answer, "stop")
    assert format_break(question, reasoning, answer, "length") == "finish_reason length"
    small_mark = "\n".join([*lines[:-1], lines[-1].replace(" R ", " r ")])
    assert format_break(question, small_mark, answer, "stop") is None


def test_every_line_is_twelve_tokens_and_the_longest_trace_fits_the_users_cap():
    """Digits and letters are written apart, one token each in the target's tokenizer, and with the newline a line is
    12 tokens (a sum's or flips' last line 13: the tokenizer has no " A" or " F" of its own), so a trace's length is
    its lines times 12 (the answer's few tokens besides). Fails when a family's line changes width or its most steps
    outgrow MAX_COMPLETION_TOKENS."""
    assert all(len(line.split(" ")) == 11 for _, reasoning, _ in CONVERSATIONS for line in reasoning.split("\n"))
    longest_lines = max(most for _, _, _, most in FAMILIES) + 1
    assert longest_lines * 12 + 1 + 32 <= MAX_COMPLETION_TOKENS  # with the close, the answer and the end of turn


def test_the_rotated_words_answer_is_its_last_line_even_when_the_word_holds_the_tag_letter():
    """The answer was once cut from the last line at " w ", the tag, so a word holding a w lost its end
    ("The word ends as o g." for "o g w o q a"): 20 of 714 conversations."""
    rotated = [(r, a) for m, r, a in CONVERSATIONS if m[-1]["content"].startswith("Rotate the word")]
    holding_w = [(r, a) for r, a in rotated if "w" in r.split("\n")[-1][10:]]
    assert holding_w
    for reasoning, answer in rotated:
        assert answer == f"The word ends as {reasoning.split(chr(10))[-1][10:]}."
        assert re.fullmatch(r"The word ends as [a-z]( [a-z]){5}\.", answer)
