"""Mistral's native folders (params.json, consolidated.safetensors, tekken.json) against two
independent references: transformers on the same model's Hugging Face folder, and llmrun on
the GGUF that llama.cpp's converter writes of the native folder (`--mistral-format`). The
native folder is written from a tiny random transformers model by the documented mapping
(mistral-inference's names; q/k rows in the interleaved-pair RoPE layout, which is
llama.cpp's permutation of Hugging Face's). Chats are checked against mistral_common's
token ids for each tekken.json version llmrun knows the format of.
"""

import datetime
import json
import shutil
from pathlib import Path

import llama_converter
import pytest
import torch
from helpers import _permute, needs_converter, randomize
from in_process import llmrun
from safetensors.torch import save_file
from test_tekken import write_tekken

from llmrun.api import load
from llmrun.loading import gguf_io, inspect, mistral_native
from llmrun.loading.loader import load_model
from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
from mistral_common.protocol.instruct.messages import (  # noqa: E402
    AssistantMessage,
    SystemMessage,
    UserMessage,
)
from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402

VOCAB = 3040  # write_tekken's tokens: 3000 ranks after 40 special ids
# A large epsilon, so that a model reading another (or the default) differs visibly.
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=0.25,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
PARAMS = dict(
    dim=64,
    n_layers=2,
    head_dim=16,
    hidden_dim=96,
    n_heads=4,
    n_kv_heads=2,
    norm_eps=0.25,
    vocab_size=VOCAB,
    rope_theta=1000000.0,
    max_position_embeddings=256,
)
# Ministral 3: YaRN over an original context of 16, Llama 4's query temperature past it.
YARN = dict(original_max_position_embeddings=16, factor=4.0, beta=32.0, alpha=1.0)
MINISTRAL3_ROPE = dict(
    rope_type="yarn",
    rope_theta=1000000.0,
    factor=4.0,
    original_max_position_embeddings=16,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
    llama_4_scaling_beta=0.1,
)
IDS = torch.randint(40, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
LAYER_NAMES = {v: k for k, v in mistral_native._LAYER_NAMES.items()}


def hf_model(model_type: str = "mistral", **overrides):
    config = transformers.AutoConfig.for_model(model_type=model_type, **{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def native_tensors(hf) -> dict[str, torch.Tensor]:
    """The transformers model's weights under mistral-inference's names, q/k rows permuted
    into the interleaved-pair layout (llama.cpp's LlamaModel.permute); no output head where
    the embeddings are tied."""
    config = hf.config
    tensors = {}
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            native = "tok_embeddings.weight"
        elif name == "model.norm.weight":
            native = "norm.weight"
        elif name == "lm_head.weight":
            native = "output.weight"
        else:
            _, _, layer, module, *rest = name.split(".")
            part = ".".join([module, *rest]).removesuffix(".weight")
            native = f"layers.{layer}.{LAYER_NAMES[part]}.weight"
        if name.endswith("q_proj.weight"):
            tensor = torch.from_numpy(_permute(tensor.numpy(), config.num_attention_heads))
        elif name.endswith("k_proj.weight"):
            tensor = torch.from_numpy(_permute(tensor.numpy(), config.num_key_value_heads))
        tensors[native] = tensor.contiguous()
    return tensors


def write_native(hf, path: Path, shards: int = 1, extra: dict | None = None, **params) -> Path:
    """A native folder of `hf`: params.json (PARAMS and `params`; None leaves a key out),
    consolidated.safetensors (or `shards` consolidated-0000N-of-0000M files) with `extra`
    tensors, and write_tekken's tekken.json."""
    write_tekken(path)
    tensors = {**native_tensors(hf), **(extra or {})}
    names = sorted(tensors)
    for i in range(shards):
        name = (
            f"consolidated-{i + 1:05d}-of-{shards:05d}.safetensors"
            if shards > 1
            else "consolidated.safetensors"
        )
        save_file({n: tensors[n] for n in names[i::shards]}, path / name)
    values = {k: v for k, v in {**PARAMS, **params}.items() if v is not None}
    (path / "params.json").write_text(json.dumps(values))
    return path


def convert(folder: Path, out: Path) -> Path:
    """llama.cpp's GGUF of a native folder (F32), as its converter writes it."""
    flags = ["--outfile", str(out), "--outtype", "f32", "--disable-mistral-community-chat-template"]
    llama_converter.convert([["--mistral-format", folder, *flags]])
    return out


def logits(path, ids: torch.Tensor = IDS) -> torch.Tensor:
    model = load_model(path, torch.device("cpu")).model
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None], None)


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    hf = hf_model()
    return hf, write_native(hf, tmp_path_factory.mktemp("native"))


@needs_converter
def test_the_native_folder_is_the_hf_folders_model_and_the_converters(mistral, tmp_path):
    hf, folder = mistral
    ours = logits(folder)
    assert (ours - reference(hf)).abs().max() < 1e-4
    assert torch.equal(ours, logits(convert(folder, tmp_path / "m.gguf")))


def test_run_picks_transformers_greedy_tokens(mistral):
    """`llmrun run FOLDER PROMPT -n 8 --temperature 0 --raw` picks transformers' 8 greedy
    ids after the prompt as tekken.json encodes it (BOS first)."""
    hf, folder = mistral
    prompt = load_tokenizer(folder).encode("Once upon a time")
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    result = llmrun(
        "run", str(folder), "Once upon a time", "-n", "8", "--temperature", "0", "--raw",
        "--json", "--logprobs", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == out[
        0, len(prompt) :
    ].tolist()


@pytest.mark.parametrize("bug", ["q/k rows left interleaved", "norm_eps not read"])
def test_a_planted_bug_fails_the_comparison(mistral, monkeypatch, bug):
    hf, folder = mistral
    if bug == "q/k rows left interleaved":
        monkeypatch.setattr(gguf_io, "unpermute_rows", lambda rows, heads: rows)
    else:
        read = mistral_native.hf_config
        monkeypatch.setattr(
            mistral_native,
            "hf_config",
            lambda params, where: {
                k: v for k, v in read(params, where).items() if k != "rms_norm_eps"
            },
        )
    assert (logits(folder) - reference(hf)).abs().max() > 1e-2


def test_shards_a_sliding_window_and_tied_embeddings(tmp_path):
    """Shards load as one; params.json's sliding_window is MistralConfig's (transformers
    masks past it, as llmrun does; llama.cpp's converter drops it); tied_embeddings, with
    no output.weight, ties the head to the embeddings."""
    hf = hf_model(sliding_window=5, tie_word_embeddings=True)
    folder = write_native(hf, tmp_path, shards=2, sliding_window=5, tied_embeddings=True)
    assert (logits(folder) - reference(hf)).abs().max() < 1e-4


@needs_converter
def test_ministral3_yarn_and_query_temperature(tmp_path):
    """params.json's yarn and llama_4_scaling: Ministral3ForCausalLM's YaRN and Llama 4
    temperature (40 positions: steps 0 to 2 of the original 16), and llama.cpp's
    "mistral3" GGUF of the folder."""
    hf = hf_model("ministral3", rope_parameters=MINISTRAL3_ROPE)
    scaling = dict(original_max_position_embeddings=16, beta=0.1)
    folder = write_native(
        hf, tmp_path / "native", yarn={**YARN, "apply_scale": False}, llama_4_scaling=scaling
    )
    ours = logits(folder)
    assert (ours - reference(hf)).abs().max() < 1e-4
    assert torch.equal(ours, logits(convert(folder, tmp_path / "m.gguf")))


def test_a_vision_folder_runs_its_language_model_with_a_note(mistral, tmp_path):
    hf, plain = mistral
    tower = {"vision_encoder.transformer.layers.0.attention.wq.weight": torch.zeros(8, 8)}
    folder = write_native(hf, tmp_path, extra=tower, vision_encoder={"hidden_size": 8})
    result = llmrun("run", str(folder), "Hello", "-n", "4", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "a multimodal Mistral; running its language model, without the vision" in result.stderr
    alone = llmrun("run", str(plain), "Hello", "-n", "4", "--temperature", "0")
    assert result.stdout == alone.stdout
    assert inspect.describe(folder)["parameters"] == inspect.describe(plain)["parameters"]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(params={"dim": None}), "params.json: no dim, which a Mistral model needs"),
        (dict(params={"rope_theta": None}), "params.json: no rope_theta"),
        (dict(params={"vocab_size": 3100}), "vocab_size is 3100, but tok_embeddings.weight has"),
        (dict(params={"n_heads": 6}), "64 query or key rows do not split into 6 heads"),
        (dict(params={"moe": {"num_experts": 8}}), "mixture-of-experts model (moe) is not"),
        (
            dict(params={"quantization": {"qformat_weight": "fp8_e4m3"}}),
            "quantized weights (fp8_e4m3) are not supported",
        ),
        (dict(drop="consolidated-00002-of-00002.safetensors"), "only 1 of the 2 consolidated"),
        (dict(drop="consolidated-00001-of-00002.safetensors"), "only 1 of the 2 consolidated"),
        (dict(extra={"layers.0.attention.wqkv.weight": torch.zeros(2)}), "'layers.0.attention"),
    ],
)
def test_a_bad_folder_is_one_error_line(mistral, tmp_path, change, message):
    hf, _ = mistral
    folder = write_native(
        hf, tmp_path, shards=2, extra=change.get("extra"), **change.get("params", {})
    )
    if "drop" in change:
        (folder / change["drop"]).unlink()
    result = llmrun("run", str(folder), "Hello", "-n", "2")
    assert result.returncode != 0
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: ")
    assert message in result.stderr


