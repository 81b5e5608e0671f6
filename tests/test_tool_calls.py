"""Tool calls: the format chosen from a chat template's source, the parsers on exact strings
(whole and streamed in pieces), calls rendered back into a conversation through the real
templates of each family."""

from __future__ import annotations

import json
import random

import pytest
from helpers import TEMPLATES_DIR, TEMPLATES_MISSING, chat_model_dir, needs_templates
from in_process import llmrun
from tool_families import FAMILIES, PHI4_MINI_TEMPLATE, RESULT

from llmrun.chat_template import ChatTemplate
from llmrun.reasoning import REASONING
from llmrun.tool_calls import (
    COMMAND,
    DEEPSEEK_V3,
    DEEPSEEK_V31,
    GEMMA4,
    GLM,
    GRANITE,
    HARMONY,
    HERMES,
    KIMI,
    LLAMA3,
    MINIMAX,
    MISTRAL,
    MUSE,
    PHI4,
    QWEN_XML,
    SEED,
    ToolCall,
    ToolCallParser,
    detect_format,
    get_format,
    kimi_id,
    parse,
)
from llmrun.tool_use import mistral_id, prepare_history

TEMPLATE_FORMATS = {
    "Qwen-Qwen2.5-7B-Instruct": (HERMES, False),
    "Qwen-Qwen3-0.6B": (HERMES, False),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": (HERMES, False),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": (HERMES, False),
    "meta-llama-Llama-3.1-8B-Instruct": (LLAMA3, False),
    "meta-llama-Llama-3.2-3B-Instruct": (LLAMA3, False),
    "meta-llama-Llama-3.3-70B-Instruct": (LLAMA3, False),
    "mistralai-Mistral-Nemo-Instruct-2407": (MISTRAL, False),
    "Mistral-Small-3.2-24B-Instruct-2506": (MISTRAL, True),
    "unsloth-mistral-Devstral-Small-2507": (MISTRAL, True),
    "mistralai-Ministral-3-14B-Reasoning-2512": (MISTRAL, True),
    "openai-gpt-oss-120b": (HARMONY, False),
    "microsoft-Phi-3.5-mini-instruct": (None, False),
    "google-gemma-2-2b-it": (None, False),
    # R1's own template (the distills have it) renders calls in R1's format, as llama.cpp reads it
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (DEEPSEEK_V3, False),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": (DEEPSEEK_V3, False),
    # (llama.cpp's own; its tools | map | tojson fails in transformers, and so in llmrun)
    "llama-cpp-deepseek-r1": (DEEPSEEK_V3, False),
    "deepseek-ai-DeepSeek-V3.1": (DEEPSEEK_V31, False),
    "Kimi-K2-Instruct": (KIMI, False),
    "moonshotai-Kimi-K2": (KIMI, False),
    "Kimi-K2-Thinking": (KIMI, False),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": (COMMAND, False),
    "Cohere2MoE": (COMMAND, False),
    "CohereForAI-c4ai-command-r-plus-tool_use": (None, False),  # Command R+'s older format
    "ByteDance-Seed-OSS": (SEED, False),  # not Qwen3-Coder's, though its calls are alike
    "HuggingFaceTB-SmolLM3-3B": (None, False),  # this (Unsloth's) template offers no tools
    "Qwen3-Coder": (QWEN_XML, False),
    "Qwen3.5-4B": (QWEN_XML, False),
    "ibm-granite-granite-3.3-2B-Instruct": (GRANITE, False),  # not Phi-4-mini's format
    "GLM-4.6": (GLM, False),  # not Hermes' (both open calls with <tool_call>)
    "GLM-4.7-Flash": (GLM, False),
    "ibm-granite-granite-4.0": (HERMES, False),
    "MiniMax-M2": (MINIMAX, False),
    "google-gemma-4-31B-it": (GEMMA4, False),
    "google-gemma-4-31B-it-interleaved": (GEMMA4, False),
    "muse-glimmer": (MUSE, False),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def template(name: str) -> str:
    return (TEMPLATES_DIR / f"{name}.jinja").read_text()


@needs_templates
@pytest.mark.parametrize("name", TEMPLATE_FORMATS)
def test_the_format_comes_from_the_template(name):
    fmt = detect_format(template(name))
    expected, args_form = TEMPLATE_FORMATS[name]
    assert (fmt.name if fmt else None) == expected
    if fmt is not None:
        assert fmt.args_form == args_form


def test_phi4_mini_and_no_template():
    assert detect_format(PHI4_MINI_TEMPLATE).name == PHI4
    assert detect_format(None) is None and detect_format("{{ messages }}") is None


def calls_of(fmt, text):
    content, calls = parse(fmt, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


PARIS = ("get_weather", {"city": "Paris"})
EXACT = [
    # Granite 3.x: a JSON list after <|tool_call|>, to the end of the output.
    (
        GRANITE,
        'I will check. <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "I will check.",
        [PARIS, ("get_time", {})],
    ),
    # Qwen3-Coder / Qwen3.5: XML, text before, two calls; values without a schema are JSON.
    (
        QWEN_XML,
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        '<parameter=zone>\n{"tz": "CET", "dst": true}\n</parameter>\n<parameter=n>\n3\n</parameter>\n'
        "</function>\n</tool_call>",
        "Let me look.",
        [PARIS, ("get_time", {"zone": {"tz": "CET", "dst": True}, "n": 3})],
    ),
    # GLM-4.7: no newlines; GLM-4.5/4.6: a newline before each tag; values as in XML.
    (
        GLM,
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
        '<tool_call>get_time<arg_key>zone</arg_key><arg_value>{"tz": "CET"}</arg_value>'
        "<arg_key>n</arg_key><arg_value>3</arg_value></tool_call>",
        "",
        [PARIS, ("get_time", {"zone": {"tz": "CET"}, "n": 3})],
    ),
    (
        GLM,
        "Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>",
        "Let me look.",
        [PARIS, ("get_time", {})],
    ),
    # DeepSeek V3.1: name, separator, JSON; two calls in one section.
    (
        DEEPSEEK_V31,
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Let me look.",
        [PARIS, ("get_time", {})],
    ),
    # The output ended after the last call, before the section's end.
    (
        DEEPSEEK_V31,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris"}<｜tool▁call▁end｜>',
        "",
        [PARIS],
    ),
    # DeepSeek R1 / V3-0324: a type, the name, the arguments in a ```json block (indented,
    # as R1's template shows it), calls parted by a newline.
    (
        DEEPSEEK_V3,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{\n  "city": "Paris"\n}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
        "function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        [PARIS, ("get_time", {})],
    ),
    # Kimi K2: the id carries the name.
    (
        KIMI,
        "On it.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
        "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>",
        "On it.",
        [PARIS, ("get_time", {})],
    ),
    # Command R7B: a JSON list of actions, laid out as its template writes them.
    (
        COMMAND,
        '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
        '{"city": "Paris"}},\n    {"tool_call_id": "1", "tool_name": "get_time", "parameters": '
        "{}}\n]<|END_ACTION|>",
        "",
        [PARIS, ("get_time", {})],
    ),
    # Seed-OSS: XML as Qwen3-Coder's, in its own markers, values without newlines.
    (
        SEED,
        "Let me look.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris"
        "</parameter>\n</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=get_time>\n"
        '<parameter=zone>{"tz": "CET"}</parameter>\n<parameter=n>3</parameter>\n</function>\n'
        "</seed:tool_call>",
        "Let me look.",
        [PARIS, ("get_time", {"zone": {"tz": "CET"}, "n": 3})],
    ),
    # MiniMax-M2: invokes in one block, values without newlines; text before, as its
    # template writes it after the content.
    (
        MINIMAX,
        'Let me look.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n</invoke>\n<invoke name="get_time">\n'
        '<parameter name="zone">{"tz": "CET"}</parameter>\n<parameter name="n">3</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
        "Let me look.",
        [PARIS, ("get_time", {"zone": {"tz": "CET"}, "n": 3})],
    ),
    # The output ended after the last invoke, before the block's end; a call of no
    # arguments.
    (
        MINIMAX,
        '<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n',
        "",
        [("get_time", {})],
    ),
    # Text on both sides of a call stays parted as the model wrote it (was glued).
    (
        HERMES,
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>\nThen I will summarize.",
        "I will check.\nThen I will summarize.",
        [PARIS],
    ),
    (
        PHI4,
        'x <|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}<|/tool_call|> y',
        "x y",
        [PARIS],
    ),
    # Hermes / Qwen: text before, two calls, arguments as an object.
    (
        HERMES,
        'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        "Let me check.",
        [PARIS, ("get_time", {})],
    ),
    # Arguments as a JSON string, and a last call the model did not close.
    (
        HERMES,
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
        "",
        [PARIS],
    ),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    (
        LLAMA3,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        [PARIS, ("get_time", {})],
    ),
    (LLAMA3, ' \n{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [PARIS]),
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        [PARIS, ("get_time", {})],
    ),
    (
        MISTRAL,
        'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "Sure.",
        [PARIS, ("get_time", {})],
    ),
    (
        PHI4,
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>',
        "",
        [PARIS],
    ),
    (
        PHI4,
        'On it.<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}<|/tool_call|>',
        "On it.",
        [PARIS],
    ),
    (
        HARMONY,
        "<|channel|>analysis<|message|>They want the weather.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        "",
        [PARIS],
    ),
    # The recipient in the header, before the channel, as gpt-oss's template writes history.
    (
        HARMONY,
        'assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
        "",
        [PARIS],
    ),
    (
        HARMONY,
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is sunny.",
        "It is sunny.",
        [],
    ),
    # As the reasoning Splitter hands harmony on: a final answer's text, then a commentary
    # message as written.
    (
        HARMONY,
        "Let me look.<|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris"}',
        "Let me look.",
        [PARIS],
    ),
]


# Gemma 4's notation: strings between <|"|> tokens, bare keys, nested values.
GEMMA4_ARGS = (
    'city:<|"|>Paris, "France"<|"|>,days:3,opts:{metric:true,<|"|>quoted key<|"|>:-2.5e-1,'
    'list:[1,<|"|>a,b}<|"|>,null,[]]}'
)
GEMMA4_VALUES = {
    "city": 'Paris, "France"',
    "days": 3,
    "opts": {"metric": True, "quoted key": -0.25, "list": [1, "a,b}", None, []]},
}
EXACT += [
    (GEMMA4, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>', "", [PARIS]),
    (
        GEMMA4,
        f"Let me look.<|tool_call>call:get_weather{{{GEMMA4_ARGS}}}<tool_call|>"
        "<|tool_call>call:get_time{}<tool_call|>",
        "Let me look.",
        [("get_weather", GEMMA4_VALUES), ("get_time", {})],
    ),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), EXACT)
def test_parsers_on_exact_strings(name, text, content, calls):
    fmt = get_format(name, args_form="[ARGS]" in text)
    assert calls_of(fmt, text) == (content, calls)


NOT_CALLS = [
    (HERMES, 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut off
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'),
    (HERMES, "<tool_call>\nnot json\n</tool_call> and more"),
    (LLAMA3, '{"city": "Paris"}'),  # JSON, but not a call
    (LLAMA3, '{"name": "John", "age": 30, "city": "Paris"}'),  # an answer with a name in it
    (LLAMA3, '{"name": "get_time"}'),  # bare JSON without arguments: an answer too
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "city": "Paris"}]'),  # flat arguments
    (HERMES, '<tool_call>\n{"name": "get_weather", "city": "Paris"}\n</tool_call>'),
    (LLAMA3, '{"name": "get_weather", "parameters": {}} and then some text'),
    (LLAMA3, "<|python_tag|>brave_search.call(query='x')"),
    (MISTRAL, "[TOOL_CALLS]get weather[ARGS]{}"),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '),
    (PHI4, "<|tool_call|>[]<|/tool_call|>"),
    (QWEN_XML, "<tool_call>\n<function=get weather>\n</function>\n</tool_call>"),
    (QWEN_XML, "<tool_call>\n<function=f>\nloose text\n</function>\n</tool_call>"),
    (QWEN_XML, "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"),  # cut off
    (GLM, "<tool_call>get weather</tool_call>"),
    (GLM, "<tool_call>f<arg_key>a</arg_key>loose<arg_value>1</arg_value></tool_call>"),
    (GLM, "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>"),  # cut off
    (GLM, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),  # Hermes' form
    (DEEPSEEK_V31, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get weather<｜tool▁sep｜>{}"),
    (
        DEEPSEEK_V31,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{not json",
    ),  # cut off
    (
        DEEPSEEK_V31,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>loose"
        "<｜tool▁calls▁end｜>",
    ),
    (DEEPSEEK_V31, "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>"),
    (
        DEEPSEEK_V3,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>retrieval<｜tool▁sep｜>f\n```json\n{}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    (  # V3.1's form in R1's format: no ```json block
        DEEPSEEK_V3,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
    ),
    (
        KIMI,
        "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>"
        "{}<|tool_call_end|><|tool_calls_section_end|>",
    ),  # no functions.NAME:IDX id
    (
        KIMI,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        "[1]<|tool_call_end|><|tool_calls_section_end|>",
    ),
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"),  # cut off
    (COMMAND, '<|START_ACTION|>[{"tool_name": "f", "parameters": {}, "city": "Paris"}]'),
    (COMMAND, '<|START_ACTION|>{"tool_name": "f", "parameters": {}}<|END_ACTION|>'),  # no list
    (COMMAND, '<|START_ACTION|>[{"name": "f", "arguments": {}}]<|END_ACTION|>'),
    (COMMAND, "<|START_ACTION|>[]<|END_ACTION|>"),
    (SEED, "<seed:tool_call>\n<function=f>\nloose<parameter=a>1</parameter>\n</function>\n"),
    (SEED, "<seed:tool_call>\n<function=f>\n</function>\n</tool_call>"),  # cut off
    (SEED, "<tool_call>\n<function=f>\n</function>\n</tool_call>"),  # Qwen3-Coder's markers
    (MINIMAX, '<minimax:tool_call>\n<invoke name="get weather">\n</invoke>\n</minimax:tool_call>'),
    (
        MINIMAX,
        '<minimax:tool_call>\n<invoke name="f">\nloose<parameter name="a">1</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
    ),
    (MINIMAX, '<minimax:tool_call>\n<invoke name="f">\n</invoke>\nloose</minimax:tool_call>'),
    (MINIMAX, '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1'),  # cut off
    (MINIMAX, "<minimax:tool_call>\n</minimax:tool_call>"),
    (MINIMAX, "<minimax:tool_call>\n<function=f>\n</function>\n</minimax:tool_call>"),
    (HARMONY, "plain text from a harmony model"),
    (HARMONY, "<|channel|>commentary to=browser.search<|message|>{}"),
    (HARMONY, "<|channel|>commentary to=functions.f<|message|>{not json"),
    (GEMMA4, '<|tool_call>call:f{a:<|"|>1<|"|>'),  # cut off
    (GEMMA4, '<|tool_call>call:f{a:<|"|>1}<tool_call|>'),  # an open string
    (GEMMA4, "<|tool_call>call:f{a:1,}<tool_call|>"),
    (GEMMA4, "<|tool_call>call:f[1]<tool_call|>"),  # arguments that are no mapping
    (GEMMA4, "<|tool_call>call:f{a:1} and more<tool_call|>"),
]


@pytest.mark.parametrize(("name", "text"), NOT_CALLS)
def test_what_does_not_parse_is_returned_as_text(name, text):
    assert parse(get_format(name), text) == (text, [])


def test_half_a_call_is_never_returned():
    # The first call is whole; the second breaks off: it stays text, after the first.
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "argu'
    )
    content, calls = calls_of(get_format(HERMES), text)
    assert calls == [PARIS]
    assert content == '<tool_call>\n{"name": "get_time", "argu'


def test_text_without_calls_passes_exactly():
    for name in (HERMES, LLAMA3, MISTRAL, PHI4):
        for text in ("  Hello\n\nworld  \n", "a < b and [TOOL c", "{ not json", "\n\n"):
            assert parse(get_format(name), text) == (text, [])


def pieces_of(text, seed):
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("case", EXACT + [(*c, None, None) for c in NOT_CALLS])
def test_streamed_pieces_give_what_the_whole_text_gives(case):
    name, text = case[:2]
    fmt = get_format(name, args_form="[ARGS]" in text)

    def run(texts):
        parser = ToolCallParser(fmt, new_id=lambda: "id")
        items = parser.items(texts)
        content = "".join(i for i in items if isinstance(i, str) and i.kind != REASONING)
        calls = [i for i in items if isinstance(i, ToolCall)]
        assert (content, calls) == (parser.content, parser.calls)
        return parser.content, parser.calls, parser.reasoning

    whole = run([text])
    for seed in range(25):
        assert run(pieces_of(text, seed)) == whole


def test_content_is_passed_on_before_the_output_ends():
    parser = ToolCallParser(get_format(HERMES))
    assert parser.feed("Let me ") == ["Let me"]  # the space may go before a call
    assert parser.feed("check <tool") == [" check"]
    assert parser.feed("_call>\n{") == []
    items = parser.feed('"name": "f", "arguments": {}}\n</tool_call>')
    assert [type(i) for i in items] == [ToolCall] and items[0].name == "f"
    assert parser.finish() == []


def test_harmony_reasoning_is_kept_apart():
    text = (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Done."
    )
    parser = ToolCallParser(get_format(HARMONY))
    parser.items([text])
    assert (parser.reasoning, parser.content) == ("Think.", "Done.")


class Vocab:
    def __init__(self, tokens, special):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.special_ids = frozenset(self.ids[t] for t in special)

    def token_id(self, text):
        return self.ids.get(text)


def test_marker_ids_are_the_special_ones():
    vocab = Vocab(["a", "[TOOL_CALLS]", "[ARGS]", "<tool_call>"], ["[TOOL_CALLS]", "[ARGS]"])
    assert get_format(MISTRAL).marker_ids(vocab) == {1: "[TOOL_CALLS]", 2: "[ARGS]"}
    # Qwen's <tool_call> is not special: the detokenizer writes it already.
    assert get_format(HERMES).marker_ids(vocab) == {}


def test_ids():
    assert get_format(HERMES).new_id().startswith("call_")
    mistral = get_format(MISTRAL).new_id()
    assert len(mistral) == 9 and mistral.isalnum()
    assert mistral_id("abcDEF123") == "abcDEF123"
    assert mistral_id("call_0123456789") == mistral_id("call_0123456789")
    assert len(mistral_id("call_x")) == 9 and mistral_id("call_x").isalnum()


@pytest.mark.parametrize(
    "name",
    [HERMES, LLAMA3, MISTRAL, PHI4, HARMONY, DEEPSEEK_V31, DEEPSEEK_V3, KIMI, COMMAND, SEED]
    + [MINIMAX, GEMMA4],
)
@pytest.mark.parametrize("args_form", [False, True])
def test_call_text_parses_back(name, args_form):
    fmt = get_format(name, args_form)
    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert calls_of(fmt, fmt.call_text(calls)) == ("", [PARIS])
    two = [*calls, {"function": {"name": "get_time", "arguments": {}}}]
    if name not in (HARMONY, LLAMA3):
        assert calls_of(fmt, fmt.call_text(two)) == ("", [PARIS, ("get_time", {})])


# ---- a conversation with calls, through the real templates ----------------------------

CALL = {
    "id": "call_abc",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
]
RENDERED_CALLS = {
    "Qwen-Qwen2.5-7B-Instruct": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": '"arguments": {"city": "Paris"}',
    "meta-llama-Llama-3.1-8B-Instruct": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "meta-llama-Llama-3.2-3B-Instruct": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistralai-Mistral-Nemo-Instruct-2407": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "',
    "Mistral-Small-3.2-24B-Instruct-2506": '[ARGS]{"city": "Paris"}',
    "openai-gpt-oss-120b": 'to=functions.get_weather<|channel|>commentary json<|message|>"{\\"city\\": \\"Paris\\"}"',
    "Qwen3-Coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "deepseek-ai-DeepSeek-V3.1": '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>',
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": 'get_weather\n```json\n{"city": "Paris"}\n```',
    # the id as the call's: what the template writes back with the result matches it
    "moonshotai-Kimi-K2": "functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|><|im_system|>tool'
    "<|im_middle|>## Return of functions.get_weather:0",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": '"tool_name": "get_weather", "parameters": {"city": "Paris"}}',
    "Cohere2MoE": '"tool_name": "get_weather", "parameters": {"city": "Paris"}}',
    "ByteDance-Seed-OSS": "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris"
    "</parameter>\n</function>\n</seed:tool_call>",
    "MiniMax-M2": '\n<minimax:tool_call>\n<invoke name="get_weather">\n'
    '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>[e~[',
    # the tool's result named after the call it answers
    "google-gemma-4-31B-it": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>',
    # a message to the tool, then the tool's (the template finds its name by the call's id)
    "muse-glimmer": "<|start|>assistant to=get_weather<|message|><atem:function_calls>\n"
    '<atem:invoke name="get_weather">\n<atem:parameter name="city">Paris</atem:parameter>\n'
    "</atem:invoke>\n</atem:function_calls><|eot|><|start|>tool get_weather<|message|>"
    '<tool_output name="get_weather">\nsunny\n</tool_output><|eot|>',
}


@needs_templates
@pytest.mark.parametrize("name", RENDERED_CALLS)
def test_history_renders_as_the_template_expects(name):
    source = template(name)
    fmt = detect_format(source)
    messages = prepare_history(HISTORY, fmt, source, [WEATHER])
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # untouched
    if name != "openai-gpt-oss-120b":  # it renders arguments with tojson, as given
        assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    else:
        messages[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    assert messages[2]["name"] == "get_weather"
    text = ChatTemplate(source, "<s>", "</s>").render(messages, tools=[WEATHER])
    assert RENDERED_CALLS[name] in text
    assert "sunny" in text


def test_phi4_mini_history_without_tool_calls_in_the_template():
    messages = prepare_history(HISTORY, get_format(PHI4), PHI4_MINI_TEMPLATE, [WEATHER])
    text = ChatTemplate(PHI4_MINI_TEMPLATE, "", "<|endoftext|>").render(messages)
    tools = json.dumps([WEATHER["function"]])
    assert text == (
        f"<|system|><|tool|>{tools}<|/tool|><|end|><|user|>Weather in Paris?<|end|>"
        '<|assistant|><|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "<|/tool_call|><|end|><|tool_response|>sunny<|end|><|assistant|>"
    )


def test_mistral_ids_are_made_to_fit():
    fmt = get_format(MISTRAL)
    messages = prepare_history(HISTORY, fmt, "tool_calls", None)
    call_id = messages[1]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and messages[2]["tool_call_id"] == call_id


def test_kimi_ids():
    """Kimi K2's own ids stay as they are (its template writes them back with the result);
    any other becomes one of that form, numbered by the call's place in its message."""
    assert kimi_id("functions.get_weather:3", "get_weather", 0) == "functions.get_weather:3"
    assert kimi_id("call_abc", "get_weather", 1) == "functions.get_weather:1"
    assert kimi_id("functions.get_time:0", "get_weather", 0) == "functions.get_weather:0"


@needs_templates
def test_a_call_without_its_type_renders_in_deepseek_r1s_template():
    source = template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    call = {key: value for key, value in CALL.items() if key != "type"}
    history = [HISTORY[0], {**HISTORY[1], "tool_calls": [call]}]
    messages = prepare_history(history + HISTORY[2:], detect_format(source), source, [WEATHER])
    text = ChatTemplate(source, "<s>", "</s>").render(messages)
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n" in text


# ---- serve's app, with a scripted model of each family --------------------------------


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, http, client, model name) for a model that calls get_weather in its
    family's format under its real template, and answers once it has the result: the
    OpenAI client on serve's app in this process (tests/test_server.py starts the
    command itself; a process per family here took ~6 s of start-up each)."""
    import openai
    from serving import served

    from llmrun import api

    fam = FAMILIES[request.param]
    if fam.template.endswith(".jinja") and TEMPLATES_MISSING:
        pytest.skip(TEMPLATES_MISSING)
    model = fam.model_dir(tmp_path_factory.mktemp(request.param))
    for http in served(api.load(str(model), device="cpu"), model.name):
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="-", max_retries=0, http_client=http
        )
        yield fam, http, client, model.name


def reassemble(stream):
    """A streamed chat completion put back together: content, reasoning, calls, finish."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for part in delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def whole(reply):
    choice = reply.choices[0]
    message = choice.message
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    reasoning = getattr(message, "reasoning_content", None) or ""
    return message.content or "", reasoning, calls, choice.finish_reason


