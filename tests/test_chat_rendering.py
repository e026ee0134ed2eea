"""Rendering a reasoning model's output back into the target's template, and its loss mask, token by token.

The oracle is the chat template itself: rendering the finished conversation
(the assistant turn carrying its reasoning) through the template gives the text
the target saw and wrote; the tokens whose characters lie after the generation
prompt are exactly the supervised ones.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eagle3_assets.core.validation.chat_rendering import ChatRenderer, RenderingError, detect_end_of_turn, detect_think_markers

# The tiny target's parser output for "What is 18+73?" (vLLM, deepseek_r1): the
# reasoning keeps the newline before </think>, the answer the two after it.
REASONING = "I need to add 18 and 73. So the sum is 91.\n"
ANSWER = "\n\nThe answer is 91."

MULTI_TURN = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "The answer is 4."},
    {"role": "user", "content": "And 18+73?"},
]

# A template like the tiny target's but whose generation prompt does NOT open the
# think block: the target writes <think> itself, and the parser drops it.
TEMPLATE_WITHOUT_OPEN_THINK = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>' + message['reasoning_content'] + '</think>' }}"
    "{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="module")
def tokenizer_without_open_think(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.chat_template = TEMPLATE_WITHOUT_OPEN_THINK
    return tok


def template_oracle(tokenizer, messages, assistant_turn):
    """The finished conversation as the template renders it, and where the generated part starts.

    The template ends the turn with end-of-turn plus a newline the target never
    wrote (generation stops on end-of-turn), so that newline is cut off.
    """
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*messages, assistant_turn], tokenize=False)
    assert full.endswith("<|im_end|>\n")
    full = full[: -len("\n")]
    # The template re-renders the assistant header (and, for the tiny target, the
    # opening "<think>\n") exactly as the generation prompt wrote it.
    assert full.startswith(prompt), "the template renders history differently from the generation prompt"
    return full, len(prompt)


def assert_mask_matches_template_token_by_token(tokenizer, trace, full_text, generated_from):
    encoding = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    assert trace.input_ids == encoding["input_ids"], "rendered ids differ from the template's conversation tokenised whole"
    assert len(trace.loss_mask) == len(trace.input_ids)
    for position, (token_id, mask, (start, end)) in enumerate(zip(trace.input_ids, trace.loss_mask, encoding["offset_mapping"])):
        generated = start >= generated_from
        assert end <= generated_from or generated, f"token {position} straddles the prompt/completion boundary"
        token = tokenizer.convert_ids_to_tokens(token_id)
        assert mask == int(generated), f"token {position} {token!r} at chars {start}:{end}: mask {mask}, generated={generated}"


def supervised_tokens(tokenizer, trace):
    return tokenizer.convert_ids_to_tokens([i for i, m in zip(trace.input_ids, trace.loss_mask) if m])


def test_tiny_target_markers_and_end_of_turn_come_from_its_tokenizer(tokenizer):
    assert detect_think_markers(tokenizer) == ("<think>", "</think>")
    assert detect_end_of_turn(tokenizer) == "<|im_end|>"
    renderer = ChatRenderer(tokenizer)
    assert renderer.template_opens_think_block()


@pytest.mark.parametrize("messages", [[{"role": "user", "content": "What is 18+73?"}], MULTI_TURN], ids=["single-turn", "multi-turn"])
def test_mask_for_a_template_whose_generation_prompt_opens_the_think_block(tokenizer, messages):
    renderer = ChatRenderer(tokenizer)
    trace = renderer.render(messages, REASONING, ANSWER)
    full, generated_from = template_oracle(
        tokenizer, messages, {"role": "assistant", "reasoning_content": REASONING.rstrip("\n"), "content": ANSWER.lstrip("\n")}
    )
    assert trace.prompt_text + trace.completion_text == full
    assert_mask_matches_template_token_by_token(tokenizer, trace, full, generated_from)

    supervised = supervised_tokens(tokenizer, trace)
    # the prompt already holds <think>: the target's output starts with the reasoning
    assert supervised[0] == "I" and "<think>" not in supervised
    assert supervised.count("</think>") == 1 and supervised[-1] == "<|im_end|>"
    assert tokenizer.decode([i for i, m in zip(trace.input_ids, trace.loss_mask) if m]) == REASONING + "</think>" + ANSWER + "<|im_end|>"
    # every header, system/user turn and earlier assistant turn is unsupervised
    unsupervised = tokenizer.convert_ids_to_tokens([i for i, m in zip(trace.input_ids, trace.loss_mask) if not m])
    assert unsupervised.count("<|im_start|>") == len(messages) + 1
    assert unsupervised[-2:] == ["<think>", "Ċ"]
    if len(messages) > 1:
        history = tokenizer(MULTI_TURN[2]["content"], add_special_tokens=False)["input_ids"]
        start = next(i for i in range(len(trace.input_ids)) if trace.input_ids[i : i + len(history)] == history)
        assert trace.loss_mask[start : start + len(history)] == [0] * len(history), "an earlier assistant turn is not the target's output"


@pytest.mark.parametrize("messages", [[{"role": "user", "content": "What is 18+73?"}], MULTI_TURN], ids=["single-turn", "multi-turn"])
def test_mask_for_a_template_whose_generation_prompt_does_not_open_the_think_block(tokenizer_without_open_think, messages):
    tokenizer = tokenizer_without_open_think
    renderer = ChatRenderer(tokenizer)
    assert not renderer.template_opens_think_block()
    # the target wrote "<think>\n..." itself; the parser dropped the marker and kept the rest
    reasoning = "\n" + REASONING
    trace = renderer.render(messages, reasoning, ANSWER)
    full, generated_from = template_oracle(tokenizer, messages, {"role": "assistant", "reasoning_content": reasoning, "content": ANSWER})
    assert trace.prompt_text + trace.completion_text == full
    assert_mask_matches_template_token_by_token(tokenizer, trace, full, generated_from)

    supervised = supervised_tokens(tokenizer, trace)
    assert supervised[0] == "<think>", "the start marker the target generated must be supervised"
    assert supervised.count("</think>") == 1 and supervised[-1] == "<|im_end|>"
    assert "<think>" not in tokenizer.convert_ids_to_tokens([i for i, m in zip(trace.input_ids, trace.loss_mask) if not m])


def test_truncated_generation_has_no_end_of_turn(tokenizer):
    trace = ChatRenderer(tokenizer).render([{"role": "user", "content": "What is 1+1?"}], REASONING, "\n\nThe answer", finished=False)
    assert supervised_tokens(tokenizer, trace)[-1] != "<|im_end|>"
    assert trace.completion_text == REASONING + "</think>\n\nThe answer"


def test_overrides_replace_markers_and_end_of_turn(tokenizer):
    renderer = ChatRenderer(tokenizer, think_open="<reason>", think_close="</reason>", end_of_turn="<|endoftext|>")
    trace = renderer.render([{"role": "user", "content": "What is 1+1?"}], "two", "2")
    # the tiny template still opens "<think>", so the overriding start marker is generated
    assert trace.completion_text == "<reason>two</reason>2<|endoftext|>"
    assert trace.input_ids[-1] == tokenizer.convert_tokens_to_ids("<|endoftext|>") and trace.loss_mask[-1] == 1
    with pytest.raises(RenderingError, match="both think_open and think_close"):
        ChatRenderer(tokenizer, think_open="<reason>")


def test_batch_rendering_equals_row_by_row(tokenizer):
    renderer = ChatRenderer(tokenizer)
    rows = [([{"role": "user", "content": f"What is {i}+{i}?"}], f"I need to add {i} and {i}.\n", f"\n\nThe answer is {2 * i}.", True) for i in range(5)]
    batch = renderer.render_batch(rows)
    assert batch == [renderer.render(m, r, c, finished=f) for m, r, c, f in rows]


def test_alignment_check_accepts_the_rendered_mask_and_catches_shifted_ones(tokenizer, tokenizer_without_open_think):
    for tok, reasoning in ((tokenizer, REASONING), (tokenizer_without_open_think, "\n" + REASONING)):
        renderer = ChatRenderer(tok)
        trace = renderer.render(MULTI_TURN, reasoning, ANSWER)
        ids, mask = trace.input_ids, trace.loss_mask

        def problem(ids=ids, mask=mask, messages=MULTI_TURN, reasoning=reasoning, content=ANSWER, finished=True):
            return renderer.supervised_text_problem(ids, mask, messages, reasoning, content, finished=finished)

        assert problem() is None
        prompt_end = mask.index(1)
        # a shift either way: the mask no longer starts where the prompt ends
        assert f"starts at token {prompt_end - 1}" in problem(mask=mask[1:] + [0])
        assert f"starts at token {prompt_end + 1}" in problem(mask=[0] + mask[:-1])
        # ids shifted against the mask (a token lost at the front): the prompt no longer matches
        assert "do not start with the rendered prompt" in problem(ids=ids[1:] + [ids[-1]])
        # the supervised span decodes to something else than the reasoning and the answer
        assert "decode to" in problem(finished=False)
        assert "decode to" in problem(content="\n\nThe answer is 92.")
        assert "decode to" in problem(mask=mask[:-1] + [0])
        assert "loss_mask 5" in problem(mask=mask[:5])
        assert problem(mask=[0] * len(ids)) == "no supervised token"
        holed = list(mask)
        holed[-3] = 0
        assert "contiguous" in problem(mask=holed)


def test_fingerprint_changes_with_the_template(tokenizer, tokenizer_without_open_think):
    assert ChatRenderer(tokenizer).fingerprint() == ChatRenderer(tokenizer).fingerprint()
    assert ChatRenderer(tokenizer).fingerprint() != ChatRenderer(tokenizer_without_open_think).fingerprint()
    assert ChatRenderer(tokenizer).fingerprint() != ChatRenderer(tokenizer, end_of_turn="<|endoftext|>").fingerprint()
