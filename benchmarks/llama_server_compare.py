"""The shared half of the scripts that hold llmrun to llama.cpp on one tiny model: run
llama.cpp's converter, start llama-server with exact settings, ask its /completion for
greedy tokens (with images or audio), run llmrun's engine greedily with log-probabilities,
and count where the two agree.

llama-server reports no probability for a step whose token ends inside a UTF-8 character:
its probability entries are matched to llmrun's steps by token id, in order, never by
position.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizer_fuzz import Server

# f32 KV cache and no flash attention (llama.cpp's arithmetic closest to llmrun's f32),
# greedy unless a request says otherwise.
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off", "--temp", "0")


def arguments(doc: str, out: Path) -> argparse.Namespace:
    """The command line of a script comparing llmrun with llama.cpp's converter and
    llama-server (`doc`: its docstring): --llama-cpp, --converter and --out (`out`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="its bin/ folder")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--out", type=Path, default=out)
    return parser.parse_args()


class LlamaServer(Server):
    """llama-server (from the bin/ folder `llama_cpp`) on `model` with EXACT settings and
    `extra` arguments, with `mmproj` for images or audio; closes as a context manager."""

    def __init__(
        self, llama_cpp: Path, model: Path, log: Path, *extra: str, mmproj: Path | None = None
    ) -> None:
        media = ("--mmproj", str(mmproj)) if mmproj is not None else ()
        super().__init__(llama_cpp / "llama-server", model, log, (*media, *EXACT, *extra))
        # The server's own media marker (random unless LLAMA_MEDIA_MARKER pins it): a
        # prompt's image or clip place is replaced by it.
        self.media_marker = ""
        if mmproj is not None:
            url = f"http://127.0.0.1:{self.port}/props"
            with urllib.request.urlopen(url, timeout=10) as response:
                self.media_marker = json.loads(response.read())["media_marker"]

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def greedy_completion(
    server: Server,
    prompt: str | list[int],
    media: Sequence[bytes] = (),
    tokens: int = 8,
    n_probs: int = 1,
) -> dict:
    """llama-server's /completion answer for `prompt` (text with server.media_marker at
    each of `media`'s images or clips, or ids): `tokens` greedy tokens, their ids, and
    the `n_probs` best log-probabilities of each step (none for n_probs=0)."""
    if media:
        encoded = [base64.b64encode(data).decode() for data in media]
        prompt = {"prompt_string": prompt, "multimodal_data": encoded}
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "top_k": 1}
    body |= {"return_tokens": True, "cache_prompt": False}
    if n_probs:
        body["n_probs"] = n_probs
    return server._post("/completion", body)


def llmrun_greedy(engine, ids: list[int], tokens: int = 8, images=None, top: int = 0):
    """llmrun's greedy tokens for the prompt `ids` (with `images`, the PromptImages of
    image_prompt or audio_prompt) and their log-probabilities with the `top` best of
    each step (TokenLogprob; a token is reported once its text is complete)."""
    from llmrun.sampling import SamplingParams

    stream = list(
        engine.generate(ids, SamplingParams(temperature=0.0), tokens, logprobs=top, images=images)
    )
    ours = [r.token for r in stream if r.token is not None]
    return ours, [lp for r in stream for lp in r.logprobs]


def agreeing(ours: list[int], theirs: list[int]) -> int:
    """How many leading tokens agree (all of the shorter list where one ends first)."""
    pairs = zip(ours, theirs, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))


def matched_steps(chosen: list, answer: dict) -> list[tuple]:
    """(llmrun's TokenLogprob, llama-server's probability entry) of each step both
    report, among the tokens that agree from the start: the server's entries matched to
    llmrun's steps by token id, in order."""
    ours = [lp.token for lp in chosen]
    agree = agreeing(ours, answer["tokens"])
    pairs, cursor = [], 0
    for entry in answer.get("completion_probabilities", []):
        while cursor < agree and ours[cursor] != entry["id"]:
            cursor += 1
        if cursor == agree:
            break
        pairs.append((chosen[cursor], entry))
        cursor += 1
    return pairs


def agreement(ours: list[int], chosen: list, answer: dict) -> dict:
    """Both engines' greedy tokens, how many agree from the start and, where the server
    sent probabilities, the largest difference of the agreeing tokens' log-probabilities."""
    record = dict(llmrun=ours, llama_cpp=answer["tokens"])
    record["tokens_agreeing"] = agreeing(ours, answer["tokens"])
    if "completion_probabilities" in answer:
        diffs = [abs(lp.logprob - entry["logprob"]) for lp, entry in matched_steps(chosen, answer)]
        record["max_abs_logprob_diff"] = max(diffs, default=None)
    return record


def describe(record: dict, tokens: int = 8) -> str:
    """A line for a compared prompt: agreeing tokens, log-probability difference (where
    measured) and both prompts' lengths."""
    line = f"{record['tokens_agreeing']}/{tokens} greedy tokens agree"
    if "max_abs_logprob_diff" in record:
        diff = record["max_abs_logprob_diff"]
        line += f", |logprob diff| {'-' if diff is None else f'{diff:.2e}'}"
    return (
        f"{line}, prompt tokens {record['prompt_tokens_llmrun']} (llmrun) / "
        f"{record['prompt_tokens_llama_cpp']} (llama.cpp)"
    )


def max_top_logprob_diff(chosen: list, answer: dict) -> float | None:
    """The largest difference of the top log-probabilities of the tokens both engines list
    at the same agreeing step (None where no token is in both)."""
    diffs = [
        abs(dict(lp.top)[t["id"]] - t["logprob"])
        for lp, entry in matched_steps(chosen, answer)
        for t in entry["top_logprobs"]
        if t["id"] in dict(lp.top)
    ]
    return max(diffs, default=None)


