"""serve's POST /infill (llama.cpp's request and response shapes, streamed too) and the
`suffix` of /v1/completions, through the app's test client on a tiny code model: each
answers what the model generates for the FIM prompt llmrun.infill builds."""

import json

import pytest
from helpers import fim_model_dir
from starlette.testclient import TestClient

from llmrun import api
from llmrun.infill import infill_ids
from llmrun.sampling import SamplingParams
from llmrun.server import Service, create_app

PREFIX, SUFFIX = "Once upon a time\n", "\nThe end.\n"
EXTRA = [{"filename": "a.txt", "text": "Lily had a dog."}, {"text": "Tom ran."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return api.load(str(fim_model_dir(tmp_path_factory.mktemp("fim") / "m")), device="cpu")


@pytest.fixture(scope="module")
def http(engine):
    service = Service("coder", set(), None, parallel=2, queue=2)
    service.start(engine)
    with TestClient(create_app(service)) as client:
        yield client
    service.close()


def expected(engine, extra, prompt, max_tokens, logprobs=None):
    """The FIM prompt's ids and the greedy events for them."""
    files = [(f.get("filename", "tmp"), f["text"]) for f in extra]
    ids = infill_ids(
        engine.tokenizer,
        "coder",
        PREFIX,
        SUFFIX,
        files,
        prompt,
        ctx_size=engine.ctx_size,
        max_tokens=max_tokens,
    )
    events = list(engine.generate(ids, SamplingParams(temperature=0), max_tokens, (), logprobs))
    return ids, events


def test_infill_answers_the_middle_in_llama_cpp_shape(http, engine):
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": EXTRA,
        "prompt": "One",
        "n_predict": 10,
        "temperature": 0,
        "return_tokens": True,
        "n_probs": 2,
        "cache_prompt": True,  # llama.cpp's, accepted and ignored
    }
    result = http.post("/infill", json=body).json()
    ids, events = expected(engine, EXTRA, "One", 10, 2)
    assert result["content"] == "".join(e.text for e in events)
    assert result["tokens"] == [e.token for e in events if e.token is not None]
    assert (result["tokens_evaluated"], result["tokens_predicted"]) == (len(ids), 10)
    assert (result["stop"], result["stop_type"], result["model"]) == (True, "limit", "coder")
    assert result["prompt"] == engine.tokenizer.decode(ids, skip_special=False)
    assert result["prompt"].startswith("<|repo_name|>")
    assert result["timings"]["predicted_n"] == 10
    probs = result["completion_probabilities"]
    lps = [lp for e in events for lp in e.logprobs]
    assert [p["id"] for p in probs] == [lp.token for lp in lps]
    assert [p["logprob"] for p in probs] == pytest.approx([lp.logprob for lp in lps], abs=1e-5)
    assert all(len(p["top_logprobs"]) == 2 for p in probs)


def test_a_streamed_infill_concatenates_to_the_whole(http):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 12, "temperature": 0}
    whole = http.post("/infill", json=body).json()
    with http.stream("POST", "/infill", json={**body, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert all(line.startswith("data: ") for line in lines)  # and no [DONE]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert chunks[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_stop_words_and_response_fields(http, engine):
    _, events = expected(engine, [], "", 12)
    text = "".join(e.text for e in events)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 12, "temperature": 0}
    fields = ["content", "stop_type", "timings/predicted_n", "timings/nothing"]
    body |= {"stop": [text[3:6]], "response_fields": fields}
    result = http.post("/infill", json=body).json()
    assert result == {
        "content": text[: text.index(text[3:6])],
        "stop_type": "word",
        "timings/predicted_n": result["timings/predicted_n"],
    }


def test_completions_suffix_is_a_fim_prompt(http, engine):
    body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 9, "temperature": 0}
    result = http.post("/v1/completions", json=body).json()
    ids, events = expected(engine, [], "", 9)
    assert result["choices"][0]["text"] == "".join(e.text for e in events)
    assert result["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/infill", {"input_prefix": "a"}, "input_suffix"),
        ("/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": [{}]}, None),
        ("/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 0}, "n_predict"),
        ("/v1/completions", {"prompt": [1, 2], "suffix": "b"}, "suffix"),
        ("/v1/completions", {"prompt": "a", "suffix": "b", "echo": True}, "echo"),
    ],
)
def test_bad_requests_are_400(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param is None or error["param"].startswith(param)


def test_a_model_without_fim_tokens_is_400():
    service = Service("stories", set(), None, parallel=1, queue=1)
    service.start(api.load(None, device="cpu"))
    try:
        with TestClient(create_app(service)) as client:
            body = {"input_prefix": "a", "input_suffix": "b"}
            response = client.post("/infill", json=body)
    finally:
        service.close()
    assert response.status_code == 400
    assert "no fill-in-the-middle" in response.json()["error"]["message"]
