"""The endpoint's tool-call parsers (rollout/endpoint/parsers.py) on turns as the model families write them: hermes,
Llama 3's JSON calls, the choice of a parser and the message an answer is given. Pure functions, no model; the
parsers at work behind the endpoint's routes are in tests/test_endpoint_access.py."""
from __future__ import annotations

import json
import types

import pytest

from qgrpo.rollout.endpoint import parsers

WEATHER = {"location": "San Francisco, CA", "unit": "Fahrenheit"}


def test_llama3_json_calls_with_and_without_the_python_tag():
    # Llama 3.1's JSON tool call: the whole turn, "parameters" holding the arguments
    bare = '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
    for text in (bare, f"<|python_tag|>{bare}", f"\n  {bare}\n"):
        turn = parsers.llama3_json(text)
        assert turn.calls == [{"name": "get_current_conditions", "arguments": WEATHER}], text
        assert turn.cleaned == "" and turn.reasoning is None
    # several calls separated by ";", "arguments" read as well, text after the last call kept as content
    two = ('<|python_tag|>{"name": "get_time", "parameters": {"city": "Paris"}}; '
           '{"name": "get_time", "arguments": {"city": "Lima"}} Checking both.')
    turn = parsers.llama3_json(two)
    assert turn.calls == [{"name": "get_time", "arguments": {"city": "Paris"}},
                          {"name": "get_time", "arguments": {"city": "Lima"}}]
    assert turn.cleaned == "Checking both."
    # with Llama 3.2's "type" first
    turn = parsers.llama3_json('{"type": "function", "name": "get_time", "parameters": {"city": "Oslo"}}')
    assert turn.calls == [{"name": "get_time", "arguments": {"city": "Oslo"}}]
    # a reasoning block first, then the call
    turn = parsers.llama3_json('<think>I need the weather.</think>\n{"name": "w", "parameters": {}}')
    assert turn.reasoning == "I need the weather." and turn.calls == [{"name": "w", "arguments": {}}]


def test_llama3_json_plain_text_is_content_and_a_broken_call_is_a_failure():
    for text in ("The answer is 156.", 'Use {"name": ...} to call a tool.', '{"answer": 3}'):
        turn = parsers.llama3_json(text)
        assert turn.calls == [] and turn.cleaned == text.strip(), text
    cut = '{"name": "get_current_conditions", "parameters": {"location": "San Fra'  # cut by max_tokens
    (error,) = parsers.llama3_json(cut).calls
    assert isinstance(error, str) and "not JSON" in error
    (error,) = parsers.llama3_json('{"name": "f", "parameters": [1, 2]}').calls
    assert isinstance(error, str) and "must be a JSON object" in error
    (error,) = parsers.llama3_json("<|python_tag|>print(2 + 2)").calls  # code after the tag: no call this reads
    assert isinstance(error, str) and "no JSON call" in error


def test_parse_builds_the_answer_and_counts_failures_per_parser():
    good = parsers.parse(parsers.LLAMA3, '{"name": "get_time", "parameters": {"city": "Paris"}}', "s-1")
    assert good.parser == "llama3_json" and good.failed == 0 and good.message.content is None
    (call,) = good.message.tool_calls
    assert call.id == "s-1-0" and call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    cut = '{"name": "get_time", "parameters": {"ci'
    bad = parsers.parse(parsers.LLAMA3, cut, "s-2")
    assert bad.failed == 1 and bad.calls == [] and bad.message.content == cut and bad.message.tool_calls is None
    hermes = parsers.parse(parsers.HERMES, 'Let me see. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
                           "s-3")
    assert hermes.parser == "hermes" and hermes.message.content == "Let me see." and len(hermes.calls) == 1
    # the same Llama 3 text read by hermes: no call, no failure, all content
    other = parsers.parse(parsers.HERMES, '{"name": "get_time", "parameters": {"city": "Paris"}}', "s-4")
    assert other.calls == [] and other.failed == 0 and other.message.content.startswith('{"name"')
    # tool_choice "none": no parser runs, the reasoning is still split off
    off = parsers.parse(parsers.LLAMA3, '<think>hm</think>{"name": "f", "parameters": {}}', "s-5", tools=False)
    assert off.parser is None and off.calls == [] and off.message.reasoning_content == "hm"
    # the tokenizer's own parser, where it cannot parse the turn: hermes answers, and is named
    fallback = parsers.parse(parsers.TEMPLATE, "<tool_call>{}", "s-6", tokenizer=types.SimpleNamespace())
    assert fallback.parser == "hermes" and fallback.failed == 1


def test_the_parser_is_chosen_by_name_or_by_the_tokenizer():
    plain, own = types.SimpleNamespace(), types.SimpleNamespace(response_template={"fields": {}})
    assert parsers.select(None, plain) == "hermes" and parsers.select(None, own) == "response_template"
    assert parsers.select("llama3_json", own) == "llama3_json" and parsers.select("auto", plain) == "hermes"
    with pytest.raises(ValueError, match=r"tool_parser 'qwen' is not a parser.*hermes, llama3_json"):
        parsers.select("qwen", plain)
    with pytest.raises(ValueError, match="tool_parser 'response_template': this tokenizer has no response_template"):
        parsers.select("response_template", plain)
