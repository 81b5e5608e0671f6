"""A tiny random RWKV-7 written three ways from the same weights: as an fla-hub folder
(RWKV7ForCausalLM's config.json and keys, with the world vocabulary file), as llama.cpp's
converter writes that folder in GGUF, and as a BlinkDL .pth for the reference, BlinkDL's
`rwkv` package (rwkv.model.RWKV_x070, "cpu fp32"), which reads only .pth files; likewise
a tiny RWKV-6; both again with decays at the ends of their range, to prefill long prompts;
and the checks of a file against BlinkDL's logits and greedy tokens."""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import llama_converter
import pytest
import torch
from family_checks import max_diff
from helpers import cached_logits
from in_process import llmrun
from safetensors.torch import save_file

from llmrun.loading.loader import load_model
from llmrun.tokenizer import load_tokenizer

os.environ["RWKV_V7_ON"] = "1"  # read when rwkv.model is imported: RWKV is then RWKV-7
rwkv_model = pytest.importorskip("rwkv.model")
import rwkv  # noqa: E402

VOCAB_FILE = Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt"
HIDDEN, LAYERS, HEAD, FFN = 64, 2, 16, 256
RANKS = dict(decay_low_rank_dim=32, a_low_rank_dim=32, v_low_rank_dim=16, gate_low_rank_dim=32)
CONFIG = dict(
    architectures=["RWKV7ForCausalLM"],
    model_type="rwkv7",
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    head_dim=HEAD,
    intermediate_size=FFN,
    hidden_act="sqrelu",
    norm_eps=1e-5,
    norm_bias=True,
    norm_first=True,
    vocab_size=65536,  # the world vocabulary's 65,530 tokens and llama.cpp's [PADn] fillers
    tie_word_embeddings=False,
    **RANKS,
)
MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
CPU = torch.device("cpu")
PROMPT = "User: hi 🤗\n\nAssistant: def f(x):"
IDS = [33155, 40213, 34, 261, 7005, 10, 27106, 263, 2490, 111, 2509, 100, 9350, 2503, 4977, 4960]


