"""Chat templates render byte-identically to transformers, and sandbox escapes fail."""

import copy
import functools
import json
from datetime import datetime

import pytest
from helpers import TEMPLATES_DIR, needs_templates

from llmrun import chat_template
from llmrun.chat_template import ChatTemplate, plain_transcript, select_template
from llmrun.errors import TemplateError

ctu = pytest.importorskip("transformers.utils.chat_template_utils")

TEMPLATE_FILES = sorted(TEMPLATES_DIR.glob("*.jinja"))

# (bos, eos) as each family's tokenizer_config.json has them; "" where it has none.
SPECIAL_TOKENS = {
    "HuggingFaceTB-SmolLM3": ("", "<|im_end|>"),
    "Qwen-": ("", "<|im_end|>"),
    "deepseek-ai-DeepSeek-R1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "google-gemma": ("<bos>", "<eos>"),
    "ibm-granite": ("<|end_of_text|>", "<|end_of_text|>"),
    "meta-llama-Llama-3": ("<|begin_of_text|>", "<|eot_id|>"),
    "microsoft-Phi-3": ("<s>", "<|endoftext|>"),
    "mistralai-": ("<s>", "</s>"),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo actuelle — 天気 ☀️",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City <name> & 'region'"}},
                "required": ["city"],
            },
        },
    }
]

# Templates that render nothing without variables of their own: the tool-use variants
# need tools, firefunction-v2 its functions (a JSON string) and the date.
REQUIRED = {
    "CohereForAI-c4ai-command-r-plus-tool_use": {"tools": TOOLS},
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": {"tools": TOOLS},
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": {"tools": TOOLS},
    "fireworks-ai-llama-3-firefunction-v2": {
        "functions": json.dumps(TOOLS, indent=2),
        "datetime": "2025-03-07",
    },
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "Hello, who are you?"}
ASSISTANT = {"role": "assistant", "content": "I am an assistant. How can I help?"}
FOLLOW_UP = {"role": "user", "content": "What is 2+2?"}

# name -> (messages, extra keyword arguments)
CONVERSATIONS = {
    "single": ([USER], {}),
    "system": ([SYSTEM, USER], {}),
    "multi_turn": ([USER, ASSISTANT, FOLLOW_UP], {}),
    "system_multi_turn": ([SYSTEM, USER, ASSISTANT, FOLLOW_UP], {}),
    "ends_with_assistant": ([USER, ASSISTANT], {}),
    "unicode": (
        [
            {"role": "system", "content": "Réponds en français 🇫🇷, s'il te plaît."},
            {"role": "user", "content": "你好！こんにちは 👋🏽 café — naïve 𝔘\u200b  \n"},
            {"role": "assistant", "content": "你好 😊 — 안녕하세요"},
            {"role": "user", "content": "Ünïcödé ✓ <tag> & \"quotes\" 'single'\ttab"},
        ],
        {},
    ),
    "tools": ([SYSTEM, {"role": "user", "content": "Weather in 東京?"}], {"tools": TOOLS}),
    "reasoning": (
        [USER, {**ASSISTANT, "reasoning_content": "They ask who I am…"}, FOLLOW_UP],
        {},
    ),
    "thinking_off": ([USER], {"enable_thinking": False}),
    "not_alternating": ([USER, FOLLOW_UP], {}),
}

FROZEN_NOW = datetime(2025, 3, 7, 9, 30)


class _FrozenDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return FROZEN_NOW


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    monkeypatch.setattr(chat_template, "datetime", _FrozenDatetime)
    monkeypatch.setattr(ctu, "datetime", _FrozenDatetime)


