"""llama-server's native endpoints and its /v1/messages against llmrun serve's (not run by
CI: llama.cpp is not there).

    PYTHONPATH=. python benchmarks/llama_server_endpoints.py --llama-cpp DIR [--out FILE]

Both servers serve llmrun's bundled stories260K.gguf with Qwen2.5's chat template
(`llama-server --jinja --chat-template-file`, `llmrun serve --template`), llama-server with
an f32 KV cache and flash attention off (its f16 cache could break a near tie the other
way). The script sends both the same requests and reports, per case, whether the answers
agree:

- /tokenize (add_special, parse_special, with_pieces) and /detokenize: equal values;
- /apply-template: the same prompt text;
- /completion, greedy, a text, a token-id and a mixed prompt, and a stop word: the same
  content, tokens, counts, stop_type and stopping_word;
- /completion with `stream`: the same chunk texts, the same fields in each chunk, `stop`
  false until the last, no [DONE];
- /v1/messages, whole and streamed: the same fields (the shape: keys and value types),
  content block types, stop_reason and stop_sequence, and the same event names in order
  (Anthropic's `ping`, which llmrun sends and llama-server does not, aside).

Fields that only one server sends are listed (shape differences). Results go to --out
(benchmarks/out/llama_server_endpoints.json).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

from helpers import TEMPLATES_DIR  # noqa: E402
from serving import Server  # noqa: E402

from llmrun import paths  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
TEMPLATE = TEMPLATES_DIR / "Qwen-Qwen2.5-7B-Instruct.jinja"
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off")
TEXTS = ["Hello world", " leading space", "é ✓ 日本", "<s>Once</s> upon"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a time."},
        {"role": "user", "content": "More."},
    ],
]
GREEDY = {"temperature": 0, "n_predict": 24, "cache_prompt": False}
# Timings and ids differ between any two runs.
VARYING = {"timings", "id", "id_slot", "model", "generation_settings", "prompt", "tokens_cached"}


class LlamaServer:
    def __init__(self, binary: Path, model: Path, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
        command += ["-c", "2048", "-t", "1", "--parallel", "1", "--jinja"]
        command += ["--chat-template-file", str(TEMPLATE), *EXACT]
        self.process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {log.read_text()[-500:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def shape(value: Any) -> Any:
    """A JSON value's keys and value types, lists by their first item."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def differences(ours: Any, theirs: Any, at: str = "") -> list[str]:
    """Where two shapes differ: fields only one has, or values of another type."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = [f"{at}{k}: only llmrun" for k in ours.keys() - theirs.keys()]
        out += [f"{at}{k}: only llama.cpp" for k in theirs.keys() - ours.keys()]
        for k in sorted(ours.keys() & theirs.keys()):
            out += differences(ours[k], theirs[k], f"{at}{k}.")
        return sorted(out)
    if isinstance(ours, list) and isinstance(theirs, list):
        return differences(ours[0], theirs[0], at) if ours and theirs else []
    return [] if ours == theirs else [f"{at.rstrip('.')}: {ours} vs {theirs}"]


def post(url: str, path: str, body: dict) -> Any:
    response = httpx.post(f"{url}{path}", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def sse(url: str, path: str, body: dict) -> tuple[list[str], list[dict], bool]:
    """A stream's event names, its data objects, and whether it ended with [DONE]."""
    names, data, done = [], [], False
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
            elif line.startswith("data: "):
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    done = True
                else:
                    data.append(json.loads(payload))
    return names, data, done