def test_a_tekken_json_past_the_models_vocabulary_is_refused(mistral, tmp_path):
    hf, _ = mistral
    folder = write_native(hf, tmp_path)
    data = json.loads((folder / "tekken.json").read_text())
    data["config"]["default_vocab_size"] = VOCAB + 20
    (folder / "tekken.json").write_text(json.dumps(data))
    result = llmrun("run", str(folder), "Hello", "-n", "2")
    assert result.returncode != 0 and len(result.stderr.splitlines()) == 1
    assert "3060 tokens, more than params.json's vocab_size 3040" in result.stderr


def test_show_describes_a_native_folder(mistral):
    hf, folder = mistral
    result = llmrun("show", str(folder))
    assert result.returncode == 0, result.stderr
    info = inspect.describe(folder)
    assert info["architecture"] == "mistral"
    assert info["context_length"] == 256
    assert info["parameters"] == sum(p.numel() for p in hf.parameters())
    assert info["tokenizer"] == "BPE (tekken.json)"
    assert info["chat_template"] == mistral_native.CHAT_TEMPLATES["v13"]
    # 2 layers x 2 (k, v) x 2 heads x 16 x 4 bytes a position
    assert info["kv_cache_bytes_8k"] == 8192 * 2 * 2 * 2 * 16 * 4


