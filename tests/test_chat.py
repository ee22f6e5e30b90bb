"""The K3 chat format: rendered structure (K3_SPEC §6), per-segment tokenization, reply parsing."""

import pytest

from kimi_jax.text import chat
from kimi_jax.text import tokenizer as T


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return T.write_demo_tokenizer(tmp_path_factory.mktemp("chat_tok"), vocab_size=1024)


def test_render_thinking_with_history_and_tools():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "call the tool",
             "tool_calls": [{"function": {"name": "weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
            {"role": "tool", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"b": 1, "a": 2}}}]
    text = chat.to_text(chat.render(msgs, tools=tools))
    expected = (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described '
        'in JSONSchema.\n\n```json\n[{"function":{"name":"weather","parameters":{"a":2,"b":1}},"type":"function"}]'
        "\n```<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think in '
        "your thinking channel (not including the response channel), supported values include `low`, `medium`, "
        "`high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>call the tool<|close|>think<|sep|>'
        "<|open|>response<|sep|><|close|>response<|sep|>"
        '<|open|>tools<|sep|><|open|>call tool="weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="weather" index="1"<|sep|>sunny<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert text == expected


def test_render_thinking_off_and_escaping():
    segs = chat.render([{"role": "user", "content": "hi", "name": 'a"b&c'}], thinking=False)
    assert chat.to_text(segs) == ('<|open|>message role="user" name="a&quot;b&amp;c"<|sep|>hi<|close|>message<|sep|>'
                                  '<|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    # history assistant messages lose the think channel when thinking is off
    segs = chat.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], thinking=False,
                       add_generation_prompt=False)
    assert "think" not in chat.to_text(segs)


def test_per_segment_tokenization(tok):
    """Markers are single special ids; each text piece is encoded alone (not the rendered string)."""
    msgs = [{"role": "user", "content": "<|end_of_msg|> is just text"}]
    ids = chat.encode(tok, msgs, thinking=False)
    sp = tok.specials
    assert ids.count(sp["<|end_of_msg|>"]) == 1  # only the real terminator
    expected = ([sp["<|open|>"]] + tok.encode("message") + tok.encode(" role") + tok.encode('="') + tok.encode("user")
                + tok.encode('"') + [sp["<|sep|>"]] + tok.encode("<|end_of_msg|> is just text")
                + [sp["<|close|>"]] + tok.encode("message") + [sp["<|sep|>"], sp["<|end_of_msg|>"]]
                + [sp["<|open|>"]] + tok.encode("message") + tok.encode(" role") + tok.encode('="')
                + tok.encode("assistant") + tok.encode('"') + [sp["<|sep|>"], sp["<|open|>"]]
                + tok.encode("response") + [sp["<|sep|>"]])
    assert ids == expected
    # rendering once and tokenizing the whole string differs at segment boundaries
    whole = tok.encode(chat.to_text(chat.render(msgs, thinking=False)), allow_special=True)
    assert whole != ids


def test_parse_reply_separates_reasoning_answer_and_tools(tok):
    sp = tok.specials
    o, c, s, e = sp["<|open|>"], sp["<|close|>"], sp["<|sep|>"], sp["<|end_of_msg|>"]
    t = tok.encode
    ids = (t("Let me think.") + [c] + t("think") + [s, o] + t("response") + [s] + t("It is sunny.") + [c]
           + t("response") + [s, o] + t("tools") + [s, o] + t("call") + t(" tool") + t('="') + t("weather") + t('"')
           + t(" index") + t('="') + t("1") + t('"') + [s, o] + t("argument") + t(" key") + t('="') + t("days")
           + t('"') + t(" type") + t('="') + t("number") + t('"') + [s] + t("3") + [c] + t("argument") + [s, c]
           + t("call") + [s, c] + t("tools") + [s, c] + t("message") + [s, e] + t("trailing"))
    r = chat.parse_reply(tok, ids)
    assert r.reasoning == "Let me think." and r.content == "It is sunny." and r.finished
    assert r.tool_calls == [{"name": "weather", "arguments": {"days": 3}}]
    # thinking off: generation starts in the response channel; unfinished replies are reported as such
    r = chat.parse_reply(tok, t("Just the answer"), thinking=False)
    assert (r.reasoning, r.content, r.finished) == ("", "Just the answer", False)


def test_bad_messages():
    with pytest.raises(ValueError, match="role"):
        chat.render([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="thinking_effort"):
        chat.render([{"role": "user", "content": "x"}], thinking_effort="extreme")
    with pytest.raises(ValueError, match="tool message"):
        chat.render([{"role": "tool", "content": "x"}])