def without_ids(result):
    content, reasoning, calls, finish = result
    return content, reasoning, [{**c, "id": None} for c in calls], finish


def ask(client, name, messages, stream=False, **extra):
    args = dict(model=name, messages=messages, tools=[WEATHER], temperature=0, **extra)
    if stream:
        return reassemble(client.chat.completions.create(stream=True, **args))
    return client.chat.completions.create(**args)


def test_a_tool_round_trip_in_each_format(family):
    fam, _, client, name = family
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = ask(client, name, messages)
    content, reasoning, calls, finish = whole(reply)
    assert (content, finish) == ("", "tool_calls")
    assert reply.choices[0].message.content is None
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [PARIS]
    call_id = calls[0]["id"]
    if fam.name == KIMI:  # the id Kimi wrote, which its template writes back
        assert call_id == "functions.get_weather:0"
    else:
        assert len(call_id) == 9 if fam.name == MISTRAL else call_id.startswith("call_")
    assert reasoning == ("the big" if fam.call[0] == "<think>" else "")
    assert without_ids(ask(client, name, messages, stream=True)) == without_ids(whole(reply))

    # The call and the tool's result go back: the model answers.
    messages += [
        reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]
    answer = ask(client, name, messages)
    assert whole(answer) == ("It is sunny in Paris.", "", [], "stop")
    assert answer.choices[0].message.tool_calls is None
    assert ask(client, name, messages, stream=True) == whole(answer)


