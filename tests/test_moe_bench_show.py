"""bench's weights/token and show's parameters on mixture-of-experts models: a token
reads the dense weights and expert_used_count of each layer's experts."""

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from moe_helpers import (
    hub_state_dict,
    quantized_and_dequantized,
    save_hub_dir,
    stacked_gguf_state,
    tiny_moe_model,
    write_moe_gguf,
)

from llmrun import bench, ui
from llmrun.loading import inspect
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model

pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    hf, config = tiny_moe_model("qwen2_moe", hidden_size=256, moe_intermediate_size=256)
    state = hub_state_dict(hf, "qwen2_moe")
    tensors = stacked_gguf_state(state, config)
    types = {"_exps": T.Q4_K, "attn_q": T.Q8_0}
    quantized, _ = quantized_and_dequantized(tensors, types, np.random.default_rng(0))
    gguf_path = write_moe_gguf(folder / "m.gguf", config, quantized)
    return gguf_path, save_hub_dir(folder / "hub", config, state), config


def test_weights_per_token_count_the_active_experts(files):
    gguf_path, _, config = files
    used, count = config["num_experts_per_tok"], config["num_experts"]  # 3 of 8
    tensors = read_gguf(gguf_path, with_tensors=False).tensors
    embed = tensors["token_embd.weight"]
    expected = sum(
        t.nbytes * used / count if name.endswith("_exps.weight") else t.nbytes
        for name, t in tensors.items()
        if name != "token_embd.weight"
    )
    expected += embed.nbytes // embed.shape[0]  # one row of the (untied) embedding
    model = load_model(gguf_path, CPU, "f32").model
    assert bench.weight_bytes_per_token(model) == round(expected)


def test_show_reports_total_and_active_parameters(files, capsys):
    gguf_path, hub_dir, config = files
    used, count = config["num_experts_per_tok"], config["num_experts"]
    for path in (gguf_path, hub_dir):
        info = inspect.describe(path)
        if path == gguf_path:
            shapes = [t.shape for t in read_gguf(path, with_tensors=False).tensors.values()]
            experts = sum(math.prod(s) for s in shapes if len(s) == 3)
        else:
            experts = 2 * 8 * 3 * 256 * 256  # layers x experts x projections x 256 x 256
        assert info["active_parameters"] == info["parameters"] - experts + experts * used // count
        ui.print_model_info({**info, "name": "m"})
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("parameters"))
        assert f"active a token ({info['active_parameters']:,})" in line


def test_dense_models_have_no_active_count(tmp_path):
    from helpers import STORIES_GGUF, STORIES_HF

    assert inspect.describe(STORIES_GGUF)["active_parameters"] is None
    assert inspect.describe(STORIES_HF)["active_parameters"] is None


def test_gpt_oss_in_each_form_shows_the_same_parameters(tmp_path):
    """gpt-oss as OpenAI ships it (MXFP4 experts as uint8 _blocks and _scales), as
    transformers saves it (fused experts) and as GGUF: one parameter count and one
    active count, from the GGUF file read with gguf's own reader. The Hub's form counted
    the packed bytes as parameters (227K, of type U8) and neither safetensors form had
    an active count."""
    import gguf
    from gpt_oss_helpers import (
        gguf_tensors,
        llmrun_state,
        save_hub_mxfp4_dir,
        tiny_gpt_oss,
        with_mxfp4_experts,
        write_gpt_oss_gguf,
    )

    hf, config = tiny_gpt_oss()
    blocks = with_mxfp4_experts(hf, config)
    hub = save_hub_mxfp4_dir(tmp_path / "hub", hf, config, blocks)
    hf.save_pretrained(tmp_path / "saved")
    path = write_gpt_oss_gguf(
        tmp_path / "m.gguf", config, gguf_tensors(llmrun_state(hf, config), config)
    )
    reader = gguf.GGUFReader(path)
    params = sum(int(t.n_elements) for t in reader.tensors)
    experts = sum(int(t.n_elements) for t in reader.tensors if "_exps." in t.name)
    used, total = config["num_experts_per_tok"], config["num_local_experts"]
    expected = (params, params - experts + experts * used // total)
    for model in (hub, tmp_path / "saved", path):
        info = inspect.describe(model)
        assert (info["parameters"], info["active_parameters"]) == expected, model
    assert set(inspect.describe(hub)["tensor_types"]) == {"F32", "MXFP4"}
