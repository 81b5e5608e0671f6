"""serve's llama-server endpoints (llmrun.server.llama_server) through the app's test client
on the bundled stories260K given Qwen2.5's chat template: /tokenize and /detokenize answer
what `llmrun tokenize` prints, /apply-template what transformers renders (and the prompt
/v1/chat/completions counts), /completion the greedy text /v1/completions gives, whole and
streamed in llama.cpp's shapes, with stop words, grammars and n_probs. The same requests
agree with llama-server itself in benchmarks/llama_server_endpoints.py."""

from __future__ import annotations

import json

import pytest
from helpers import TEMPLATES_DIR, needs_templates
from in_process import llmrun
from starlette.testclient import TestClient

from llmrun import api
from llmrun.server import Service, create_app

ctu = pytest.importorskip("transformers.utils.chat_template_utils")
TEMPLATE = TEMPLATES_DIR / "Qwen-Qwen2.5-7B-Instruct.jinja"
PROMPT = "Once upon a time"
GREEDY = {"temperature": 0}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon a time."},
    {"role": "user", "content": "More."},
]


@pytest.fixture(scope="module")
def http():
    template = TEMPLATE if TEMPLATE.exists() else None
    engine = api.load(None, device="cpu", template_file=template)
    service = Service("stories", set(), None, parallel=2, queue=4)
    service.start(engine)
    with TestClient(create_app(service)) as client:
        yield client
    service.close()


def v1_text(http, prompt, n: int) -> str:
    body = {"prompt": prompt, "max_tokens": n, **GREEDY}
    return http.post("/v1/completions", json=body).json()["choices"][0]["text"]


def printed(*args: str) -> list:
    result = llmrun("tokenize", *args)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_tokenize_and_detokenize_answer_what_llmrun_tokenize_prints(http):
    text = "Hello <s>world"

    def tokens(**fields):
        return http.post("/tokenize", json={"content": text, **fields}).json()["tokens"]

    # add_special is false by default, as llama.cpp's; `llmrun tokenize` adds BOS.
    assert [tokens(add_special=True)] == printed(text)
    assert [tokens()] == printed("--no-bos", text)
    assert [tokens(parse_special=False)] == printed("--no-bos", "--no-special", text)
    assert tokens(with_pieces=True) == printed("--pieces", "--no-bos", text)
    ids = tokens(add_special=True)
    # Control tokens as their text, and SentencePiece's leading space, as llama.cpp's.
    content = http.post("/detokenize", json={"tokens": ids}).json()["content"]
    assert content == "<s> Hello <s> world"
    # A piece that is not whole UTF-8 comes as its bytes (llama.cpp's README's example).
    pieces = http.post("/tokenize", json={"content": "á", "with_pieces": True}).json()
    assert pieces["tokens"][1:] == [{"id": 198, "piece": [195]}, {"id": 164, "piece": [161]}]
    # Ids and text mixed: BOS only where text begins the prompt.
    mixed = http.post("/tokenize", json={"content": [ids[1], " world", "!"], "add_special": True})
    world, bang = printed("--no-bos", " world")[0], printed("--no-bos", "!")[0]
    assert mixed.json()["tokens"] == [ids[1], *world, *bang]


@needs_templates
def test_apply_template_is_the_prompt_of_chat_completions(http):
    prompt = http.post("/apply-template", json={"messages": MESSAGES}).json()["prompt"]
    conversation = ctu._normalize_chat_messages(MESSAGES)
    rendered, _ = ctu.render_jinja_template(
        conversations=[conversation], chat_template=TEMPLATE.read_text(), add_generation_prompt=True
    )
    assert prompt == rendered[0]
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, **GREEDY})
    counted = http.post("/tokenize", json={"content": prompt, "add_special": True}).json()
    assert len(counted["tokens"]) == chat.json()["usage"]["prompt_tokens"]
    completion = http.post("/completion", json={"prompt": prompt, "n_predict": 8, **GREEDY})
    assert completion.json()["content"] == chat.json()["choices"][0]["message"]["content"]