def test_tool_choice_none_leaves_the_call_as_text(family):
    fam, _, client, name = family
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    content, _, calls, finish = whole(ask(client, name, messages, tool_choice="none"))
    assert (calls, finish) == ([], "stop")
    if fam.name in (HERMES, LLAMA3) and fam.call[0] != "<think>":
        assert json.dumps({"city": "Paris"}) in content
    if fam.name == HARMONY:  # a call's message is no answer: neither it nor its header shows
        assert "commentary" not in content and "functions." not in content


@pytest.mark.parametrize("key", ["qwen2.5", "llama3.1", "deepseek-v3.1", "kimi-k2"])
def test_chat_tools_shows_the_calls(key, tmp_path):
    fam = FAMILIES[key]
    if TEMPLATES_MISSING:
        pytest.skip(TEMPLATES_MISSING)
    model = fam.model_dir(tmp_path / key)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER["function"]]))
    command = ["chat", str(model), "--temperature", "0", "--tools", str(tools)]
    r = llmrun(*command, input="Weather in Paris?\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == '-> get_weather({"city": "Paris"})\n\n'
    tools.write_text("[{}]")
    r = llmrun(*command)
    assert r.returncode == 2 and "tool 0 needs a name" in r.stderr


def test_tool_choice_forces_a_call_that_fits_the_schema(family):
    """Given the tool's result the model would answer; a named tool_choice or "required"
    makes it call, through the grammar of its format, with arguments its schema allows."""
    from tool_families import CLOCK
    from tool_families import WEATHER as STRICT_WEATHER

    fam, _, client, name = family
    call = {
        "id": get_format(fam.name).new_id(),
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": RESULT},
    ]
    tools = [STRICT_WEATHER, CLOCK]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        args = dict(tools=tools, tool_choice=choice, parallel_tool_calls=False, max_tokens=150)
        args["stop"] = ["\n", "city"]  # text a call holds: a forced call is not cut by them
        reply = client.chat.completions.create(model=name, messages=messages, temperature=0, **args)
        content, _, calls, finish = whole(reply)
        assert (content, finish, len(calls)) == ("", "tool_calls", 1), reply
        call = calls[0]
        if choice != "required":
            assert call["name"] == "get_weather"
        expected = {"get_weather": ({"city": "Paris"}, {"city": "Rome"}), "get_time": ({},)}
        assert json.loads(call["arguments"]) in expected[call["name"]]
        stream = client.chat.completions.create(
            model=name, messages=messages, temperature=0, stream=True, **args
        )
        assert without_ids(reassemble(stream)) == without_ids(whole(reply))


def test_tools_with_a_response_format_allow_a_call_or_the_json_answer(family):
    """With tool_choice auto and a response format, the model may call (its own choice
    here, though the grammar has it spell the call in the tokens that spell forced text)
    or answer, and then only JSON of the schema: where it wanted to say something else,
    what it says is one of the two."""
    from tool_families import WEATHER as STRICT_WEATHER

    fam, _, client, name = family
    schema = {
        "type": "object",
        "properties": {"sunny": {"type": "boolean"}},
        "required": ["sunny"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    args = dict(tools=[STRICT_WEATHER], response_format=response_format, max_tokens=120)
    args["parallel_tool_calls"] = False  # a scripted model would not stop calling
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    if fam.call[0] != "<think>":  # Qwen3 would think first, which the grammar forbids
        content, _, calls, finish = whole(
            client.chat.completions.create(model=name, messages=messages, temperature=0, **args)
        )
        assert (content, finish) == ("", "tool_calls")
        assert [c["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["arguments"]) in ({"city": "Paris"}, {"city": "Rome"})
    call = {
        "id": get_format(fam.name).new_id(),
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": RESULT},
    ]
    reply = client.chat.completions.create(model=name, messages=messages, temperature=0, **args)
    content, _, calls, finish = whole(reply)
    if calls:
        assert (content, finish, calls[0]["name"]) == ("", "tool_calls", "get_weather")
    else:
        assert finish == "stop" and set(json.loads(content)) == {"sunny"}


# A tool whose parameters refer to definitions of their own, as pydantic's schemas
# (openai.pydantic_function_tool) do for nested models and enums.
LOCATED = {
    "type": "function",
    "function": {
        "name": "w",
        "parameters": {
            "type": "object",
            "properties": {"loc": {"$ref": "#/$defs/Loc"}, "tz": {"$ref": "#/definitions/Zone"}},
            "required": ["loc", "tz"],
            "additionalProperties": False,
            "$defs": {
                "Loc": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 8},
                        "unit": {"enum": ["c", "f"]},
                    },
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                }
            },
            "definitions": {"Zone": {"type": "string", "maxLength": 5}},
        },
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def stories():
    """The bundled model and its grammar vocabulary."""
    from llmrun import api, structured

    engine = api.load(None, device="cpu", ctx_size=256)
    return engine, structured.vocabulary(engine.tokenizer, engine.eos_ids)


@pytest.mark.parametrize(
    ("name", "args_form"),
    [
        (HERMES, False),
        (LLAMA3, False),
        (MISTRAL, False),
        (MISTRAL, True),
        (PHI4, False),
        (QWEN_XML, False),
        (GRANITE, False),
        (DEEPSEEK_V31, False),
        (DEEPSEEK_V3, False),
        (KIMI, False),
        (COMMAND, False),
        (SEED, False),
        (MINIMAX, False),
    ],
)
@pytest.mark.parametrize("tools", [[LOCATED], [LOCATED, CLOCK_TOOL]], ids=["one", "two"])
def test_forced_calls_follow_references_in_the_parameters(stories, name, args_form, tools):
    """The call's grammar puts the parameters inside a {"name", "arguments"} object: their
    references must still find their targets (before: "Pointer '/$defs/Loc' does not
    exist", a 400 for any nested pydantic model)."""
    from llmrun.sampling import SamplingParams

    engine, vocab = stories
    fmt = get_format(name, args_form).for_tools(tools)
    grammar = vocab.lark(fmt.grammar([tools[0]], vocab.token, False))  # only w: made to call it
    prompt = engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=0).updated(grammar=grammar)
    # the stories vocabulary spells DeepSeek's markers byte by byte: room for them
    text = "".join(r.text for r in engine.generate(prompt, params, 400))
    _, calls = parse(fmt, text)
    assert [c.name for c in calls] == ["w"], text
    args = json.loads(calls[0].arguments)
    assert set(args) == {"loc", "tz"} and len(args["tz"]) <= 5
    assert args["loc"]["unit"] in ("c", "f") and len(args["loc"]["city"]) <= 8
    vocab.lark(fmt.grammar(tools, vocab.token, True))  # several tools compile too


@needs_templates
def test_a_tool_use_template_renders_conversations_with_tools(tmp_path):
    """Hermes 2 Pro/3 and Command R ship a default template and one named "tool_use":
    with tools, transformers renders with the latter, and so does llmrun (the tools never
    reached the prompt, and no tool-call format was found)."""
    import transformers

    from llmrun import api
    from llmrun.server.reply import tool_format

    model = chat_model_dir(tmp_path / "m")
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    plain = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tools_template = (TEMPLATES_DIR / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    config["chat_template"] = [
        {"name": "default", "template": plain},
        {"name": "tool_use", "template": tools_template},
    ]
    config_file.write_text(json.dumps(config))
    engine = api.load(str(model), device="cpu")
    reference = transformers.AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for tools in (None, [WEATHER]):
        expected = reference.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert engine.render(messages, **({"tools": tools} if tools else {})) == expected
    assert tool_format(engine).name == HERMES


def test_xml_values_follow_the_tools_schemas():
    """Where the schema says string, a value is its text even when it would read as JSON
    (vLLM's qwen3_coder parser reads them so); other types are the JSON they spell."""
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"zip": {"type": "string"}, "n": {"type": "integer"}},
            },
        },
    }
    text = (
        "<tool_call>\n<function=f>\n<parameter=zip>\n01234\n</parameter>\n"
        "<parameter=n>\n7\n</parameter>\n<parameter=note>\nnot json\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    fmt = get_format(QWEN_XML).for_tools([tool])
    assert calls_of(fmt, text) == ("", [("f", {"zip": "01234", "n": 7, "note": "not json"})])
    # Seed-OSS's template writes a value with jinja's `string`: a boolean as Python's.
    tool["function"]["parameters"]["properties"]["ok"] = {"type": "boolean"}
    seed = get_format(SEED).for_tools([tool])
    text = (
        "<seed:tool_call>\n<function=f>\n<parameter=zip>01234</parameter>\n"
        "<parameter=ok>True</parameter>\n</function>\n</seed:tool_call>"
    )
    assert calls_of(seed, text) == ("", [("f", {"zip": "01234", "ok": True})])
    # MiniMax-M2's template writes a string as it is, anything else as JSON (tojson).
    minimax = get_format(MINIMAX).for_tools([tool])
    text = (
        '<minimax:tool_call>\n<invoke name="f">\n<parameter name="zip">12345</parameter>\n'
        '<parameter name="n">7</parameter>\n<parameter name="ok">true</parameter>\n'
        "</invoke>\n</minimax:tool_call>"
    )
    assert calls_of(minimax, text) == ("", [("f", {"zip": "12345", "n": 7, "ok": True})])
    assert calls_of(fmt, fmt.call_text([{"name": "f", "arguments": {"zip": "01234", "n": 7}}])) == (
        "",
        [("f", {"zip": "01234", "n": 7})],
    )


def test_call_arguments_hold_only_the_parameters_listed(stories):
    """Parameters that list properties and say nothing of others take no others, as
    llama.cpp's grammar has it (before: any extra argument was allowed)."""
    from llmrun.server.reply import Ask, _grammar

    engine, vocab = stories
    fmt = get_format(HERMES).for_tools([WEATHER])
    ask = Ask(messages=[], tools=[WEATHER], tool_choice="required", parallel=False)
    grammar = _grammar(engine, fmt, ask, forced=True)

    def accepts(text):
        constraint = grammar.constraint()
        constraint.compute()  # the first mask, computed on a worker: then the matcher is free
        matcher, ids = constraint.matcher, vocab.tokenize(text)
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()

    call = '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>'
    assert accepts(call % '{"city": "Paris"}')
    assert not accepts(call % '{"city": "Paris", "country": "France"}')