CONVERSATIONS = [
    [("system", "Be brief."), ("user", "Hi there"), ("assistant", "Hello!"), ("user", "And you?")],
    [("user", "  Hi there \n"), ("assistant", " Hello! \n"), ("user", "x ")],
    [("system", "S1"), ("system", " S2 \n"), ("user", "U1"), ("user", "U2")],
    [("assistant", "A1"), ("assistant", "A2"), ("user", "U")],
    [("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2"), ("user", "U3")],
]
MESSAGES = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}


@pytest.mark.parametrize("version", ["v3", "v7", "v11", "v13"])
def test_chat_ids_are_mistral_commons(mistral, tmp_path, version):
    """Mistral's format for a folder without chat_template.jinja: the prompt ids of each
    conversation are those mistral_common's encode_chat_completion gives."""
    _, base = mistral
    folder = shutil.copytree(base, tmp_path / "native")
    data = json.loads((folder / "tekken.json").read_text())
    data["config"]["version"] = version
    (folder / "tekken.json").write_text(json.dumps(data))
    engine = load(path=folder, spec=str(folder))
    reference = MistralTokenizer.from_file(str(folder / "tekken.json"))
    for conversation in CONVERSATIONS:
        messages = [{"role": role, "content": text} for role, text in conversation]
        request = ChatCompletionRequest(messages=[MESSAGES[r](content=t) for r, t in conversation])
        expected = reference.encode_chat_completion(request).tokens
        assert engine.tokenizer.encode(engine.render(messages)) == expected, conversation
    chat = llmrun(
        "chat", str(folder), "--system", "S", "-n", "3", "--temperature", "0", input="a\nb\n"
    )
    assert chat.returncode == 0, chat.stderr