def tiny_weights(seed: int = 0, config: dict = CONFIG) -> dict[str, torch.Tensor]:
    """Random weights under fla's keys, at scales where every part moves the logits."""
    g = torch.Generator().manual_seed(seed)
    hidden, head, ffn = config["hidden_size"], config["head_dim"], config["intermediate_size"]

    def rand(*shape: int, scale: float = 0.3, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale + shift

    w = {
        "model.embeddings.weight": rand(config["vocab_size"], hidden, scale=1.0),
        "model.layers.0.pre_norm.weight": rand(hidden, scale=0.1, shift=1.0),
        "model.layers.0.pre_norm.bias": rand(hidden, scale=0.1),
        "model.norm.weight": rand(hidden, scale=0.1, shift=1.0),
        "model.norm.bias": rand(hidden, scale=0.1),
        "lm_head.weight": rand(config["vocab_size"], hidden, scale=0.5),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            w[p + f"{norm}.weight"] = rand(hidden, scale=0.1, shift=1.0)
            w[p + f"{norm}.bias"] = rand(hidden, scale=0.1)
        for mix in MIXES:
            w[p + f"attn.{mix}"] = torch.rand(1, 1, hidden, generator=g)
        w[p + "attn.k_k"] = rand(hidden, scale=0.2, shift=0.8)
        w[p + "attn.k_a"] = rand(hidden, scale=0.2, shift=1.0)
        w[p + "attn.r_k"] = rand(hidden // head, head, scale=0.5)
        for proj in ("r_proj", "k_proj", "v_proj", "o_proj"):
            w[p + f"attn.{proj}.weight"] = rand(hidden, hidden, scale=0.2)
        loras = {"w_lora": "decay", "a_lora": "a", "g_lora": "gate"} | (
            {"v_lora": "v"} if i else {}
        )
        for lora, kind in loras.items():
            rank = config[f"{kind}_low_rank_dim"]
            w[p + f"attn.{lora}.lora.0.weight"] = rand(rank, hidden, scale=0.2)
            w[p + f"attn.{lora}.lora.2.weight"] = rand(hidden, rank, scale=0.2)
            if lora != "g_lora":
                w[p + f"attn.{lora}.lora.2.bias"] = rand(hidden, scale=0.5)
        w[p + "attn.g_norm.weight"] = rand(hidden, scale=0.1, shift=1.0)
        w[p + "attn.g_norm.bias"] = rand(hidden, scale=0.1)
        w[p + "ffn.x_k"] = torch.rand(hidden, generator=g)
        w[p + "ffn.key.weight"] = rand(ffn, hidden, scale=0.2)
        w[p + "ffn.value.weight"] = rand(hidden, ffn, scale=0.1)
    return w


def blinkdl_state_dict(weights: dict[str, torch.Tensor], layers: int = LAYERS) -> dict:
    """fla's keys -> BlinkDL's (RWKV-LM's RWKV-7 checkpoints): LoRAs as x @ w1 @ w2 + w0."""
    out = {
        "emb.weight": weights["model.embeddings.weight"],
        "blocks.0.ln0.weight": weights["model.layers.0.pre_norm.weight"],
        "blocks.0.ln0.bias": weights["model.layers.0.pre_norm.bias"],
        "ln_out.weight": weights["model.norm.weight"],
        "ln_out.bias": weights["model.norm.bias"],
        "head.weight": weights["lm_head.weight"],
    }
    names = {"r_proj": "receptance", "k_proj": "key", "v_proj": "value", "o_proj": "output"}
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        for norm, theirs in (
            ("attn_norm", "ln1"),
            ("ffn_norm", "ln2"),
            ("attn.g_norm", "att.ln_x"),
        ):
            out[b + f"{theirs}.weight"] = weights[p + f"{norm}.weight"]
            out[b + f"{theirs}.bias"] = weights[p + f"{norm}.bias"]
        for name in (*MIXES, "k_k", "k_a", "r_k"):
            out[b + f"att.{name}"] = weights[p + f"attn.{name}"]
        for ours, theirs in names.items():
            out[b + f"att.{theirs}.weight"] = weights[p + f"attn.{ours}.weight"]
        for letter in "wavg":
            lora = p + f"attn.{letter}_lora.lora."
            if lora + "0.weight" not in weights:
                continue
            out[b + f"att.{letter}1"] = weights[lora + "0.weight"].t().contiguous()
            out[b + f"att.{letter}2"] = weights[lora + "2.weight"].t().contiguous()
            if lora + "2.bias" in weights:
                out[b + f"att.{letter}0"] = weights[lora + "2.bias"]
        out[b + "ffn.x_k"] = weights[p + "ffn.x_k"]
        out[b + "ffn.key.weight"] = weights[p + "ffn.key.weight"]
        out[b + "ffn.value.weight"] = weights[p + "ffn.value.weight"]
    return out


def folder_of(tmp_path_factory, config: dict = CONFIG) -> Path:
    """The tiny model's fla-hub folder and its BlinkDL .pth (ref.pth beside it), written
    once a test session."""
    folder = tmp_path_factory.getbasetemp() / "rwkv7" / "folder"
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        weights = tiny_weights(config=config)
        save_file(weights, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(config))
        shutil.copy(VOCAB_FILE, folder / VOCAB_FILE.name)
        layers = config["num_hidden_layers"]
        torch.save(blinkdl_state_dict(weights, layers), folder.parent / "ref.pth")
    return folder


# The converter keeps RWKV-6's and RWKV-7's token-shift mixes in a dict on its class, so a
# second conversion in the same process would find the first one's: each model gets its own.
_FRESH_MIXES = """
import conversion.rwkv as rwkv_conversion
def _fresh_mixes(cls):
    init = cls.__init__
    def fresh(self, *args, **kwargs):
        self.lerp_weights = {}
        init(self, *args, **kwargs)
    cls.__init__ = fresh
for _cls in (rwkv_conversion.Rwkv6Model, rwkv_conversion.Rwkv7Model):
    _fresh_mixes(_cls)
"""


def converted(tmp_path_factory) -> dict[str, Path]:
    """llama.cpp's converter's GGUFs of folder_of's folder: "f32" and "q8_0"."""
    return _converted_both(tmp_path_factory)["rwkv7"]


def reference(tmp_path_factory):
    """BlinkDL's RWKV-7 of the tiny model, on CPU in float32."""
    folder_of(tmp_path_factory)
    path = tmp_path_factory.getbasetemp() / "rwkv7" / "ref"
    return rwkv_model.RWKV(str(path), "cpu fp32")


# RWKV-6: the Hugging Face port's Rwkv6ForCausalLM folder (RWKV/v6-Finch-*-HF: rwkv.* keys,
# BlinkDL's shapes) and a BlinkDL .pth for the reference. The converter fixes the low-rank
# sizes at 32 (the mixes) and 64 (the decay) below hidden 4096; rescale_every 1 divides
# block i's output matrices by 2^i, which llmrun undoes as llama.cpp does.
CONFIG6 = dict(
    architectures=["Rwkv6ForCausalLM"],
    model_type="rwkv6",
    hidden_size=HIDDEN,
    attention_hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    head_size=HEAD,
    head_size_divisor=8,
    intermediate_size=FFN,
    layer_norm_epsilon=1e-5,
    rescale_every=1,
    vocab_size=65536,
    tie_word_embeddings=False,
)
MIX_RANK, DECAY_RANK = 32, 64


def tiny_weights6(seed: int = 0, config: dict = CONFIG6) -> dict[str, torch.Tensor]:
    """Random RWKV-6 weights under BlinkDL's keys (blocks.N.att.*, ...)."""
    g = torch.Generator().manual_seed(seed)
    hidden, head, ffn = config["hidden_size"], config["head_size"], config["intermediate_size"]

    def rand(*shape: int, scale: float = 0.3, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale + shift

    w = {
        "emb.weight": rand(config["vocab_size"], hidden, scale=1.0),
        "blocks.0.ln0.weight": rand(hidden, scale=0.1, shift=1.0),
        "blocks.0.ln0.bias": rand(hidden, scale=0.1),
        "ln_out.weight": rand(hidden, scale=0.1, shift=1.0),
        "ln_out.bias": rand(hidden, scale=0.1),
        "head.weight": rand(config["vocab_size"], hidden, scale=0.5),
    }
    for i in range(config["num_hidden_layers"]):
        b = f"blocks.{i}."
        for norm in ("ln1", "ln2", "att.ln_x"):
            w[b + f"{norm}.weight"] = rand(hidden, scale=0.1, shift=1.0)
            w[b + f"{norm}.bias"] = rand(hidden, scale=0.1)
        for mix in ("x", "w", "k", "v", "r", "g"):
            w[b + f"att.time_maa_{mix}"] = torch.rand(1, 1, hidden, generator=g)
        w[b + "att.time_maa_w1"] = rand(hidden, 5 * MIX_RANK, scale=0.2)
        w[b + "att.time_maa_w2"] = rand(5, MIX_RANK, hidden, scale=0.2)
        w[b + "att.time_decay"] = rand(1, 1, hidden, scale=0.5, shift=-1.0)
        w[b + "att.time_decay_w1"] = rand(hidden, DECAY_RANK, scale=0.2)
        w[b + "att.time_decay_w2"] = rand(DECAY_RANK, hidden, scale=0.2)
        w[b + "att.time_faaaa"] = rand(hidden // head, head, scale=0.5)
        for proj in ("receptance", "key", "value", "gate", "output"):
            w[b + f"att.{proj}.weight"] = rand(hidden, hidden, scale=0.2)
        for mix in ("k", "r"):
            w[b + f"ffn.time_maa_{mix}"] = torch.rand(1, 1, hidden, generator=g)
        w[b + "ffn.key.weight"] = rand(ffn, hidden, scale=0.2)
        w[b + "ffn.receptance.weight"] = rand(hidden, hidden, scale=0.2)
        w[b + "ffn.value.weight"] = rand(hidden, ffn, scale=0.1)
    return w


def hf_state_dict6(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BlinkDL's keys -> the Hugging Face port's (same shapes)."""
    out = {}
    for name, w in weights.items():
        name = name.replace("blocks.0.ln0", "blocks.0.pre_ln").replace(".att.", ".attention.")
        name = name.replace(".ffn.", ".feed_forward.")
        if name == "emb.weight":
            name = "embeddings.weight"
        out[name if name == "head.weight" else f"rwkv.{name}"] = w.contiguous()
    return out


def folder6_of(tmp_path_factory, config: dict = CONFIG6) -> Path:
    """The tiny RWKV-6's folder and its BlinkDL .pth (ref.pth beside it), once a session."""
    folder = tmp_path_factory.getbasetemp() / "rwkv6" / "folder"
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        weights = tiny_weights6(config=config)
        save_file(hf_state_dict6(weights), folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(config))
        shutil.copy(VOCAB_FILE, folder / VOCAB_FILE.name)
        torch.save(weights, folder.parent / "ref.pth")
    return folder


def converted6(tmp_path_factory) -> dict[str, Path]:
    """llama.cpp's converter's GGUFs of folder6_of's folder: "f32" and "q8_0"."""
    return _converted_both(tmp_path_factory)["rwkv6"]


def _converted_both(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Both tiny models' GGUFs by family and type, converted once a session in one
    converter process (its imports take most of its time)."""
    folders = {"rwkv7": folder_of(tmp_path_factory), "rwkv6": folder6_of(tmp_path_factory)}
    files = {
        family: {t: folder.parent / f"{family}-{t}.gguf" for t in ("f32", "q8_0")}
        for family, folder in folders.items()
    }
    if not all(path.is_file() for kinds in files.values() for path in kinds.values()):
        runs = [
            [folders[family], "--outfile", path, "--outtype", t]
            for family, kinds in files.items()
            for t, path in kinds.items()
        ]
        llama_converter.convert(runs, llama_converter.TINY_VOCAB + _FRESH_MIXES)
    return files


@functools.cache
def rwkv6_class():
    """BlinkDL's generic RWKV class (v4 to v6), from a second copy of rwkv.model imported
    without RWKV_V7_ON (under which rwkv.model.RWKV is RWKV-7's); imported once (its
    TorchScript takes seconds), as an instance reads RWKV_RESCALE_LAYER itself."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rwkv_model_v6", rwkv_model.__file__)
    module = importlib.util.module_from_spec(spec)
    os.environ["RWKV_V7_ON"] = "0"
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ["RWKV_V7_ON"] = "1"
    return module.RWKV


def reference_logits(ref, ids: list[int]) -> torch.Tensor:
    """The reference's logits [tokens, vocab] of `ids` from a zero state."""
    logits, _ = ref.forward(list(ids), None, full_output=True)
    return logits.float()


def reference_greedy(ref, ids: list[int], tokens: int) -> list[int]:
    """The reference's `tokens` greedy tokens after `ids`."""
    logits, state = ref.forward(list(ids), None)
    out = []
    for _ in range(tokens):
        out.append(int(logits.argmax()))
        logits, state = ref.forward([out[-1]], state)
    return out


def run_greedy_ids(path: Path, tokens: int) -> list[int]:
    """The ids of `llmrun run`'s greedy tokens (at most `tokens`) after PROMPT."""
    result = llmrun(
        "run", str(path), PROMPT, "--raw", "-n", str(tokens), "--temperature", "0",
        "--json", "--logprobs", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [entry["id"] for entry in json.loads(result.stdout)["logprobs"]]


def check_gguf_matches_reference(ref, path: Path):
    """The GGUF's logits of IDS at once, then of each token through the state, within 1e-4
    of the reference's; `llmrun run`'s 8 greedy tokens are its greedy tokens. Returns the
    loaded model."""

    model = load_model(path, CPU, "f32").model
    expected = reference_logits(ref, IDS)
    with torch.no_grad():
        whole = model(torch.tensor([IDS]), torch.arange(len(IDS))[None])[0]
        cache = model.new_cache(1, 64, torch.float32, CPU)
        steps = [
            model(torch.tensor([[t]]), torch.tensor([[i]]), cache)[0, 0] for i, t in enumerate(IDS)
        ]
    assert max_diff(whole, expected) < 1e-4
    assert max_diff(torch.stack(steps), expected) < 1e-4
    got = run_greedy_ids(path, 8)
    want = reference_greedy(ref, load_tokenizer(path).encode(PROMPT), 8)
    # `run` stops at an end of generation (llama.cpp's: id 0, and 261, "\n\n")
    stop = next((i + 1 for i, t in enumerate(want) if t in (0, 261)), len(want))
    assert got == want[:stop]
    return model


def check_folder_matches_reference(ref, folder: Path, gguf_path: Path) -> None:
    """The folder's logits of IDS within 1e-4 of the reference's, its ids of PROMPT the
    GGUF's, and `llmrun run`'s greedy tokens (up to 4) the reference's."""

    model = load_model(folder, CPU, "f32").model
    with torch.no_grad():
        logits = model(torch.tensor([IDS]), torch.arange(len(IDS))[None])[0]
    assert max_diff(logits, reference_logits(ref, IDS)) < 1e-4
    prompt_ids = load_tokenizer(folder).encode(PROMPT)
    assert prompt_ids == load_tokenizer(gguf_path).encode(PROMPT)
    got = run_greedy_ids(folder, 4)
    assert got == reference_greedy(ref, prompt_ids, 4)[: len(got)] and got


# The extreme-decay models' vocabulary (they take ids; no tokenizer) and prompt: 100 tokens,
# several of the prefill's chunks (llmrun.models.rwkv7.CHUNK, rwkv6.CHUNK).
DECAY_VOCAB = 512
LONG_IDS = torch.randint(
    0, DECAY_VOCAB, (100,), generator=torch.Generator().manual_seed(1)
).tolist()


def extreme_decays7(tmp_path_factory) -> tuple[Path, object]:
    """A tiny RWKV-7 folder whose decays reach both ends of their range, and BlinkDL's
    reference of it: in every head, every fourth channel decays as fast as RWKV-7 can
    (w0 = 12: w = e^-e^-0.5 = 0.55 a token) and the next one barely (w0 = -12: w = 1 - 4e-6)."""
    config = CONFIG | dict(vocab_size=DECAY_VOCAB)
    weights = tiny_weights(config=config)
    for i in range(LAYERS):
        w0 = weights[f"model.layers.{i}.attn.w_lora.lora.2.bias"]
        w0[0::4], w0[1::4] = 12.0, -12.0
    base = tmp_path_factory.mktemp("rwkv7-decays")
    (base / "folder").mkdir()
    save_file(weights, base / "folder" / "model.safetensors")
    (base / "folder" / "config.json").write_text(json.dumps(config))
    torch.save(blinkdl_state_dict(weights), base / "ref.pth")
    return base / "folder", rwkv_model.RWKV(str(base / "ref"), "cpu fp32")


def extreme_decays6(tmp_path_factory) -> tuple[Path, object]:
    """A tiny RWKV-6 folder (the Hugging Face port's) whose decays reach both ends, and
    BlinkDL's reference of it: in every head, every fourth channel forgets at once
    (time_decay 100: w = e^-e^100, 0), the next nearly (3: w = 2e-9) and the next barely
    (-12: w = 1 - 6e-6)."""
    config = CONFIG6 | dict(vocab_size=DECAY_VOCAB)
    weights = tiny_weights6(config=config)
    for i in range(LAYERS):
        decay = weights[f"blocks.{i}.att.time_decay"][0, 0]
        decay[0::4], decay[1::4], decay[2::4] = 100.0, 3.0, -12.0
    base = tmp_path_factory.mktemp("rwkv6-decays")
    (base / "folder").mkdir()
    save_file(hf_state_dict6(weights), base / "folder" / "model.safetensors")
    (base / "folder" / "config.json").write_text(json.dumps(config))
    torch.save(weights, base / "ref.pth")
    return base / "folder", rwkv6_class()(str(base / "ref"), "cpu fp32")


def check_chunked_prefill(model, ref) -> None:
    """LONG_IDS's logits at once, and through a cache in prefills of 45 and 50 tokens (the
    second from the first's state) then decode steps, within 1e-4 of the reference's; the
    state after a prefill of them all is the state after their tokens one at a time (1e-5
    of its largest value)."""
    ids, count = torch.tensor([LONG_IDS]), len(LONG_IDS)
    expected = reference_logits(ref, LONG_IDS)
    prefilled = model.new_cache(1, count, torch.float32, CPU)
    stepped = model.new_cache(1, count, torch.float32, CPU)
    with torch.no_grad():
        whole = model(ids, torch.arange(count)[None], prefilled)[0]
        for i, token in enumerate(LONG_IDS):
            model(torch.tensor([[token]]), torch.tensor([[i]]), stepped)
    assert max_diff(whole, expected) < 1e-4
    assert max_diff(cached_logits(model, ids, (45, 50), count)[0], expected) < 1e-4
    for layer, parts in stepped.recurrent.tensors.items():
        for got, want in zip(prefilled.recurrent.tensors[layer], parts, strict=True):
            assert max_diff(got, want) <= 1e-5 * want.abs().max().item()