def reference(source, messages, add_generation_prompt=True, **kwargs):
    """transformers' apply_chat_template(tokenize=False), minus the tokenizer."""
    conversation = ctu._normalize_chat_messages(messages)
    rendered, _ = ctu.render_jinja_template(
        conversations=[conversation],
        chat_template=source,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    return rendered[0]


def special_tokens(path):
    prefix = next((p for p in SPECIAL_TOKENS if path.name.startswith(p)), None)
    return SPECIAL_TOKENS[prefix] if prefix else ("<s>", "</s>")


@functools.cache
def compiled(path):
    bos, eos = special_tokens(path)
    return ChatTemplate(path.read_text(encoding="utf-8"), bos_token=bos, eos_token=eos)


@needs_templates
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("path", TEMPLATE_FILES, ids=lambda p: p.stem)
def test_parity_with_transformers(path, conversation, add_generation_prompt):
    messages, extra = CONVERSATIONS[conversation]
    extra = {**REQUIRED.get(path.stem, {}), **extra}
    bos, eos = special_tokens(path)
    tokens = {name: t for name, t in (("bos_token", bos), ("eos_token", eos)) if t}
    source = path.read_text(encoding="utf-8")
    try:
        expected = reference(source, messages, add_generation_prompt, **tokens, **extra)
    except Exception as e:
        assert conversation != "single", f"transformers failed on a single user turn: {e}"
        with pytest.raises(TemplateError) as raised:
            compiled(path).render(messages, add_generation_prompt, **extra)
        assert str(e) in str(raised.value)
        return
    got = compiled(path).render(messages, add_generation_prompt, **extra)
    assert got.encode() == expected.encode()


@needs_templates
def test_gemma_template_matches_transformers():
    """Gemma's turns: <start_of_turn>user / model, each content trimmed, <end_of_turn>;
    a system message refused as transformers refuses it."""
    path = TEMPLATES_DIR / "google-gemma-2-2b-it.jinja"
    if not path.is_file():
        pytest.skip(f"{path} is not present")
    source = path.read_text(encoding="utf-8")
    messages = [USER, ASSISTANT, {"role": "user", "content": "  What is 2+2?\n"}]
    for add_generation_prompt in (True, False):
        expected = reference(source, messages, add_generation_prompt, bos_token="<bos>")
        got = compiled(path).render(messages, add_generation_prompt)
        assert got.encode() == expected.encode()
    assert got == (
        "<bos><start_of_turn>user\nHello, who are you?<end_of_turn>\n"
        "<start_of_turn>model\nI am an assistant. How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
    )
    with pytest.raises(TemplateError, match="System role not supported"):
        compiled(path).render([SYSTEM, USER], True)


def test_render_context_matches_transformers():
    source = (
        "{{ messages|tojson }}|{{ tools|tojson }}|{{ documents|tojson }}|"
        "{{ add_generation_prompt }}|{{ bos_token }}|{{ eos_token }}|{{ unk_token is defined }}|"
        "{{ enable_thinking }}|{{ obj }}"
    )
    messages = [
        {"role": "system", "content": "s", "name": None},
        {"role": "assistant", "content": None, "thinking": "hmm", "tool_calls": ("a", 1)},
        {"role": "assistant", "content": "x", "reasoning": "why"},
    ]
    extra = {
        "tools": TOOLS,
        "documents": [{"title": "t", "text": "文"}],
        "enable_thinking": True,
        "obj": object(),
    }
    before = copy.deepcopy(messages)
    got = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
        messages, add_generation_prompt=False, **extra
    )
    expected = reference(
        source, messages, False, bos_token="<s>", eos_token="</s>", **copy.deepcopy(extra)
    )
    assert got == expected
    assert messages == before


def test_tojson_matches_transformers():
    source = (
        "{{ x|tojson }}\n{{ x|tojson(indent=2) }}\n{{ x|tojson(separators=(',', ':')) }}\n"
        "{{ x|tojson(sort_keys=true) }}\n{{ x|tojson(ensure_ascii=true) }}"
    )
    x = {"z": "<b>&'é😀</b>", "a": [1, 2.5, None, True], "m": {"k": "中文"}}
    got = ChatTemplate(source).render([USER], x=x)
    assert got == reference(source, [USER], x=x)
    assert "<b>&'é😀</b>" in got


def test_whitespace_control_matches_transformers():
    # The real templates trim with {%- everywhere; this one relies on trim_blocks/lstrip_blocks.
    source = "<s>\n    {% for m in messages %}\n    {{ m.content }}\n    {% endfor %}\n</s>\n"
    got = ChatTemplate(source).render([USER, ASSISTANT])
    assert got == reference(source, [USER, ASSISTANT])
    assert got == f"<s>\n    {USER['content']}\n    {ASSISTANT['content']}\n</s>"


def test_generation_tag_renders_its_body():
    source = (
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    )
    assert (
        ChatTemplate(source).render([USER]) == reference(source, [USER]) == f"[{USER['content']}]"
    )


