"""Scripted models (tests/scripted.py) that call a tool in each family's own format, under
that family's real chat template: asked anything, the model calls get_weather for Paris;
once the prompt holds the tool's result, it answers "It is sunny in Paris."."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from helpers import TEMPLATES_DIR
from scripted import CHATML, scripted_model_dir

RESULT = "22C, sunny"  # what the tool answers: the token that switches the model to its answer
ANSWER = ["It is sunny", " in Paris."]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
PARIS = ("get_weather", {"city": "Paris"})
ARGS = '{"city": "Paris"}'

# Phi-4-mini-instruct's template, as its tokenizer_config.json has it.
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + "
    "'<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
    "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)


def special(*tokens: str) -> list[tuple[str, bool]]:
    return [(t, True) for t in tokens]


def plain(*tokens: str) -> list[tuple[str, bool]]:
    return [(t, False) for t in tokens]


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # a file in TEMPLATES_DIR, or the source itself
    tokens: list[tuple[str, bool]]
    call: list[str]  # what the model says when asked
    eos: list[str]  # the first ends the answer
    answer_end: str | None = None  # how the answer ends, where the call's end differs
    answer_head: tuple[str, ...] = ()  # what comes before the answer's text (harmony's header)
    answer_after: str | None = None  # where the answer starts, if not after the prompt's end

    @property
    def source(self) -> str:
        if self.template.endswith(".jinja"):
            return (TEMPLATES_DIR / self.template).read_text()
        return self.template

    def model_dir(self, path: Path, chatter: bool = False) -> Path:
        """The scripted model; with `chatter` it only ever says the answer, so a call can
        only come from a grammar."""
        answer = [*self.answer_head, *ANSWER, self.answer_end or self.eos[0]]
        tokens = [*self.tokens, *plain(RESULT, *ANSWER)]
        common = dict(tokens=tokens, eos=self.eos, context=4096, prompt_tools=[WEATHER])
        if chatter:
            return scripted_model_dir(path, answer, self.source, **common)
        return scripted_model_dir(
            path,
            self.call,
            self.source,
            answer=answer,
            trigger=RESULT,
            answer_after=self.answer_after,
            **common,
        )


HERMES_CALL = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
JSON_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TOKENS = special(
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"
) + special("<|python_tag|>")
MISTRAL_TOKENS = special(
    "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"
) + special("[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]", "[TOOL_CONTENT]", "<eoc>")
MISTRAL_TOKENS += special("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
HARMONY_TOKENS = special(
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"
)
PHI4_TOKENS = special(
    "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>"
) + special("<|tool_call|>", "<|/tool_call|>", "<|tool_response|>", "<|endoftext|>")
CHATML_TOKENS = plain("<tool_call>", "</tool_call>", HERMES_CALL) + special("<|endoftext|>")
XML_CALL = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
GLM_TOKENS = special("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>")
GLM_TOKENS += special("<|observation|>", "<|endoftext|>")
GLM_EOS = ["<|user|>", "<|observation|>", "<|endoftext|>"]  # GLM-4.5's eos_token_id list
GLM47_CALL = "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
GLM46_CALL = "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
DS_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DS_CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")
DS_TOKENS = special("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", *DS_CALLS, *DS_CALL)
DS_TOKENS += special("<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>")
DS_TOKENS += special("<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
R1_CALL = 'get_weather\n```json\n{"city": "Paris"}\n```'
KIMI_TOKENS = special("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>")
KIMI_TOKENS += special("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
KIMI_TOKENS += special("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
KIMI_ID = "functions.get_weather:0"
COMMAND_TOKENS = special(
    "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>"
) + special("<|SYSTEM_TOKEN|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>")
COMMAND_TOKENS += special("<|END_ACTION|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>")
COMMAND_TOKENS += special("<|START_RESPONSE|>", "<|END_RESPONSE|>")
# As Command R7B's template writes a call back.
COMMAND_CALL = (
    '[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}\n]'
)
GEMMA4_CALL = 'call:get_weather{city:<|"|>Paris<|"|>}'
SEED_CALL = "\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n"
MINIMAX_CALL = (
    '\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n'
)
MUSE_CALL = (
    '<atem:function_calls>\n<atem:invoke name="get_weather">\n'
    '<atem:parameter name="city">Paris</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
)

FAMILIES = {
    "qwen2.5": Family(
        "hermes",
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        CHATML_TOKENS,
        ["<tool_call>", HERMES_CALL, "</tool_call>"],
        [CHATML[1], "<|endoftext|>"],
        answer_end="<|endoftext|>",
    ),
    # Qwen3 thinks first: its reasoning stays apart from the call.
    "qwen3": Family(
        "hermes",
        "Qwen-Qwen3-0.6B.jinja",
        CHATML_TOKENS,
        ["<think>", "▁the", "▁big", "</think>", "<tool_call>", HERMES_CALL, "</tool_call>"],
        [CHATML[1], "<|endoftext|>"],
        answer_end="<|endoftext|>",
    ),
    "hermes3": Family(
        "hermes",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        CHATML_TOKENS,
        ["<tool_call>", HERMES_CALL, "</tool_call>"],
        [CHATML[1], "<|endoftext|>"],
        answer_end="<|endoftext|>",
    ),
    # Qwen3-Coder writes its calls in XML, one parameter a block.
    "qwen3-coder": Family(
        "qwen3_xml",
        "Qwen3-Coder.jinja",
        plain("<tool_call>", "</tool_call>", XML_CALL) + special("<|endoftext|>"),
        ["<tool_call>", XML_CALL, "</tool_call>"],
        [CHATML[1], "<|endoftext|>"],
        answer_end="<|endoftext|>",
    ),
    # Granite 3.3: a JSON list after <|tool_call|>; its template renders no calls, so
    # the call goes back as the model wrote it, and the result as a "tool" message.
    "granite3.3": Family(
        "granite",
        "ibm-granite-granite-3.3-2B-Instruct.jinja",
        special("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>")
        + plain(f"[{JSON_CALL}]"),
        ["<|tool_call|>", f"[{JSON_CALL}]", "<|end_of_text|>"],
        ["<|end_of_text|>"],
    ),
    "llama3.1": Family(
        "llama3_json",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        [*LLAMA_TOKENS, *plain(LLAMA_CALL)],
        ["<|python_tag|>", LLAMA_CALL, "<|eom_id|>"],
        ["<|eot_id|>", "<|eom_id|>"],
    ),
    "llama3.2": Family(
        "llama3_json",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        [*LLAMA_TOKENS, *plain(LLAMA_CALL)],
        [LLAMA_CALL, "<|eom_id|>"],
        ["<|eot_id|>", "<|eom_id|>"],
    ),
    "mistral-nemo": Family(
        "mistral",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        [*MISTRAL_TOKENS, *plain(f"[{JSON_CALL}]")],
        ["[TOOL_CALLS]", f"[{JSON_CALL}]", "<eoc>"],
        ["</s>", "<eoc>"],
        answer_after="[/TOOL_RESULTS]",  # Nemo's template adds no prompt after a result
    ),
    "mistral-small-3.2": Family(
        "mistral",
        "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        [*MISTRAL_TOKENS, *plain("get_weather", ARGS)],
        ["[TOOL_CALLS]", "get_weather", "[ARGS]", ARGS, "<eoc>"],
        ["</s>", "<eoc>"],
    ),
    "gpt-oss": Family(
        "harmony",
        "openai-gpt-oss-120b.jinja",
        [*HARMONY_TOKENS, *plain("commentary to=functions.get_weather ", "json", ARGS, "final")],
        [
            "<|channel|>",
            "commentary to=functions.get_weather ",
            "<|constrain|>",
            "json",
            "<|message|>",
            ARGS,
            "<|call|>",
        ],
        ["<|return|>", "<|call|>"],
        answer_head=("<|channel|>", "final", "<|message|>"),
    ),
    # GLM-4.7's prompt opens the reasoning; its calls are XML with no newlines, ended by
    # <|observation|>.
    "glm-4.7-flash": Family(
        "glm45",
        "GLM-4.7-Flash.jinja",
        [*GLM_TOKENS, *plain("<tool_call>", "</tool_call>", GLM47_CALL)],
        ["</think>", "<tool_call>", GLM47_CALL, "</tool_call>", "<|observation|>"],
        GLM_EOS,
        answer_head=("</think>",),
    ),
    "glm-4.6": Family(
        "glm45",
        "GLM-4.6.jinja",
        [*GLM_TOKENS, *plain("<tool_call>", "</tool_call>", GLM46_CALL, "\n<tool_call>")],
        ["<think>", "▁the", "▁big", "</think>", "\n<tool_call>", GLM46_CALL, "</tool_call>"]
        + ["<|observation|>"],
        GLM_EOS,
    ),
    # DeepSeek V3.1 (thinking off: its prompt closes the reasoning).
    "deepseek-v3.1": Family(
        "deepseek_v31",
        "deepseek-ai-DeepSeek-V3.1.jinja",
        [*DS_TOKENS, *plain("get_weather", ARGS)],
        [DS_CALLS[0], DS_CALL[0], "get_weather", DS_CALL[1], ARGS, DS_CALL[2], DS_CALLS[1]],
        ["<｜end▁of▁sentence｜>"],
    ),
    # DeepSeek R1's own template (its distills carry it): the arguments are a ```json
    # block after the name; after the tools' results the model goes on with no new turn.
    "deepseek-r1": Family(
        "deepseek_v3",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        [*DS_TOKENS, *plain("function", R1_CALL)],
        [DS_CALLS[0], DS_CALL[0], "function", DS_CALL[1], R1_CALL, DS_CALL[2], DS_CALLS[1]],
        ["<｜end▁of▁sentence｜>"],
    ),
    # Kimi K2: the call's id is its name and number, which the template writes back.
    "kimi-k2": Family(
        "kimi_k2",
        "moonshotai-Kimi-K2.jinja",
        [*KIMI_TOKENS, *plain(KIMI_ID, ARGS)],
        ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", KIMI_ID]
        + ["<|tool_call_argument_begin|>", ARGS, "<|tool_call_end|>", "<|tool_calls_section_end|>"],
        [CHATML[1]],
    ),
    # Command R7B: its prompt closes the plan (thinking); the answer is a response block.
    "command-r7b": Family(
        "command_r7b",
        "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
        [*COMMAND_TOKENS, *plain(COMMAND_CALL)],
        ["<|START_ACTION|>", COMMAND_CALL, "<|END_ACTION|>"],
        ["<|END_OF_TURN_TOKEN|>"],
        answer_end="<|END_RESPONSE|>",
        answer_head=("<|START_RESPONSE|>",),
    ),
    # Seed-OSS: Qwen3-Coder's XML in its own markers, values written without newlines.
    "seed-oss": Family(
        "seed_oss",
        "ByteDance-Seed-OSS.jinja",
        special("<seed:bos>", "<seed:eos>", "<seed:tool_call>", "</seed:tool_call>")
        + plain(SEED_CALL),
        ["<seed:tool_call>", SEED_CALL, "</seed:tool_call>"],
        ["<seed:eos>"],
    ),
    # MiniMax-M2: its prompt opens the reasoning; invokes in a <minimax:tool_call> block.
    "minimax-m2": Family(
        "minimax_m2",
        "MiniMax-M2.jinja",
        special("]~!b[", "]~b]", "[e~[")
        + plain("<minimax:tool_call>", "</minimax:tool_call>")
        + plain(MINIMAX_CALL),
        ["</think>", "<minimax:tool_call>", MINIMAX_CALL, "</minimax:tool_call>"],
        ["[e~["],
        answer_head=("</think>",),
    ),
    # Gemma 4: Gemma's notation for the arguments, strings between <|"|> tokens (which,
    # as its markers, its vocabulary prints); a call ends the turn with <|tool_response>,
    # after which the template writes the result.
    "gemma4": Family(
        "gemma4",
        "google-gemma-4-31B-it.jinja",
        special("<|turn>", "<turn|>", "<|tool_response>", "<tool_response|>")
        + plain("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool>")
        + plain("<tool|>", GEMMA4_CALL),
        ["<|tool_call>", GEMMA4_CALL, "<tool_call|>", "<|tool_response>"],
        ["<turn|>", "<|tool_response>"],
    ),
    # Muse Glimmer: a message to the tool (its header's `<|start|>assistant` the prompt's),
    # ending the turn; the answer is a message to the user.
    "muse-glimmer": Family(
        "muse_glimmer",
        "muse-glimmer.jinja",
        special("<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "<|patch|>")
        + plain(" to=get_weather", " to=user", MUSE_CALL),
        [" to=get_weather", "<|message|>", MUSE_CALL, "<|eot|>"],
        ["<|eot|>"],
        answer_head=(" to=user", "<|message|>"),
    ),
    "phi4-mini": Family(
        "phi4_mini",
        PHI4_MINI_TEMPLATE,
        [*PHI4_TOKENS, *plain(JSON_CALL)],
        ["<|tool_call|>", JSON_CALL, "<|/tool_call|>", "<|end|>"],
        ["<|endoftext|>", "<|end|>"],
    ),
}
