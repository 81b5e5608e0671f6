"""llmrun's T5 next to llama.cpp on one tiny random flan-t5 (tests/t5_helpers.py, relative
positions up to llama.cpp's fixed 128) converted by llama.cpp's converter in F32 and Q8_0:
the prompt's tokens, the greedy tokens and the largest difference between the two engines'
logits at each of those steps.

llama-server runs no encoder-decoder model, so llama.cpp runs through llama-cpp-python's C
API (llama_encode, then llama_decode a token at a time from llama_model_decoder_start_token,
f32 KV cache, no flash attention) in the Python that has it (--llama-python). Its decoder's
output is never scaled by d_model**-0.5 (src/models/t5.cpp); this model's head is its own,
so neither engine scales. llama.cpp computes Q8_0 products with 8-bit activations, llmrun
exactly: their Q8_0 logits differ more than their F32 ones.

    python benchmarks/llama_cpp_t5.py --converter LLAMA_CPP_SOURCE \
        --llama-python /tmp/lcpp/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_server_compare import agreeing, convert  # noqa: E402
from t5_helpers import PROMPT, t5_folder, tokenizer_folder  # noqa: E402

from llmrun import api  # noqa: E402

STEPS = 16
# Run by --llama-python: llama.cpp's prompt ids, greedy tokens and each step's logits.
LLAMA_CPP = """
import json, sys
import llama_cpp as L
path, text, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
params = L.llama_context_default_params()
params.n_ctx = params.n_batch = params.n_ubatch = 512
params.type_k = params.type_v = 0  # GGML_TYPE_F32
params.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
ctx = L.llama_init_from_model(model, params)
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
buf = (L.llama_token * 512)()
raw = text.encode()
n = L.llama_tokenize(vocab, raw, len(raw), buf, 512, True, False)
ids = list(buf[:n])
assert L.llama_encode(ctx, L.llama_batch_get_one(buf, n)) == 0
token, tokens, rows = L.llama_model_decoder_start_token(model), [], []
for _ in range(steps):
    one = (L.llama_token * 1)(token)
    assert L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) == 0
    logits = L.llama_get_logits_ith(ctx, -1)
    row = [logits[i] for i in range(n_vocab)]
    token = max(range(n_vocab), key=row.__getitem__)
    rows.append(row)
    if L.llama_vocab_is_eog(vocab, token):
        break
    tokens.append(token)
print(json.dumps({"ids": ids, "tokens": tokens, "logits": rows}))
"""


def llama_cpp(python: Path, gguf_file: Path) -> dict:
    result = subprocess.run(
        [str(python), "-c", LLAMA_CPP, str(gguf_file), PROMPT, str(STEPS)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


def llmrun_steps(engine, ids: list[int], tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """llmrun's greedy tokens for the encoder input `ids`, and its logits [steps, vocab]
    after the decoder start and each of llama.cpp's `tokens` (teacher-forced)."""
    from llmrun.sampling import SamplingParams

    stream = engine.generate(ids, SamplingParams(temperature=0.0), STEPS)
    ours = [r.token for r in stream if r.token is not None]
    model = engine.model
    with torch.no_grad():
        decoding = model.decoding(model.encode(torch.tensor([ids])))
        forced = torch.tensor([[model.args.decoder_start_token_id, *tokens]])
        cache = model.new_cache(1, forced.shape[1], torch.float32, torch.device("cpu"))
        logits = decoding(forced, torch.arange(forced.shape[1])[None], cache)[0]
    return ours, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--llama-python", type=Path, required=True, help="has llama_cpp")
    parser.add_argument("--out", type=Path, default=Path("/tmp/llmrun-t5-bench"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = t5_folder(args.out / "flan", "flan", tokenizer_folder(args.out / "tokenizer"), 128)
    for kind in ("f32", "q8_0"):
        gguf_file = convert(
            args.converter, folder, args.out / f"flan-{kind}.gguf", "--outtype", kind
        )
        theirs = llama_cpp(args.llama_python, gguf_file)
        engine = api.load(str(gguf_file), text_to_text=True)
        ids = engine.tokenizer.encode(PROMPT) + [engine.tokenizer.eos_id]
        ours, logits = llmrun_steps(engine, ids, theirs["tokens"])
        steps = min(len(theirs["logits"]), logits.shape[0])
        diff = (logits[:steps] - torch.tensor(theirs["logits"][:steps])).abs().max().item()
        print(
            f"{kind}: prompt ids {'equal' if ids == theirs['ids'] else 'DIFFER'} "
            f"({len(ids)}), greedy tokens agree {agreeing(ours, theirs['tokens'])}/"
            f"{len(theirs['tokens'])}, max |logit diff| {diff:.2e} over {steps} steps "
            f"(logits span ±{logits.abs().max().item():.1f})"
        )


if __name__ == "__main__":
    main()