def convert(converter: Path, folder: Path, out: Path, *flags: str) -> Path:
    """`folder` through llama.cpp's converter (the source tree `converter`, with its own
    gguf-py) into `out`, with `flags` such as --mmproj or --outtype f32."""
    env = {**os.environ, "PYTHONPATH": str(converter / "gguf-py")}
    command = [sys.executable, str(converter / "convert_hf_to_gguf.py"), str(folder)]
    subprocess.run(
        [*command, *flags, "--outfile", str(out)], check=True, env=env, capture_output=True
    )
    return out


def same_tower(from_mmproj, ours: Path, converted: Path) -> bool:
    """Whether two mmproj files give llmrun the same tower (`from_mmproj`: the family's
    loader)."""
    import torch

    a = from_mmproj(ours, 64).encoder.state_dict()
    b = from_mmproj(converted, 64).encoder.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def gguf_contents(path: Path) -> tuple[dict, dict]:
    """A GGUF's metadata (but general.*) and its tensors: name -> (type, shape, data)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith(("GGUF.", "general."))
    }
    tensors = {t.name: (t.tensor_type.name, list(t.shape), t.data) for t in reader.tensors}
    return meta, tensors


def converter_agreement(converted: Path, ours: Path) -> dict:
    """Where the converter's mmproj and the tests' (write_mmproj) differ."""
    meta_a, tensors_a = gguf_contents(converted)
    meta_b, tensors_b = gguf_contents(ours)
    return dict(
        metadata_differing=sorted(
            k for k in meta_a.keys() | meta_b.keys() if meta_a.get(k) != meta_b.get(k)
        ),
        tensors_only_in_converter=sorted(tensors_a.keys() - tensors_b.keys()),
        tensors_only_in_write_mmproj=sorted(tensors_b.keys() - tensors_a.keys()),
        tensors_differing=sorted(
            name
            for name in tensors_a.keys() & tensors_b.keys()
            if tensors_a[name][:2] != tensors_b[name][:2]
            or not np.array_equal(tensors_a[name][2], tensors_b[name][2])
        ),
        tensors_compared=len(tensors_a.keys() & tensors_b.keys()),
    )


def clip_layout(theirs: Path, ours: Path) -> dict:
    """Where the converter's mmproj (`theirs`) and the tests' (`ours`) differ: clip.*
    metadata, tensors missing from `ours` or of another type or value, and those only in
    `ours`."""
    import gguf

    a, b = gguf.GGUFReader(theirs), gguf.GGUFReader(ours)
    meta = {
        name: (a.fields[name].contents(), b.fields[name].contents() if name in b.fields else None)
        for name in a.fields
        if name.startswith("clip.")
    }
    tensors_a = {t.name: t for t in a.tensors}
    tensors_b = {t.name: t for t in b.tensors}
    differing = [
        name
        for name, t in tensors_a.items()
        if name not in tensors_b
        or t.tensor_type != tensors_b[name].tensor_type
        or not np.array_equal(np.asarray(t.data), np.asarray(tensors_b[name].data))
    ]
    return {
        "metadata_differing": [k for k, (x, y) in meta.items() if x != y],
        "tensors": len(tensors_a),
        "tensors_only_ours": sorted(set(tensors_b) - set(tensors_a)),
        "tensors_differing": differing,
    }


def against_transformers(model, inputs: dict, token: int, engine, ids: list[int], media) -> dict:
    """llmrun's logits for the prompt `ids` with `media` (PromptImages) against those of
    the transformers `model` on the processor's `inputs`, and the media embeddings, the
    language model's input rows of the placeholder `token`, against llmrun's."""
    import torch

    taken = {}

    def keep(module, args, kwargs) -> None:
        taken["embeds"] = kwargs["inputs_embeds"][0]

    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            expected = model(**inputs).logits[0]
            got = engine.model(
                torch.tensor([ids]),
                torch.arange(len(ids))[None],
                images=media.tokens(0, len(ids), torch.device("cpu")),
            )[0]
    finally:
        hook.remove()
    rows = taken["embeds"][inputs["input_ids"][0] == token]
    return {
        "same_ids": ids == inputs["input_ids"][0].tolist(),
        "embeddings_max_abs_diff": float((media.embeds[0] - rows).abs().max()),
        "logits_max_abs_diff": float((got - expected).abs().max()),
        "logits_max_abs": float(expected.abs().max()),
    }


def image_logits_difference(model, engine, model_inputs, image, question: str) -> float:
    """The largest |logit difference| of the transformers `model` and llmrun's `engine`
    for the prompt of `question` about `image` (`model_inputs(vision, ids, images)`: the
    family's transformers inputs for llmrun's ids)."""
    import torch

    ids, images = engine.image_prompt(engine.prompt_text(question, images=1), [image])
    inputs = model_inputs(engine.vision, ids, [image])
    with torch.no_grad():
        expected = model(**inputs).logits[0]
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            cache=engine.model.new_cache(1, len(ids), torch.float32, "cpu"),
            images=images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
    return (ours - expected).abs().max().item()


def hub_tower_names(folder: Path, tower: str) -> None:
    """Rename the weights under `tower` in the folder's model.safetensors as the Hub's
    files name them, under `tower`vision_model. (transformers 5 saves them without that
    level), the names llama.cpp's converter maps."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    state = {
        (tower + "vision_model." + k[len(tower) :] if k.startswith(tower) else k): v
        for k, v in load_file(file).items()
    }
    save_file(state, file, metadata={"format": "pt"})