@pytest.mark.parametrize("version", ["v3", "v13"])
def test_the_folders_system_prompt_is_the_default_system_message(mistral, tmp_path, version):
    """SYSTEM_PROMPT.txt, filled in as the model cards load it ({name} the repo's name,
    {today} and {yesterday}), is the system message of a conversation without one: the ids
    are mistral_common's for the conversation with it first. A system message given
    replaces it."""
    _, base = mistral
    repo = tmp_path / "models--mistralai--Magistral-Small-2509"
    folder = shutil.copytree(base, repo / "snapshots" / ("a" * 40))
    data = json.loads((folder / "tekken.json").read_text())
    data["config"]["version"] = version
    (folder / "tekken.json").write_text(json.dumps(data))
    (folder / "SYSTEM_PROMPT.txt").write_text(
        "You are {name}. Today is {today}, yesterday was {yesterday}.\n{other} stays.\n"
    )
    today = datetime.date.today()
    default = (
        f"You are Magistral-Small-2509. Today is {today}, yesterday was "
        f"{today - datetime.timedelta(days=1)}.\n{{other}} stays.\n"
    )
    engine = load(path=folder, spec=str(folder))
    reference = MistralTokenizer.from_file(str(folder / "tekken.json"))
    for conversation, sent in [
        ([("user", "Hi"), ("assistant", "Hello!"), ("user", "And you?")], False),
        ([("system", "Be brief."), ("user", "Hi")], True),
    ]:
        messages = [{"role": role, "content": text} for role, text in conversation]
        full = conversation if sent else [("system", default), *conversation]
        request = ChatCompletionRequest(messages=[MESSAGES[r](content=t) for r, t in full])
        expected = reference.encode_chat_completion(request).tokens
        assert engine.tokenizer.encode(engine.render(messages)) == expected, conversation


def test_a_folders_chat_template_comes_first_and_an_unknown_version_is_refused(mistral, tmp_path):
    _, base = mistral
    folder = shutil.copytree(base, tmp_path / "jinja")
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load(path=folder, spec="m").render([{"role": "user", "content": "hi"}]) == "hi"
    folder = shutil.copytree(base, tmp_path / "v99")
    data = json.loads((folder / "tekken.json").read_text())
    data["config"]["version"] = "v99"
    (folder / "tekken.json").write_text(json.dumps(data))
    result = llmrun("chat", str(folder), input="hi\n")
    assert result.returncode != 0
    assert result.stderr.splitlines()[-1] == (
        "error: chat template error: the folder's tekken.json is version v99, and llmrun knows "
        "Mistral's chat format for versions v3, v7, v11, v13 only: give --template FILE (or "
        "`run --raw`)"
    )
    assert llmrun("run", str(folder), "hi", "--raw", "-n", "2").returncode == 0
