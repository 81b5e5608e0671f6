"""Baichuan and Baichuan 2 against references built from transformers (transformers has
no Baichuan; its remote code, modeling_baichuan.py of Baichuan2-7B-Chat and
Baichuan2-13B-Chat, computes what these do):

- the 7B (32 layers, RoPE): transformers' LlamaForCausalLM of the same weights, every head
  its own keys; Baichuan 2's NormHead as that model with its output rows scaled to unit
  length;
- the 13B (40 layers, ALiBi): the same LlamaForCausalLM's modules, attention written once
  below (alibi_reference) as BLOOM's: no RoPE, scores + slope * key position, with BLOOM's
  slopes (transformers' build_alibi_tensor), causal mask, softmax.

Folders as the Hub's checkpoints hold them: config.json (model_max_length for the 13B),
Llama's module names but each layer's queries, keys and values in one self_attn.W_pack
(all queries' rows, then keys', then values'), the output rows unscaled. Baichuan 2 is told
by its vocabulary of 125696 tokens; the tiny models here have 512, and the tests that
try Baichuan 2's head set loading.baichuan.BAICHUAN2_VOCAB to 512. GGUFs as llama.cpp's
converter writes them (conversion/baichuan.py BaichuanModel): TextModel's keys without
a KV head count or RoPE base, the rope dimension count, tensor_data_layout, W_pack split
into attn_q/attn_k/attn_v with q and k rows permuted as a llama's, the output rows as the
checkpoint stores them (llama.cpp does not scale them).

Its features each move the logits by far more than the tolerance: RoPE or ALiBi (the
slopes set to 0 give other logits), Baichuan 2's scaled output rows, W_pack's order.

Tolerances: f32 logits (within about ±9) 1e-4 max abs against the references, whole or
through the KV cache (prefills in chunks, then one token at a time, the native decode
step included where the loader attaches it), contiguous or paged. An f16 or bf16 cache:
1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT from
f32. A Q8_0 GGUF against the reference run on the weights gguf dequantizes: 1e-4.
"""

import copy
import json

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    max_diff,
    write_keyed_gguf,
)
from helpers import BASE, _permute, cached_logits, gguf_name, our_model, randomize

from llmrun import static_decode
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import baichuan as baichuan_loading
from llmrun.loading.loader import load_model
from llmrun.models import baichuan
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
ROPE_LAYERS, ALIBI_LAYERS = 32, 40
# Every head its own keys, as Baichuan's; 6 heads check ALiBi's slopes for a head count
# that is not a power of 2.
LLAMA = dict(BASE, model_type="llama", num_key_value_heads=None, rope_theta=10000.0)
VARIANTS = {
    "rope": dict(num_hidden_layers=ROPE_LAYERS),
    "alibi": dict(num_hidden_layers=ALIBI_LAYERS),
    "alibi-6-heads": dict(num_hidden_layers=ALIBI_LAYERS, hidden_size=96, num_attention_heads=6),
}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 1.1e-2 to 1.2e-2, bf16 8e-2 to 9e-2.
DRIFT = {"f16": 5e-2, "bf16": 4e-1}


def hf_model(**overrides):
    """A tiny transformers LlamaForCausalLM (32 layers: the 7B's RoPE model) with
    randomize()'s weights, queries and keys 0.3 of them; with num_hidden_layers=40, the
    modules of alibi_reference. 32 or 40 random layers of sharper attention carry f32's
    rounding to 1e-4 and more (the f32 reference itself then differs from its f64 so);
    these stay within 5e-5."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        **{**LLAMA, "num_hidden_layers": ROPE_LAYERS, **overrides}
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"q_proj.weight": 0.3, "k_proj.weight": 0.3})
    return model


def is_alibi(hf) -> bool:
    return hf.config.num_hidden_layers == ALIBI_LAYERS


def alibi_reference(hf, ids: torch.Tensor) -> torch.Tensor:
    """The 13B's logits: `hf`'s modules, attention without RoPE biased as BLOOM's (slope
    * key position, transformers' build_alibi_tensor) under a causal mask."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    config, body = hf.config, hf.model
    heads, tokens = config.num_attention_heads, ids.shape[1]
    head_dim = config.hidden_size // heads
    # [heads, 1, keys] + [tokens, keys] -> [heads, tokens, keys]
    bias = build_alibi_tensor(torch.ones(1, tokens), heads, torch.float32)
    causal = torch.full((tokens, tokens), float("-inf")).triu(1)
    x = body.embed_tokens(ids)
    for layer in body.layers:
        h = layer.input_layernorm(x)
        attn = layer.self_attn
        q, k, v = (
            p(h).view(1, tokens, heads, head_dim).transpose(1, 2)
            for p in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        scores = q @ k.transpose(-1, -2) / head_dim**0.5 + bias + causal
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, tokens, -1)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return hf.lm_head(body.norm(x))