def test_completion_equals_v1_completions(http):
    ids = http.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    expected = v1_text(http, PROMPT, 12)
    for prompt in (PROMPT, ids, [ids[0], PROMPT]):
        body = {"prompt": prompt, "n_predict": 12, "return_tokens": True, **GREEDY}
        result = http.post("/completion", json=body).json()
        assert result["content"] == expected
        assert (result["tokens_evaluated"], result["tokens_predicted"]) == (len(ids), 12)
        assert len(result["tokens"]) == 12
        assert (result["stop"], result["stop_type"], result["stopping_word"]) == (True, "limit", "")
        assert result["prompt"] == "<s> Once upon a time"
        assert result["timings"]["predicted_n"] == 12
    assert (
        http.post("/completions", json={"prompt": PROMPT, "max_tokens": 12, **GREEDY}).json()[
            "content"
        ]
        == expected
    )


def test_a_streamed_completion_concatenates_to_the_whole(http):
    body = {"prompt": PROMPT, "n_predict": 10, **GREEDY}
    whole = http.post("/completion", json=body).json()
    with http.stream("POST", "/completion", json={**body, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)  # and no [DONE]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert all(len(c["tokens"]) == 1 for c in chunks[:-1])
    final = chunks[-1]
    for key in ("stop_type", "tokens_predicted", "tokens_evaluated"):
        assert final[key] == whole[key]
    assert final["timings"]["predicted_n"] == 10


def test_stop_words_grammars_and_n_probs(http):
    text = v1_text(http, PROMPT, 12)
    word = text.split()[2]
    body = {"prompt": PROMPT, "n_predict": 12, "stop": ["zzz", word], **GREEDY}
    result = http.post("/completion", json=body).json()
    assert result["content"] == text[: text.index(word)]
    assert (result["stop_type"], result["stopping_word"]) == ("word", word)

    grammar = 'root ::= ("yes" | "no") "."'
    body = {"prompt": PROMPT, "n_predict": 10, "grammar": grammar, **GREEDY}
    assert http.post("/completion", json=body).json()["content"] in ("yes.", "no.")
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    body = {"prompt": PROMPT, "n_predict": 60, "json_schema": schema, **GREEDY}
    answer = json.loads(http.post("/completion", json=body).json()["content"])
    assert answer["city"] in ("Paris", "Rome")

    body = {"prompt": PROMPT, "n_predict": 4, "n_probs": 3, "return_tokens": True, **GREEDY}
    result = http.post("/completion", json=body).json()
    probs = result["completion_probabilities"]
    assert [p["id"] for p in probs] == result["tokens"]
    for p in probs:  # greedy: the token drawn is the most likely one
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]
        assert p["logprob"] == pytest.approx(p["top_logprobs"][0]["logprob"])


def test_props(http):
    props = http.get("/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 2048 and settings["params"]["temperature"] == 0.8
    assert (props["total_slots"], props["model_alias"]) == (2, "stories")
    assert props["model_path"].endswith("stories260K.gguf")
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["build_info"].startswith("llmrun-")
    assert props["chat_template"] == (TEMPLATE.read_text() if TEMPLATE.exists() else "")


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/completion", {"prompt": ["a", "b"]}, "prompt", "one prompt at a time"),
        ("/completion", {"prompt": [[1], [2]]}, "prompt", "one prompt at a time"),
        ("/completion", {"prompt": [1, 99999]}, "prompt.1", "token ids must be in"),
        ("/completion", {"prompt": "a", "n_predict": 0}, "n_predict", "nothing"),
        ("/completion", {"prompt": "a", "grammar": "root ::= x", "json_schema": {}}, "grammar", ""),
        ("/completion", {"prompt": "a", "grammar": "root ::= undefined"}, "grammar", ""),
        ("/tokenize", {"content": [True]}, "content.0", "a token id or a text"),
        ("/detokenize", {"tokens": [99999]}, None, "outside the vocabulary"),
    ],
)
def test_bad_requests_are_400(http, path, body, param, message):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
