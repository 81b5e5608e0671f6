"""llama-server --mmproj and llmrun serve answer the same image over HTTP (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_vision_serve.py --llama-cpp DIR --converter SRC [--out FILE]

The files are llama_cpp_vision.py's: the tests' tiny random Gemma 3 (tests/vision_helpers.py),
its mmproj GGUF written by llama.cpp's converter (SRC/convert_hf_to_gguf.py --mmproj), its
text GGUF by the tests' writer. Both servers load them (`DIR/llama-server -m model.gguf
--mmproj mmproj.gguf`, f32 KV cache, no flash attention; `llmrun serve model.gguf
--mmproj mmproj.gguf`) and get each image as a base64 data: URL in an OpenAI
/v1/chat/completions request, temperature 0, 8 tokens. llama.cpp places an image as
<start_of_image>, its soft tokens, <end_of_image> with no blank lines around it; llmrun
as transformers' Gemma3Processor does, with "\\n\\n" on both sides, so the two chat
prompts differ by those tokens (each server's usage says how many it read). For the same
prompt on both sides, llama-server's /completion also gets llmrun's layout (its media
marker between the blank lines). Per image: llmrun's reply, llama-server's chat reply and
its reply to llmrun's layout, whether they are equal, and the prompt token counts. Images
of the encoder's size (64) are not resized by either; others are sent Pillow-resized too
(llama.cpp's own bilinear resize has no antialiasing, so different pixels). Results go to
--out (benchmarks/out/llama_cpp_vision_serve.json).
"""

from __future__ import annotations

import base64
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_cpp_vision import QUESTION, TOKENS, cases  # noqa: E402
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    arguments,
    convert,
    greedy_completion,
    hub_tower_names,
)
from serving import Server as LlmrunServer  # noqa: E402
from vision_helpers import (  # noqa: E402
    save_gemma3_vl_dir,
    tiny_gemma3_vl,
    write_text_gguf,
)

OUT = ROOT / "benchmarks" / "out"


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def chat_body(data: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": QUESTION},
    ]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "top_k": 1,
    }


def compare(llmrun_url: str, server: LlamaServer, name: str, data: bytes) -> dict:
    ours = post(f"{llmrun_url}/v1/chat/completions", chat_body(data))
    theirs = server._post("/v1/chat/completions", {**chat_body(data), "cache_prompt": False})
    # llmrun's layout: Gemma3Processor's blank lines around the image chunk.
    marker = server.media_marker
    prompt = f"<start_of_turn>user\n\n\n{marker}\n\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    same_layout = greedy_completion(server, prompt, [data], TOKENS, n_probs=0)
    text = ours["choices"][0]["message"]["content"]
    chat_text = theirs["choices"][0]["message"]["content"]
    return dict(
        image=name,
        llmrun=text,
        llama_server_chat=chat_text,
        llama_server_llmrun_layout=same_layout["content"],
        equal_same_layout=text == same_layout["content"],
        equal_chat=text == chat_text,
        prompt_tokens_llmrun=ours["usage"]["prompt_tokens"],
        prompt_tokens_llama_server_chat=theirs["usage"]["prompt_tokens"],
        prompt_tokens_llama_server_llmrun_layout=same_layout["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_vision_serve.json")
    work = OUT / "vision_serve"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_gemma3_vl()
    folder = save_gemma3_vl_dir(model, work / "hf")
    hub_tower_names(folder, "vision_tower.")
    mmproj = convert(args.converter, folder, work / "mmproj.gguf", "--mmproj", "--outtype", "f32")
    text = write_text_gguf(model, work / "model.gguf")
    server = LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=mmproj)
    ours = LlmrunServer(Path(tempfile.mkdtemp()), str(text), "--mmproj", str(mmproj))
    results = []
    try:
        for name, _, sent in cases():
            record = compare(ours.url, server, name, sent)
            results.append(record)
            print(
                f"{name:>16}: same layout {'equal' if record['equal_same_layout'] else 'DIFFER'}"
                f", own chat layouts {'equal' if record['equal_chat'] else 'differ'}; "
                f"prompt tokens {record['prompt_tokens_llmrun']} / "
                f"{record['prompt_tokens_llama_server_llmrun_layout']} (llama-server chat "
                f"{record['prompt_tokens_llama_server_chat']})"
            )
    finally:
        server.close()
        ours.stop()
    args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