def test_strftime_now_uses_the_clock():
    assert ChatTemplate("{{ strftime_now('%d %b %Y') }}").render([USER]) == "07 Mar 2025"


def test_empty_special_token_is_not_defined():
    source = "{{ bos_token is defined }} {{ eos_token }}"
    assert ChatTemplate(source, eos_token="</s>").render([USER]) == "False </s>"
    assert ChatTemplate(source, bos_token="<s>").render([USER], eos_token="E") == "True E"


def test_namespace_and_dict_still_work():
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }} {{ dict(a=1)|tojson }} {{ dict.fromkeys(['b'], 2)|tojson }}"
        "{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}"
    )
    assert ChatTemplate(source).render([USER, ASSISTANT]) == '2 {"a": 1} {"b": 2}02'


def test_raise_exception_carries_the_template_message():
    source = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(TemplateError, match="Conversation roles must alternate user/assistant"):
        ChatTemplate(source).render([USER])


def test_syntax_error_names_the_line():
    with pytest.raises(TemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% for m in messages %}")


def test_render_error_names_the_line():
    with pytest.raises(TemplateError, match="at line 3: UndefinedError: 'foo' is undefined"):
        ChatTemplate("a\nb\n{{ foo.bar }}").render([USER])


@pytest.mark.parametrize("messages", [[], ["hello"]], ids=["empty", "not-a-dict"])
def test_bad_conversations_are_refused(messages):
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages }}").render(messages)


ESCAPES = [
    "{{ ().__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ cycler.__init__.__globals__.os.popen('touch PWNED').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ namespace.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ lipsum.__globals__['os'].system('touch PWNED') }}",
    "{{ cycler.__init__.__globals__.__builtins__.__import__('os').system('touch PWNED') }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__ }}",
    "{{ dict.__class__.__base__ }}",
    "{{ messages[0]['__class__'] }}",
    "{{ ''|attr('__class__') }}",
    "{{ messages|map(attribute='__class__')|list }}",
    "{% for m in messages %}{{ loop.__class__ }}{% endfor %}",
    '{{ "{0.__class__.__base__.__subclasses__}".format(messages) }}',
    "{{ '{x.__class__}'.format_map({'x': 1}) }}",
    "{{ messages.append('x') }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{% set ns = namespace(__class__=1) %}",
    "{% set ns = namespace() %}{% set ns._secret = 1 %}",
    # CVE-2024-34359 (llama-cpp-python rendered GGUF templates unsandboxed).
    "{% for c in [].__class__.__base__.__subclasses__() %}{% if c.__name__ == 'catch_warnings' %}"
    "{{ c()._module.__builtins__['__import__']('os').system('touch PWNED') }}"
    "{% endif %}{% endfor %}",
]


@pytest.mark.parametrize("payload", ESCAPES)
def test_sandbox_escapes_fail_and_run_nothing(payload, tmp_path):
    target = tmp_path / "pwned"
    template = ChatTemplate("before " + payload.replace("PWNED", str(target)))
    with pytest.raises(TemplateError, match=r"^chat template tried to access \S"):
        template.render([USER])
    assert not target.exists()


def test_select_template():
    entries = [
        {"name": "default", "template": "D"},
        {"name": "tool_use", "template": "T"},
    ]
    assert select_template("S") == "S"
    assert select_template(None) is None
    assert select_template(entries) == "D"
    assert select_template(entries, "tool_use") == "T"
    with pytest.raises(TemplateError, match="no chat template named 'rag'; this model has"):
        select_template(entries, "rag")
    with pytest.raises(TemplateError, match="'name' and 'template'"):
        select_template([{"template": "D"}])


def test_plain_transcript():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "Bye"},
    ]
    assert plain_transcript(messages) == (
        "System: Be brief.\nUser: Hi 👋\nAssistant: Hello!\nUser: Bye\nAssistant:"
    )
    assert plain_transcript(messages, add_generation_prompt=False) == (
        "System: Be brief.\nUser: Hi 👋\nAssistant: Hello!\nUser: Bye"
    )
    first_turn = plain_transcript(messages[:2])
    assert first_turn == "System: Be brief.\nUser: Hi 👋\nAssistant:"
    assert plain_transcript(messages).startswith(first_turn)