def normalized_head(hf):
    """`hf` with Baichuan 2's NormHead: its output rows scaled to unit length."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.nn.functional.normalize(model.lm_head.weight))
    return model


def reference(hf, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return alibi_reference(hf, ids) if is_alibi(hf) else hf(ids).logits


def hub_config(hf) -> dict:
    """config.json as Baichuan's spell it: model_max_length instead of
    max_position_embeddings for the 13B, no KV head count, no RoPE base."""
    config = hf.config
    length = "model_max_length" if is_alibi(hf) else "max_position_embeddings"
    return {
        "model_type": "baichuan",
        "architectures": ["BaichuanForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "hidden_act": "silu",
        length: config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def ours(hf) -> torch.nn.Module:
    return our_model(hub_config(hf), hf.state_dict())


def hub_state(hf, order=("q_proj", "k_proj", "v_proj")) -> dict[str, torch.Tensor]:
    """The weights as Baichuan's checkpoints hold them: q, k and v (in `order`) as W_pack."""
    state = hf.state_dict()
    out = {}
    for name, tensor in state.items():
        if ".self_attn.q_proj." in name:
            parts = [state[name.replace("q_proj", p)] for p in order]
            out[name.replace("q_proj", "W_pack")] = torch.cat(parts)
        elif ".self_attn.k_proj." not in name and ".self_attn.v_proj." not in name:
            out[name] = tensor.contiguous()
    return out


def write_hub_folder(path, hf, **state):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hub_config(hf)))
    safetensors_torch.save_file(hub_state(hf, **state), path / "model.safetensors")
    return path


def write_baichuan_gguf(path, hf, qtype=None, **keys):
    """The model as llama.cpp's converter writes Baichuan: TextModel's keys (no KV head
    count, no RoPE base), the rope dimension count, the tensor data layout, W_pack split
    with the query and key rows permuted, 2-D weights in `qtype` (default F32). `keys`:
    metadata to change ("{arch}.…" -> value, None leaves one out)."""
    config = hf.config
    heads = config.num_attention_heads
    metadata = {
        "{arch}.context_length": config.max_position_embeddings,
        "{arch}.embedding_length": config.hidden_size,
        "{arch}.feed_forward_length": config.intermediate_size,
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.attention.head_count": heads,
        "{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "{arch}.rope.dimension_count": config.hidden_size // heads,
        "{arch}.tensor_data_layout": "Meta AI original pth",
        "general.file_type": int(
            gguf.LlamaFileType.ALL_F32 if qtype is None else gguf.LlamaFileType.MOSTLY_Q8_0
        ),
        **keys,
    }
    tensors = {}
    for name, tensor in hf.state_dict().items():
        data = tensor.detach().float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(data, heads)
        tensors[gguf_name(name)] = np.ascontiguousarray(data)
    return write_keyed_gguf(path, "baichuan", metadata, tensors, qtype)


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf)


@pytest.fixture
def baichuan2(monkeypatch):
    """The tiny vocabulary counted as Baichuan 2's."""
    monkeypatch.setattr(baichuan_loading, "BAICHUAN2_VOCAB", BASE["vocab_size"])


def test_config_json_matches_the_reference_whole_chunked_and_decoded(family):
    hf, expected = family
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_the_layer_count_chooses_rope_or_alibi_and_each_matters(family, monkeypatch):
    """32 layers turn RoPE (a model without it differs), 40 ALiBi (slopes of 0 differ)."""
    hf, expected = family
    model = ours(hf)
    assert isinstance(model, baichuan.AlibiModel) == is_alibi(hf)
    if is_alibi(hf):
        heads = hf.config.num_attention_heads
        monkeypatch.setattr(baichuan.ModelArgs, "alibi_slopes", lambda self: torch.zeros(heads))
    else:
        monkeypatch.setattr(type(model.model.rotary_emb), "forward", _no_rotation)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1


def _no_rotation(self, positions, capacity=None):
    zeros = torch.zeros(*positions.shape, self.rotary_dim)
    return zeros + 1, zeros


@pytest.mark.parametrize("layers", [2, 33])
def test_other_layer_counts_are_refused(layers, tmp_path):
    hf = hf_model(num_hidden_layers=2)
    folder = write_hub_folder(tmp_path / "hub", hf)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    with pytest.raises(UnsupportedError, match=f"a Baichuan model of {layers} layers"):
        load_model(folder, CPU, "f32")