def compare(ours: str, theirs: str) -> dict[str, Any]:
    results: dict[str, Any] = {}

    def both(path: str, body: dict) -> tuple[Any, Any]:
        return post(ours, path, body), post(theirs, path, body)

    for text in TEXTS:
        for add_special in (False, True):
            for parse_special in (True, False):
                for with_pieces in (False, True):
                    body = {
                        "content": text,
                        "add_special": add_special,
                        "parse_special": parse_special,
                        "with_pieces": with_pieces,
                    }
                    a, b = both("/tokenize", body)
                    name = f"tokenize {text!r} {add_special=} {parse_special=} {with_pieces=}"
                    results[name] = {"equal": a == b, "llmrun": a, "llama.cpp": b}
                    if not with_pieces:
                        x, y = both("/detokenize", {"tokens": a["tokens"]})
                        results[f"detokenize {a['tokens']}"] = {
                            "equal": x == y,
                            "llmrun": x,
                            "llama.cpp": y,
                        }
    for i, messages in enumerate(CONVERSATIONS):
        a, b = both("/apply-template", {"messages": messages})
        results[f"apply-template {i}"] = {"equal": a == b, "llmrun": a, "llama.cpp": b}

    ids = post(ours, "/tokenize", {"content": "Once upon a time", "add_special": True})["tokens"]
    prompts = {
        "text": "Once upon a time",
        "ids": ids,
        "mixed": [ids[0], "Once upon", " a time"],
    }
    for name, prompt in prompts.items():
        a, b = both("/completion", {"prompt": prompt, **GREEDY})
        keys = ("content", "tokens_predicted", "tokens_evaluated", "stop_type", "stopping_word")
        results[f"completion {name}"] = {
            "equal": all(a[k] == b[k] for k in keys),
            "llmrun": {k: a[k] for k in keys},
            "llama.cpp": {k: b[k] for k in keys},
            "shape": differences(shape(a), shape(b)),
        }
    text = post(theirs, "/completion", {"prompt": "Once upon a time", **GREEDY})["content"]
    word = text.split()[3]
    a, b = both("/completion", {"prompt": "Once upon a time", "stop": [word], **GREEDY})
    keys = ("content", "stop_type", "stopping_word", "tokens_predicted")
    results["completion stop word"] = {
        "equal": all(a[k] == b[k] for k in keys),
        "llmrun": {k: a[k] for k in keys},
        "llama.cpp": {k: b[k] for k in keys},
    }
    body = {"prompt": "Once upon a time", "stream": True, **GREEDY}
    (_, a, a_done), (_, b, b_done) = (
        sse(ours, "/completion", body),
        sse(theirs, "/completion", body),
    )
    results["completion stream"] = {
        "equal": [c["content"] for c in a] == [c["content"] for c in b]
        and [c["stop"] for c in a] == [c["stop"] for c in b]
        and (a_done, b_done) == (False, False),
        "chunks": [len(a), len(b)],
        "partial shape": differences(shape(a[0]), shape(b[0])),
        "final shape": differences(
            shape({k: v for k, v in a[-1].items() if k not in VARYING}),
            shape({k: v for k, v in b[-1].items() if k not in VARYING}),
        ),
    }

    chat = {"model": "stories260K", "max_tokens": 12, "temperature": 0}
    for name, extra in {
        "plain": {"system": "Be brief.", "messages": CONVERSATIONS[1][1:]},
        "max_tokens": {"messages": CONVERSATIONS[0], "max_tokens": 3},
        "stop_sequences": {
            "system": "Be brief.",
            "messages": CONVERSATIONS[1][1:],
            "stop_sequences": [" the"],
        },
    }.items():
        a, b = both("/v1/messages", {**chat, **extra})
        results[f"messages {name}"] = {
            "equal": [c["type"] for c in a["content"]] == [c["type"] for c in b["content"]]
            and (a["stop_reason"], a["stop_sequence"]) == (b["stop_reason"], b["stop_sequence"]),
            "llmrun": {k: a[k] for k in ("content", "stop_reason", "stop_sequence", "usage")},
            "llama.cpp": {k: b[k] for k in ("content", "stop_reason", "stop_sequence", "usage")},
            "shape": differences(shape(a), shape(b)),
        }
        body = {**chat, **extra, "stream": True}
        (a_names, a_events, _), (b_names, b_events, _) = (
            sse(ours, "/v1/messages", body),
            sse(theirs, "/v1/messages", body),
        )
        results[f"messages {name} stream"] = {
            # Anthropic's ping, which llmrun sends and llama-server does not, aside.
            "equal": _collapsed(a_names, "ping") == _collapsed(b_names, "ping"),
            "llmrun": _collapsed(a_names),
            "llama.cpp": _collapsed(b_names),
            "shape": sorted(
                {
                    d
                    for ours_event in a_events
                    for theirs_event in b_events
                    if ours_event["type"] == theirs_event["type"]
                    for d in differences(shape(ours_event), shape(theirs_event))
                    if ours_event.get("delta", {}).get("type")
                    == theirs_event.get("delta", {}).get("type")
                }
            ),
        }
    return results


def _collapsed(names: list[str], leave_out: str = "") -> list[str]:
    """Event names (but `leave_out`) with repeats of one name in a row written once."""
    names = [n for n in names if n != leave_out]
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="folder of llama-server")
    parser.add_argument("--out", type=Path, default=OUT / "llama_server_endpoints.json")
    args = parser.parse_args()
    model = paths.BUNDLED_MODEL
    work = Path(tempfile.mkdtemp(prefix="llama-server-endpoints-"))
    theirs = LlamaServer(args.llama_cpp / "llama-server", model, work / "llama-server.log")
    ours = Server(work, str(model), "--template", str(TEMPLATE), "--parallel", "1")
    try:
        results = compare(ours.url, theirs.url)
    finally:
        ours.stop()
        theirs.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    for name, result in results.items():
        extra = {k: v for k, v in result.items() if k not in ("equal",) and v}
        line = "same" if result["equal"] else "DIFFERENT"
        print(f"{line:9} {name}", "" if result["equal"] else json.dumps(extra, ensure_ascii=False))
        for key in ("shape", "partial shape", "final shape"):
            if result.get(key):
                print(f"{'':9}   {key}: {'; '.join(result[key])}")
    same = sum(r["equal"] for r in results.values())
    print(f"{same}/{len(results)} cases agree -> {args.out}")


if __name__ == "__main__":
    main()