def test_a_hub_folder_loads_as_the_reference_runs_it(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_hub_folder(tmp_path / "hub", hf), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_w_pack_s_order_matters(tmp_path):
    """Keys before queries in W_pack load too, and give other logits."""
    hf = hf_model()
    folder = write_hub_folder(tmp_path / "hub", hf, order=("k_proj", "q_proj", "v_proj"))
    loaded = load_model(folder, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) > 0.1


def test_a_baichuan_2_folder_normalizes_its_output_rows(family, tmp_path, baichuan2):
    """NormHead: the folder's unscaled rows give the logits of the model with unit rows,
    which differ from those of the rows as stored."""
    hf, raw = family
    expected = reference(normalized_head(hf))
    assert max_diff(expected, raw) > 0.1
    loaded = load_model(write_hub_folder(tmp_path / "hub", hf), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_baichuan_2_is_told_by_its_vocabulary():
    """125696 tokens (Baichuan 2's) normalize the output rows; Baichuan 1's 64000 not."""
    w = torch.randn(8, 4)
    for vocab, scaled in ((125696, True), (64000, False)):
        config = {"hidden_size": 4, "vocab_size": vocab}
        weights = {"lm_head.weight": Held(w)}
        out = baichuan_loading.hf_weights(weights, config, "hub", Held)
        norms = out["lm_head.weight"].tensor.norm(dim=1)
        assert torch.allclose(norms, torch.ones(8)) == scaled


class Held:
    """A stand-in for the loader's Weight."""

    def __init__(self, tensor):
        self.tensor = tensor


def test_a_gguf_matches_the_reference(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_baichuan_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "baichuan"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_baichuan_2_gguf_keeps_its_output_rows_as_llama_cpp_does(tmp_path, baichuan2):
    """The converter writes the rows unscaled and llama.cpp uses them so: the GGUF's
    logits are those of the stored rows."""
    hf = hf_model()
    loaded = load_model(write_baichuan_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(family, tmp_path):
    hf, f32 = family
    q8 = gguf.GGMLQuantizationType.Q8_0
    loaded = load_model(write_baichuan_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    rounded = copy.deepcopy(hf)
    dequantize_2d_weights(rounded, q8)  # q/k rows permuted or not, each row quantizes alike
    expected = reference(rounded)
    assert max_diff(expected, f32) > 1e-3
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_partial_rope_is_refused(tmp_path):
    path = write_baichuan_gguf(
        tmp_path / "m.gguf", hf_model(), **{"{arch}.rope.dimension_count": 8}
    )
    with pytest.raises(ModelFormatError, match="Baichuan rotates whole heads"):
        load_model(path, CPU, "f32")


def test_a_gguf_of_another_layer_count_is_refused(tmp_path):
    """llama.cpp turns neither RoPE nor ALiBi in a baichuan file of 2 layers."""
    path = write_baichuan_gguf(tmp_path / "m.gguf", hf_model(num_hidden_layers=2))
    with pytest.raises(UnsupportedError, match="a Baichuan model of 2 layers"):
        load_model(path, CPU, "f32")


def test_the_native_decode_step_takes_the_rope_model_only(family, tmp_path, monkeypatch):
    """The 7B is Llama's model, which takes Llama's native step (its decoded logits those
    of the torch layers); the 13B's ALiBi is in neither the native nor the static step."""
    hf, expected = family
    path = write_baichuan_gguf(tmp_path / "m.gguf", hf)
    native = load_model(path, CPU, "f32").model
    if is_alibi(hf):
        assert native.decode_step is None
        assert not decode_step.attach(native)
        cache = native.new_cache(1, 32, torch.float32, "cpu")
        assert not static_decode.supported(native, cache)
        return
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    plain = load_model(path, CPU, "f32").model
    assert native.decode_step is not None and plain.decode_step is None
    # The kernels round otherwise than torch's ops, through 32 layers: 3e-5 measured.
    assert max_diff(cached_logits(native, IDS), cached_logits(plain, IDS)) < 1e-4
    assert max_diff(cached_logits(native, IDS), expected) < 1e-4
    assert native.decode_step is not None  # it took the steps


def test_the_static_decode_step_gives_the_ordinary_logits(monkeypatch):
    check_static_decode(ours(hf_model()), monkeypatch)


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


@pytest.mark.parametrize("variant", ["rope", "alibi"])
def test_llmrun_run_prints_the_reference_s_greedy_text(variant, tmp_path):
    hf = hf_model(**VARIANTS[variant])
    path = write_baichuan_gguf(tmp_path / f"baichuan-{variant}.gguf", hf)
    check_run_and_show(AlibiGreedy(hf) if is_alibi(hf) else hf, path, "baichuan")


class AlibiGreedy:
    """transformers' greedy generate() as family_checks calls it, of alibi_reference's
    logits (recomputed over the whole sequence for each token)."""

    def __init__(self, hf):
        self.hf = hf

    def generate(self, ids, max_new_tokens, do_sample, eos_token_id):
        assert not do_sample
        for _ in range(max_new_tokens):
            chosen = alibi_reference(self.hf, ids)[:, -1].argmax(-1)
            ids = torch.cat([ids, chosen[:, None]], dim=1)
            if int(chosen) == eos_token_id:
                break
        return ids


def test_show_describes_a_baichuan_gguf(tmp_path):
    path = write_baichuan_gguf(tmp_path / "m.gguf", hf_model(**VARIANTS["alibi"]))
    # 40 layers of 8192 positions: 4 KV heads of 16 floats, keys and values.
    check_show(path, "baichuan", 40 * 2 * 4 * 16 * 4 * 8192)
