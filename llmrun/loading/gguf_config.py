"""GGUF metadata -> the Hugging Face-style config and tensor names the model files know.

The architecture's keys (gguf.Keys) become config.json fields; where a GGUF leaves a
value out, the rule is llama.cpp's (src/llama-model.cpp), cited where it applies. MoE,
Gemma and RoPE settings each have their reader; gpt-oss has its own module (gpt_oss.py).
The file itself is read by gguf_io.py.
"""

from __future__ import annotations

from typing import Any

from gguf import (
    ExpertGatingFuncType,
    Keys,
)

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import (
    afmoe,
    alibi_families,
    apertus,
    arcee,
    arctic,
    baichuan,
    bailingmoe,
    bailingmoe3,
    bert,
    bitnet,
    chatglm,
    cohere,
    cohere2_moe,
    dbrx,
    deci,
    deepseek,
    deepseek2,
    deepseek4,
    dots1,
    dots3,
    dsa,
    ernie4_5,
    eurobert,
    exaone,
    exaone4,
    exaone_moe,
    falcon,
    falcon_h1,
    gemma3n,
    gemma4,
    gemma_embedding,
    glm4,
    glm4_moe,
    glm5_next,
    gpt2,
    gpt_bigcode,
    gpt_neox,
    gpt_oss,
    granite,
    granitehybrid,
    grok,
    grovemoe,
    hrm_text,
    hunyuan,
    hunyuan_vl,
    hy_v3,
    hy_v4,
    internlm2,
    jais2,
    jamba,
    jina_bert,
    kimi_linear,
    laguna,
    lfm2,
    llama4,
    mamba,
    mamba2,
    maple,
    mellum,
    mimo2,
    minicpm,
    minicpm3,
    minimax,
    minimax_m2,
    minimax_m3,
    modernbert,
    muse_glimmer,
    nanbeige,
    nemotron,
    nemotron_h,
    nomic_bert,
    olmo,
    olmoe,
    openelm,
    orion,
    phi2,
    phimoe,
    plamo,
    plamo2,
    plamo3,
    plm,
    qwen,
    qwen4exp,
    qwen35,
    rwkv6,
    rwkv7,
    seed_oss,
    smallthinker,
    stablelm,
    starcoder2,
    step3p5,
    t5,
    vl_text,
)
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, read_float_list, vocab_size

# Maincoder: Llama's keys and names (conversion/maincoder.py), q/k rows as they are.
MAINCODER = "maincoder"
# openPangu-Embedded: Llama's keys and names (conversion/pangu.py), q/k rows as they are.
PANGU_EMBEDDED = "pangu-embedded"
# XVERSE: a Llama under its own name (conversion/xverse.py, src/models/xverse.cpp). Its
# converter groups the key rows it permutes by heads // KV heads rather than by KV heads;
# read back by KV heads and turned in halves, they give what llama.cpp's pairwise RoPE
# gives of the stored rows either way (the two agree for every XVERSE checkpoint).
XVERSE = "xverse"
# The architectures whose q/k rows llama.cpp's converter permutes as Llama's (for its
# adjacent-pair RoPE), which the loader undoes. Mixtral included; SmolLM3 and Granite are
# converted as Llama (conversion/llama.py), OLMo's q/k weights permuted as Llama's
# (conversion/olmo.py), InternLM2's split wqkv and Baichuan's W_pack too
# (conversion/internlm.py, conversion/baichuan.py), MiniCPM's as Llama's (conversion/minicpm.py).
QK_PERMUTED_ARCHS = (
    "llama",
    bailingmoe.ARCH,  # Ling 1 (conversion/bailingmoe.py BailingMoeModel)
    deepseek.ARCH,  # DeepSeek V1 MoE (conversion/deepseek.py DeepseekModel)
    "mistral3",
    "smollm3",
    arcee.ARCH,
    olmo.OLMO1_ARCH,
    internlm2.ARCH,
    baichuan.ARCH,
    *granite.ARCHS,
    minicpm.ARCH,
    muse_glimmer.ARCH,  # conversion/muse_glimmer.py _unpermute_for_rope
    XVERSE,  # conversion/xverse.py _reverse_hf_permute
    nanbeige.ARCH,  # conversion/nanbeige.py: LlamaModel's
    arctic.ARCH,  # conversion/arctic.py: LlamaModel.permute
)
# GGUF architecture -> Hugging Face model_type. llama.cpp converts Mistral to "llama",
# and Mistral Small 3.1+ and Ministral 3 to "mistral3" (Ministral 3 when it has an
# attention temperature, see config_from_gguf).
MODEL_TYPES = {
    "llama": "llama",
    "t5": "t5",  # and UMT5 (llmrun.loading.t5)
    "mistral3": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    gemma3n.ARCH: gemma3n.MODEL_TYPE,  # llmrun/loading/gemma3n.py
    gemma_embedding.ARCH: gemma_embedding.MODEL_TYPE,  # llmrun/loading/gemma_embedding.py
    gemma4.ARCH: gemma4.MODEL_TYPE,  # llmrun/loading/gemma4.py
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    # Qwen3-VL's language models: Qwen3 with M-RoPE, which text alone (every position
    # section the same) turns as plain RoPE; the vision parts are in an mmproj file.
    "qwen3vl": "qwen3",
    "qwen3vlmoe": "qwen3_moe",
    vl_text.QWEN2VL_ARCH: "qwen2",  # Qwen2-VL's and Qwen2.5-VL's: llmrun/loading/vl_text.py
    gpt_oss.ARCH: gpt_oss.MODEL_TYPE,  # its mapping: llmrun/loading/gpt_oss.py
    deepseek2.ARCH: "deepseek_v2",  # or deepseek_v3: llmrun/loading/deepseek2.py
    deepseek2.MISTRAL4: deepseek2.MISTRAL4,
    **dsa.ARCHS,  # DeepSeek-V3.2 and GLM-5: llmrun/loading/dsa.py
    dots3.ARCH: dots3.MODEL_TYPE,  # Dots 3 Note: llmrun/loading/dots3.py
    deepseek4.ARCH: deepseek4.MODEL_TYPE,  # llmrun/loading/deepseek4.py
    "granite": "granite",  # with experts, granitemoe: llmrun/loading/granite.py
    "granitemoe": "granitemoe",
    granite.SWA_ARCH: "granite_swa",  # with experts, granitemoe_swa
    granitehybrid.ARCH: granitehybrid.MODEL_TYPE,  # llmrun/loading/granitehybrid.py
    kimi_linear.ARCH: kimi_linear.MODEL_TYPE,  # llmrun/loading/kimi_linear.py
    bailingmoe.ARCH: bailingmoe.MODEL_TYPE,  # Ling 1: llmrun/loading/bailingmoe.py
    bailingmoe.V2_ARCH: bailingmoe.V2_MODEL_TYPE,  # Ling 2.0: llmrun/loading/bailingmoe.py
    deepseek.ARCH: deepseek.MODEL_TYPE,  # DeepSeek V1 MoE: llmrun/loading/deepseek.py
    deepseek.OCR_ARCH: deepseek.MODEL_TYPE,  # DeepSeek-OCR's text: llmrun/loading/deepseek.py
    qwen.ARCH: qwen.MODEL_TYPE,  # Qwen 1, run as Qwen2: llmrun/loading/qwen.py
    bailingmoe3.ARCH: bailingmoe3.MODEL_TYPE,  # Ling 3: llmrun/loading/bailingmoe3.py
    glm5_next.ARCH: glm5_next.GGUF_MODEL_TYPE,  # llmrun/loading/glm5_next.py
    olmo.ARCH: "olmo2",  # OLMo 3 too (a sliding window): llmrun/loading/olmo.py
    olmo.OLMO1_ARCH: olmo.OLMO1_MODEL_TYPE,  # the first OLMo: llmrun/loading/olmo.py
    stablelm.ARCH: stablelm.MODEL_TYPE,  # llmrun/loading/stablelm.py
    "smollm3": "smollm3",
    **cohere.MODEL_TYPES,  # their metadata: llmrun/loading/cohere.py
    cohere2_moe.ARCH: cohere2_moe.MODEL_TYPE,  # llmrun/loading/cohere2_moe.py
    glm4.ARCH: glm4.MODEL_TYPE,  # llmrun/loading/glm4.py
    chatglm.ARCH: chatglm.MODEL_TYPE,  # GLM-4-9B: llmrun/loading/chatglm.py
    glm4_moe.ARCH: glm4_moe.MODEL_TYPE,  # llmrun/loading/glm4_moe.py
    ernie4_5.ARCH: ernie4_5.MODEL_TYPE,  # llmrun/loading/ernie4_5.py
    ernie4_5.MOE_ARCH: ernie4_5.MOE_MODEL_TYPE,
    ernie4_5.PADDLEOCR_ARCH: ernie4_5.PADDLEOCR_MODEL_TYPE,  # PaddleOCR-VL's text
    seed_oss.ARCH: seed_oss.MODEL_TYPE,  # llmrun/loading/seed_oss.py
    exaone4.ARCH: exaone4.MODEL_TYPE,  # llmrun/loading/exaone4.py
    exaone_moe.ARCH: exaone_moe.MODEL_TYPE,  # llmrun/loading/exaone_moe.py
    mimo2.ARCH: mimo2.MODEL_TYPE,  # llmrun/loading/mimo2.py
    hunyuan.ARCH: hunyuan.MODEL_TYPE,  # llmrun/loading/hunyuan.py
    hunyuan.MOE_ARCH: hunyuan.MOE_MODEL_TYPE,
    hunyuan_vl.ARCH: hunyuan_vl.MODEL_TYPE,  # HunYuan-VL's text: llmrun/loading/hunyuan_vl.py
    dots1.ARCH: dots1.MODEL_TYPE,  # llmrun/loading/dots1.py
    **qwen35.ARCHS,  # Qwen3.5 and its MoE: llmrun/loading/qwen35.py
    qwen4exp.ARCH: qwen4exp.MODEL_TYPE,  # llmrun/loading/qwen4exp.py
    **lfm2.MODEL_TYPES,  # llmrun/loading/lfm2.py
    llama4.ARCH: llama4.MODEL_TYPE,  # llmrun/loading/llama4.py
    minimax_m2.ARCH: minimax_m2.MODEL_TYPE,  # llmrun/loading/minimax_m2.py
    minimax_m3.ARCH: minimax_m3.MODEL_TYPE,  # llmrun/loading/minimax_m3.py
    **nemotron_h.MODEL_TYPES,  # llmrun/loading/nemotron_h.py
    apertus.ARCH: apertus.MODEL_TYPE,  # llmrun/loading/apertus.py
    afmoe.ARCH: afmoe.MODEL_TYPE,  # llmrun/loading/afmoe.py
    muse_glimmer.ARCH: muse_glimmer.MODEL_TYPE,  # llmrun/loading/muse_glimmer.py
    olmoe.ARCH: olmoe.MODEL_TYPE,  # llmrun/loading/olmoe.py
    falcon_h1.ARCH: falcon_h1.MODEL_TYPE,  # llmrun/loading/falcon_h1.py
    plamo.ARCH: plamo.MODEL_TYPE,  # PLaMo-13B: llmrun/loading/plamo.py
    plamo2.ARCH: plamo2.MODEL_TYPE,  # llmrun/loading/plamo2.py
    plamo3.ARCH: plamo3.MODEL_TYPE,  # llmrun/loading/plamo3.py
    mamba.ARCH: "mamba",  # or falcon_mamba: llmrun/loading/mamba.py
    rwkv7.ARCH: rwkv7.MODEL_TYPE,  # llmrun/loading/rwkv7.py
    rwkv6.ARCH: rwkv6.MODEL_TYPE,  # llmrun/loading/rwkv6.py
    jamba.ARCH: jamba.MODEL_TYPE,  # llmrun/loading/jamba.py
    phimoe.ARCH: phimoe.MODEL_TYPE,  # llmrun/loading/phimoe.py
    smallthinker.ARCH: smallthinker.MODEL_TYPE,  # llmrun/loading/smallthinker.py
    hy_v3.ARCH: hy_v3.MODEL_TYPE,  # llmrun/loading/hy_v3.py
    hy_v4.ARCH: hy_v4.MODEL_TYPE,  # llmrun/loading/hy_v4.py
    laguna.ARCH: laguna.MODEL_TYPE,  # llmrun/loading/laguna.py
    hrm_text.ARCH: hrm_text.MODEL_TYPE,  # llmrun/loading/hrm_text.py
    mellum.ARCH: mellum.MODEL_TYPE,  # llmrun/loading/mellum.py
    minicpm.ARCH: minicpm.MODEL_TYPE,  # llmrun/loading/minicpm.py
    minicpm3.ARCH: minicpm3.MODEL_TYPE,  # llmrun/loading/minicpm3.py
    step3p5.ARCH: step3p5.MODEL_TYPE,  # llmrun/loading/step3p5.py
    starcoder2.ARCH: starcoder2.MODEL_TYPE,  # llmrun/loading/starcoder2.py
    phi2.ARCH: phi2.MODEL_TYPE,  # llmrun/loading/phi2.py
    **{arch: arch for arch in alibi_families.ARCHS},  # llmrun/loading/alibi_families.py
    falcon.ARCH: falcon.MODEL_TYPE,  # llmrun/loading/falcon.py
    gpt_neox.ARCH: gpt_neox.MODEL_TYPE,  # llmrun/loading/gpt_neox.py
    gpt2.ARCH: gpt2.MODEL_TYPE,  # llmrun/loading/gpt2.py
    gpt_bigcode.ARCH: gpt_bigcode.MODEL_TYPE,  # llmrun/loading/gpt_bigcode.py
    mamba2.ARCH: mamba2.MODEL_TYPE,  # llmrun/loading/mamba2.py
    exaone.ARCH: exaone.MODEL_TYPE,  # llmrun/loading/exaone.py
    nemotron.ARCH: nemotron.MODEL_TYPE,  # llmrun/loading/nemotron.py
    arcee.ARCH: arcee.MODEL_TYPE,  # llmrun/loading/arcee.py
    bitnet.ARCH: bitnet.MODEL_TYPE,  # llmrun/loading/bitnet.py
    jais2.ARCH: jais2.MODEL_TYPE,  # llmrun/loading/jais2.py
    dbrx.ARCH: dbrx.MODEL_TYPE,  # llmrun/loading/dbrx.py
    minimax.ARCH: minimax.MODEL_TYPE,  # MiniMax-Text-01: llmrun/loading/minimax.py
    deci.ARCH: deci.MODEL_TYPE,  # Nemotron-NAS (Nemotron 51B, Super, Ultra): loading/deci.py
    bert.ARCH: bert.MODEL_TYPE,  # BERT, RoBERTa, XLM-RoBERTa encoders: llmrun/loading/bert.py
    nomic_bert.ARCH: nomic_bert.MODEL_TYPE,  # llmrun/loading/nomic_bert.py
    nomic_bert.MOE_ARCH: nomic_bert.MODEL_TYPE,  # nomic-embed-text-v2-moe: the same file
    jina_bert.ARCH: jina_bert.MODEL_TYPE,  # llmrun/loading/jina_bert.py
    modernbert.ARCH: modernbert.MODEL_TYPE,  # llmrun/loading/modernbert.py
    eurobert.ARCH: eurobert.MODEL_TYPE,  # llmrun/loading/eurobert.py
    internlm2.ARCH: internlm2.MODEL_TYPE,  # llmrun/loading/internlm2.py
    baichuan.ARCH: baichuan.MODEL_TYPE,  # and Baichuan 2: llmrun/loading/baichuan.py
    orion.ARCH: orion.MODEL_TYPE,  # llmrun/loading/orion.py
    grok.ARCH: grok.MODEL_TYPE,  # llmrun/loading/grok.py
    arctic.ARCH: arctic.MODEL_TYPE,  # llmrun/loading/arctic.py
    grovemoe.ARCH: grovemoe.MODEL_TYPE,  # llmrun/loading/grovemoe.py
    maple.ARCH: maple.MODEL_TYPE,  # llmrun/loading/maple.py
    XVERSE: XVERSE,  # run as Llama
    openelm.ARCH: openelm.MODEL_TYPE,  # llmrun/loading/openelm.py
    nanbeige.ARCH: nanbeige.MODEL_TYPE,  # llmrun/loading/nanbeige.py
    MAINCODER: MAINCODER,
    plm.ARCH: plm.MODEL_TYPE,  # llmrun/loading/plm.py
    PANGU_EMBEDDED: "PanguEmbedded",  # the checkpoints' model_type
}
# Families whose RMSNorm is x * (1 + w): llama.cpp's converter stores 1 + w.
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text", gemma_embedding.MODEL_TYPE)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Gemma 2/3's four norms a layer: ffn_norm is the one before the feed-forward there.
_GEMMA2_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# A mixture-of-experts layer: the router, Qwen2-MoE's shared expert and its gate, and
# the experts, stacked by llama.cpp's converter into one 3-D tensor per projection
# ([experts, rows, cols] in torch order), which hf_name names with an {expert} field.
_MOE_LAYER_NAMES = {
    "ffn_gate_inp": "gate",
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
}
EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gate, up, down
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}  # else gate_proj, up_proj, down_proj
MOE_TYPES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    *granite.MOE_TYPES,
    olmoe.MODEL_TYPE,
    phimoe.MODEL_TYPE,
    mellum.MODEL_TYPE,
)
SMOLLM3_NO_ROPE_INTERVAL = 4
# Tensors that carry RoPE settings rather than weights; config_from_gguf reads them.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(gguf_name: str, model_type: str) -> str | None:
    """The Hugging Face checkpoint key for a GGUF tensor name, or None if unknown. For a
    stack of experts (EXPERT_STACKS) it is a template of each expert's key, with an
    `{expert}` field for its index."""
    if model_type == gpt_oss.MODEL_TYPE:
        return gpt_oss.hf_name(gguf_name)
    if model_type in t5.MODEL_TYPES:
        return t5.hf_name(gguf_name)
    if model_type == gemma3n.MODEL_TYPE:
        return gemma3n.hf_name(gguf_name)
    if model_type == gemma_embedding.MODEL_TYPE and (name := gemma_embedding.hf_name(gguf_name)):
        return name
    if model_type == starcoder2.MODEL_TYPE:
        return starcoder2.hf_name(gguf_name)
    if model_type == phi2.MODEL_TYPE:
        return phi2.hf_name(gguf_name)
    if model_type in alibi_families.MODEL_TYPES:
        return alibi_families.hf_name(gguf_name, model_type)
    if model_type == falcon.MODEL_TYPE:
        return falcon.hf_name(gguf_name)
    if model_type == gpt_neox.MODEL_TYPE:
        return gpt_neox.hf_name(gguf_name)
    if model_type == gpt2.MODEL_TYPE:
        return gpt2.hf_name(gguf_name)
    if model_type == gpt_bigcode.MODEL_TYPE:
        return gpt_bigcode.hf_name(gguf_name)
    if model_type == mamba2.MODEL_TYPE:
        return mamba2.hf_name(gguf_name)
    if model_type == dbrx.MODEL_TYPE:
        return dbrx.hf_name(gguf_name)
    if model_type == minimax.MODEL_TYPE:
        return minimax.hf_name(gguf_name)
    if model_type == bert.MODEL_TYPE:
        return bert.hf_name(gguf_name)
    if model_type == nomic_bert.MODEL_TYPE:
        return nomic_bert.hf_name(gguf_name)
    if model_type == jina_bert.MODEL_TYPE:
        return jina_bert.hf_name(gguf_name)
    if model_type == modernbert.MODEL_TYPE:
        return modernbert.hf_name(gguf_name)
    if model_type == eurobert.MODEL_TYPE:
        return eurobert.hf_name(gguf_name)
    if model_type == gemma4.MODEL_TYPE:
        return gemma4.hf_name(gguf_name)
    if model_type in (*deepseek2.MODEL_TYPES, deepseek2.MISTRAL4, plm.MODEL_TYPE):
        return deepseek2.hf_name(gguf_name)
    if model_type in dsa.MODEL_TYPES:
        return dsa.hf_name(gguf_name)
    if model_type in dots3.MODEL_TYPES:
        return dots3.hf_name(gguf_name)
    if model_type == hy_v4.MODEL_TYPE:
        return hy_v4.hf_name(gguf_name)
    if model_type == deepseek4.MODEL_TYPE:
        return deepseek4.hf_name(gguf_name)
    if model_type in lfm2.MODEL_TYPES.values():
        return lfm2.hf_name(gguf_name)
    if model_type == nemotron_h.MODEL_TYPE:
        return nemotron_h.hf_name(gguf_name)
    if model_type == kimi_linear.MODEL_TYPE:
        return kimi_linear.hf_name(gguf_name)
    if model_type in (*bailingmoe.MODEL_TYPES, deepseek.MODEL_TYPE) and gguf_name.startswith(
        "blk."
    ):
        return bailingmoe.hf_name(gguf_name)
    if model_type in bailingmoe3.MODEL_TYPES:
        return bailingmoe3.hf_name(gguf_name)
    if model_type in glm5_next.MODEL_TYPES:
        return glm5_next.hf_name(gguf_name)
    if model_type == exaone_moe.MODEL_TYPE and gguf_name.startswith("blk."):
        return exaone_moe.hf_name(gguf_name)
    if model_type == mimo2.MODEL_TYPE and gguf_name.startswith("blk."):
        return mimo2.hf_name(gguf_name)
    if model_type == falcon_h1.MODEL_TYPE:
        return falcon_h1.hf_name(gguf_name)
    if model_type == plamo.MODEL_TYPE:
        return plamo.hf_name(gguf_name)
    if model_type == plamo2.MODEL_TYPE:
        return plamo2.hf_name(gguf_name)
    if model_type == plamo3.MODEL_TYPE:
        return plamo3.hf_name(gguf_name)
    if model_type in mamba.MODEL_TYPES:
        return mamba.hf_name(gguf_name)
    if model_type == rwkv7.MODEL_TYPE:
        return rwkv7.hf_name(gguf_name)
    if model_type == rwkv6.MODEL_TYPE:
        return rwkv6.hf_name(gguf_name)
    if model_type == jamba.MODEL_TYPE:
        return jamba.hf_name(gguf_name)
    if model_type == phimoe.MODEL_TYPE and (moe := phimoe.hf_name(gguf_name)):
        return moe
    if model_type == smallthinker.MODEL_TYPE and (moe := smallthinker.hf_name(gguf_name)):
        return moe
    if model_type == granitehybrid.MODEL_TYPE and (name := granitehybrid.hf_name(gguf_name)):
        return name
    if model_type == glm4_moe.MODEL_TYPE and gguf_name.startswith("blk."):
        return glm4_moe.hf_name(gguf_name)
    if model_type == ernie4_5.MOE_MODEL_TYPE and (moe := ernie4_5.moe_hf_name(gguf_name)):
        return moe
    if model_type in qwen4exp.MODEL_TYPES:
        return qwen4exp.hf_name(gguf_name)
    if model_type in qwen35.MODEL_TYPES:
        return qwen35.hf_name(gguf_name)
    if model_type == minimax_m2.MODEL_TYPE and (moe := minimax_m2.hf_name(gguf_name)):
        return moe
    if model_type == minimax_m3.MODEL_TYPE and (name := minimax_m3.hf_name(gguf_name)):
        return name
    if model_type == afmoe.MODEL_TYPE and (name := afmoe.hf_name(gguf_name)):
        return name
    if model_type == hy_v3.MODEL_TYPE and (name := hy_v3.hf_name(gguf_name)):
        return name
    if model_type == hunyuan.MOE_MODEL_TYPE and (name := hunyuan.moe_hf_name(gguf_name)):
        return name
    if model_type == arctic.MODEL_TYPE and (name := arctic.hf_name(gguf_name)):
        return name
    if model_type == maple.MODEL_TYPE and (name := maple.hf_name(gguf_name)):
        return name
    if model_type == grovemoe.MODEL_TYPE and (name := grovemoe.hf_name(gguf_name)):
        return name
    if model_type == grok.MODEL_TYPE and (name := grok.hf_name(gguf_name)):
        return name
    if model_type == dots1.MODEL_TYPE and (name := dots1.hf_name(gguf_name)):
        return name
    if model_type == laguna.MODEL_TYPE and (name := laguna.hf_name(gguf_name)):
        return name
    if model_type == hrm_text.MODEL_TYPE and (name := hrm_text.hf_name(gguf_name)):
        return name
    if model_type == minicpm3.MODEL_TYPE:
        return minicpm3.hf_name(gguf_name)
    if model_type == step3p5.MODEL_TYPE and (name := step3p5.hf_name(gguf_name)):
        return name
    if model_type == stablelm.MODEL_TYPE and (name := stablelm.hf_name(gguf_name)):
        return name
    if model_type == cohere2_moe.MODEL_TYPE and (name := cohere2_moe.hf_name(gguf_name)):
        return name
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if model_type in MOE_TYPES:
        name = _moe_name(parts, model_type)
        if name is not None:
            return f"{name}.{suffix}"
    names = _LAYER_NAMES
    if model_type in ("gemma2", "gemma3_text", gemma_embedding.MODEL_TYPE):
        names = {**_LAYER_NAMES, **_GEMMA2_LAYER_NAMES}
    elif model_type in olmo.MODEL_TYPES:
        names = {**_LAYER_NAMES, **olmo.LAYER_NAMES}
    elif model_type == glm4.MODEL_TYPE:
        names = {**_LAYER_NAMES, **glm4.LAYER_NAMES}
    elif model_type == chatglm.MODEL_TYPE:
        names = {**_LAYER_NAMES, **chatglm.LAYER_NAMES}
    elif model_type == seed_oss.MODEL_TYPE:
        names = {**_LAYER_NAMES, **seed_oss.LAYER_NAMES}
    elif model_type == exaone4.MODEL_TYPE:
        names = {**_LAYER_NAMES, **exaone4.LAYER_NAMES}
    elif model_type == muse_glimmer.MODEL_TYPE:
        names = {**_LAYER_NAMES, **muse_glimmer.LAYER_NAMES}
    elif model_type == hunyuan.MODEL_TYPE:
        names = {**_LAYER_NAMES, **hunyuan.LAYER_NAMES}
    elif model_type == llama4.MODEL_TYPE:
        names = {**_LAYER_NAMES, **llama4.LAYER_NAMES}
    elif model_type == apertus.MODEL_TYPE:
        names = {**_LAYER_NAMES, **apertus.LAYER_NAMES}
    elif model_type == bitnet.MODEL_TYPE:
        names = {**_LAYER_NAMES, **bitnet.LAYER_NAMES}
    elif model_type in granite.SWA_TYPES:
        names = {**_LAYER_NAMES, **granite.SWA_LAYER_NAMES}
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in names:
        return None
    name = names[parts[2]]
    if model_type == "phi3" and parts[2] == "ffn_up":
        name = "mlp.gate_up_proj"  # llama.cpp stores Phi-3's fused gate_up as ffn_up
    return f"model.layers.{parts[1]}.{name}.{suffix}"


def _moe_name(parts: list[str], model_type: str) -> str | None:
    """The HF module of blk.N.<name> in a mixture-of-experts layer, or None."""
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    block = f"model.layers.{parts[1]}.{'block_sparse_moe' if model_type == 'mixtral' else 'mlp'}"
    if parts[2] in EXPERT_STACKS:
        names = _EXPERT_NAMES.get(model_type, ("gate_proj", "up_proj", "down_proj"))
        return f"{block}.experts.{{expert}}.{names[EXPERT_STACKS.index(parts[2])]}"
    if parts[2] in _MOE_LAYER_NAMES:
        return f"{block}.{_MOE_LAYER_NAMES[parts[2]]}"
    return None


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """An HF-style config.json dict from GGUF metadata (and RoPE factor tensors)."""
    arch = gg.architecture
    granite.refuse(gg)
    if arch not in MODEL_TYPES:
        raise UnsupportedError(
            f"{gg.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    if arch == gpt_oss.ARCH:
        return gpt_oss.config_from_gguf(gg, _rope_from_gguf, _gemma_layer_types)
    if arch in deepseek2.ARCHS:
        return deepseek2.config_from_gguf(gg, _rope_from_gguf)
    if arch in dsa.ARCHS:
        return dsa.config_from_gguf(gg, _rope_from_gguf)
    if arch == dots3.ARCH:
        return dots3.config_from_gguf(gg, _rope_from_gguf)
    if arch == hy_v4.ARCH:
        return hy_v4.config_from_gguf(gg, _rope_from_gguf)
    if arch == deepseek4.ARCH:
        return deepseek4.config_from_gguf(gg, _rope_from_gguf)
    if arch in cohere.MODEL_TYPES:
        return cohere.config_from_gguf(gg, _rope_from_gguf, _gemma_layer_types)
    if arch == cohere2_moe.ARCH:
        return cohere2_moe.config_from_gguf(gg, _rope_from_gguf)
    if arch == gemma4.ARCH:
        return gemma4.config_from_gguf(gg)
    if arch == qwen4exp.ARCH:
        return qwen4exp.config_from_gguf(gg, _rope_from_gguf)
    if arch in qwen35.ARCHS:
        return qwen35.config_from_gguf(gg, _rope_from_gguf)
    if arch in lfm2.MODEL_TYPES:
        return lfm2.config_from_gguf(gg, _rope_from_gguf)
    if arch == kimi_linear.ARCH:
        return kimi_linear.config_from_gguf(gg)
    if arch == bailingmoe3.ARCH:
        return bailingmoe3.config_from_gguf(gg, _rope_from_gguf)
    if arch == glm5_next.ARCH:
        return glm5_next.config_from_gguf(gg)
    if arch == granitehybrid.ARCH:
        return granitehybrid.config_from_gguf(gg, _rope_from_gguf)
    if arch == falcon_h1.ARCH:
        return falcon_h1.config_from_gguf(gg, _rope_from_gguf)
    if arch == plamo.ARCH:
        return plamo.config_from_gguf(gg, _rope_from_gguf)
    if arch == plamo2.ARCH:
        return plamo2.config_from_gguf(gg, _rope_from_gguf)
    if arch == plamo3.ARCH:
        return plamo3.config_from_gguf(gg, _rope_from_gguf, _gemma_layer_types)
    if arch == mamba.ARCH:
        return mamba.config_from_gguf(gg)
    if arch == rwkv7.ARCH:
        return rwkv7.config_from_gguf(gg)
    if arch == rwkv6.ARCH:
        return rwkv6.config_from_gguf(gg)
    if arch == jamba.ARCH:
        return jamba.config_from_gguf(gg)
    if arch in nemotron_h.ARCHS:
        return nemotron_h.config_from_gguf(gg)
    if arch == laguna.ARCH:
        return laguna.config_from_gguf(gg, _rope_from_gguf)
    if arch == hrm_text.ARCH:
        return hrm_text.config_from_gguf(gg, _rope_from_gguf)
    if arch == mellum.ARCH:
        return mellum.config_from_gguf(gg, _rope_from_gguf, _gemma_layer_types)
    if arch == minicpm3.ARCH:
        return minicpm3.config_from_gguf(gg, _rope_from_gguf)
    if arch == step3p5.ARCH:
        return step3p5.config_from_gguf(gg)
    if arch == stablelm.ARCH:
        return stablelm.config_from_gguf(gg, _rope_from_gguf)
    if arch == olmo.OLMO1_ARCH:
        return olmo.olmo1_config_from_gguf(gg, _rope_from_gguf)
    if arch == starcoder2.ARCH:
        return starcoder2.config_from_gguf(gg, _rope_from_gguf)
    if arch == phi2.ARCH:
        return phi2.config_from_gguf(gg, _rope_from_gguf)
    if arch in alibi_families.ARCHS:
        return alibi_families.config_from_gguf(gg)
    if arch == gpt_bigcode.ARCH:
        return gpt_bigcode.config_from_gguf(gg)
    if arch == falcon.ARCH:
        return falcon.config_from_gguf(gg, _rope_from_gguf)
    if arch == gpt_neox.ARCH:
        return gpt_neox.config_from_gguf(gg, _rope_from_gguf)
    if arch == gpt2.ARCH:
        return gpt2.config_from_gguf(gg, _rope_from_gguf)
    if arch == mamba2.ARCH:
        return mamba2.config_from_gguf(gg)
    if arch == dbrx.ARCH:
        return dbrx.config_from_gguf(gg, _rope_from_gguf)
    if arch == minimax.ARCH:
        return minimax.config_from_gguf(gg, _rope_from_gguf)
    if arch == bert.ARCH:
        return bert.config_from_gguf(gg)
    if arch in nomic_bert.ARCHS:
        return nomic_bert.config_from_gguf(gg)
    if arch == jina_bert.ARCH:
        return jina_bert.config_from_gguf(gg)
    if arch == modernbert.ARCH:
        return modernbert.config_from_gguf(gg)
    if arch == eurobert.ARCH:
        return eurobert.config_from_gguf(gg, _rope_from_gguf)
    if arch == nemotron.ARCH:
        return nemotron.config_from_gguf(gg, _rope_from_gguf)
    if arch == jais2.ARCH:
        return jais2.config_from_gguf(gg, _rope_from_gguf)
    if arch == deci.ARCH:
        return deci.config_from_gguf(gg, _rope_from_gguf)
    if arch == t5.ARCH:
        return t5.config_from_gguf(gg)
    if arch == orion.ARCH:
        return orion.config_from_gguf(gg, _rope_from_gguf)
    if arch == grok.ARCH:
        return grok.config_from_gguf(gg, _rope_from_gguf)
    if arch == arctic.ARCH:
        return arctic.config_from_gguf(gg, _rope_from_gguf)
    if arch == maple.ARCH:
        return maple.config_from_gguf(gg, _rope_from_gguf)
    if arch == openelm.ARCH:
        return openelm.config_from_gguf(gg, _rope_from_gguf)
    if arch == plm.ARCH:
        return plm.config_from_gguf(gg, _rope_from_gguf)

    meta = ArchMetadata.of(gg)
    n_heads = meta.require(Keys.Attention.HEAD_COUNT)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    check_config({"hidden_size": hidden, "num_attention_heads": n_heads}, gg.path)
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // n_heads
    config: dict[str, Any] = {
        "model_type": MODEL_TYPES[arch],
        "hidden_size": hidden,
        # glm4moe: optional in llama.cpp (Solar Open's files, every layer experts, lack it).
        "intermediate_size": (
            meta.require(Keys.LLM.FEED_FORWARD_LENGTH)
            if arch != glm4_moe.ARCH
            else meta.get(Keys.LLM.FEED_FORWARD_LENGTH)
        ),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, n_heads),
        "head_dim": head_dim,
        # llama.cpp refuses a file without these (ml.get_key without `false`: the
        # general context_length in load_hparams, the norm's epsilon in every family's
        # load_arch_hparams); no default would be the model's.
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": meta.require(Keys.LLM.CONTEXT_LENGTH),
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gg.tensors,
    }
    if arch == gemma_embedding.ARCH:
        return gemma_embedding.finish_config(gg, config, _gemma_config, meta)
    if config["model_type"] in GEMMA_TYPES:
        return _gemma_config(gg, config, meta)
    if arch == gemma3n.ARCH:
        return gemma3n.finish_config(gg, config, meta, _rope_from_gguf, _gemma_layer_types)
    if arch in granite.ARCHS:
        granite.update_config(gg, config)
    if arch == olmo.ARCH:
        return olmo.config_from_gguf(gg, config, meta, _rope_from_gguf, _gemma_layer_types)
    if arch == "smollm3":
        # llama.cpp reads no key for SmolLM3's NoPE layers: every fourth, always
        # (llama_model_smollm3::load_arch_hparams, n_no_rope_layer_step = 4).
        config["no_rope_layer_interval"] = SMOLLM3_NO_ROPE_INTERVAL
    if arch in ("llama", "qwen2moe", "qwen3moe", "qwen3vlmoe"):
        _moe_config(gg, config)
    if arch == "mistral3" and meta.get(Keys.LLM.EXPERT_COUNT, 0):
        raise UnsupportedError(f"{gg.path}: a mistral3 model with experts is not supported")
    window = meta.get(Keys.Attention.SLIDING_WINDOW)
    if window:
        config["sliding_window"] = window
    rope = _rope_from_gguf(gg, meta, head_dim, config["max_position_embeddings"])
    temperature = meta.get(Keys.Attention.TEMPERATURE_SCALE, 0.0)
    if arch == "mistral3" and temperature:
        # Counted in steps of the YaRN original context, as llama.cpp counts them
        # (n_ctx_orig_yarn: the context length where the file gives none).
        config["model_type"] = "ministral3"
        rope["llama_4_scaling_beta"] = temperature
        if not rope.get("original_max_position_embeddings"):
            rope["original_max_position_embeddings"] = config["max_position_embeddings"]
    config["rope_parameters"] = rope
    finish = {
        glm4.ARCH: glm4.finish_config,
        chatglm.ARCH: chatglm.finish_config,
        minicpm.ARCH: minicpm.finish_config,
        glm4_moe.ARCH: glm4_moe.finish_config,
        bailingmoe.ARCH: bailingmoe.finish_config,
        bailingmoe.V2_ARCH: bailingmoe.finish_v2_config,
        deepseek.ARCH: deepseek.finish_config,
        deepseek.OCR_ARCH: deepseek.finish_ocr_config,
        qwen.ARCH: qwen.finish_config,
        ernie4_5.ARCH: ernie4_5.finish_config,
        ernie4_5.MOE_ARCH: ernie4_5.finish_config,
        ernie4_5.PADDLEOCR_ARCH: ernie4_5.finish_config,
        seed_oss.ARCH: seed_oss.finish_config,
        hunyuan.ARCH: hunyuan.finish_config,
        hunyuan.MOE_ARCH: hunyuan.finish_moe_config,
        hunyuan_vl.ARCH: hunyuan_vl.finish_config,
        dots1.ARCH: dots1.finish_config,
        minimax_m2.ARCH: minimax_m2.finish_config,
        minimax_m3.ARCH: minimax_m3.finish_config,
        apertus.ARCH: apertus.finish_config,
        granite.SWA_ARCH: granite.finish_swa_config,
        olmoe.ARCH: olmoe.finish_config,
        phimoe.ARCH: phimoe.finish_config,
        smallthinker.ARCH: smallthinker.finish_config,
        hy_v3.ARCH: hy_v3.finish_config,
        exaone.ARCH: exaone.finish_config,
        arcee.ARCH: arcee.finish_config,
        bitnet.ARCH: bitnet.finish_config,
        vl_text.QWEN2VL_ARCH: vl_text.finish_qwen2vl_config,
        **dict.fromkeys(vl_text.QWEN3VL_ARCHS, vl_text.finish_qwen3vl_config),
        internlm2.ARCH: internlm2.finish_config,
        baichuan.ARCH: baichuan.finish_config,
        nanbeige.ARCH: nanbeige.finish_config,
        grovemoe.ARCH: grovemoe.finish_config,
    }.get(arch)
    if finish is not None:
        finish(gg, config, meta)
    if arch == exaone4.ARCH:
        exaone4.finish_config(gg, config, _gemma_layer_types)
    if arch == exaone_moe.ARCH:
        exaone_moe.finish_config(gg, config, meta, _gemma_layer_types)
    if arch == mimo2.ARCH:
        mimo2.finish_config(gg, config, meta)
    if arch == llama4.ARCH:
        llama4.finish_config(gg, config, meta, _gemma_layer_types)
    if arch == afmoe.ARCH:
        afmoe.finish_config(gg, config, meta, _gemma_layer_types)
    if arch == muse_glimmer.ARCH:
        muse_glimmer.finish_config(gg, config, meta, _gemma_layer_types)
    return config


# The shape fields of a config (HF names) that must be positive whole numbers where given.
_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


def check_config(config: dict[str, Any], where: Any) -> None:
    """Refuse, as ModelFormatError naming `where`, a config whose sizes no model can have:
    a size that is not a positive whole number, KV heads that do not divide the heads,
    heads that do not divide the hidden size where no head_dim says otherwise."""
    for name in _SIZES:
        value = config.get(name)
        # A list: one per layer (Gemma 3n's intermediate_size).
        for size in value if isinstance(value, list) else [value]:
            if size is not None and not (
                isinstance(size, int) and not isinstance(size, bool) and size > 0
            ):
                raise ModelFormatError(f"{where}: {name} is {value!r}, not a positive whole number")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise ModelFormatError(
            f"{where}: {heads} attention heads cannot share {kv_heads} key/value heads"
        )
    hidden = config.get("hidden_size")
    if heads and hidden and not config.get("head_dim") and hidden % heads:
        raise ModelFormatError(
            f"{where}: a hidden size of {hidden} does not split into {heads} heads"
        )


def _moe_config(gg: GGUFFile, config: dict[str, Any]) -> None:
    """The experts' HF config fields, read as llama.cpp reads them: expert_count and
    expert_used_count for every architecture (llama-model.cpp load_hparams; a llama
    file with experts is Mixtral), and in src/models/{llama,qwen2moe,qwen3moe,qwen3vlmoe}.cpp
    softmax gating, renormalized top-k weights for llama and qwen3(vl)moe but not for
    qwen2moe, and expert widths that default to feed_forward_length / expert_used_count
    (Qwen2-MoE's shared expert: feed_forward_length). The gating, renormalization and
    scale keys, where a file has them, must agree with what the family computes."""
    arch, ff = gg.architecture, config["intermediate_size"]
    meta = ArchMetadata.of(gg)
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    if not count:
        if arch != "llama":
            raise ModelFormatError(
                f"{gg.path}: {meta.name(Keys.LLM.EXPERT_COUNT)} is missing or 0; {arch} has experts"
            )
        return  # a dense Llama
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC)
    if gating is not None and gating != ExpertGatingFuncType.SOFTMAX:
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        raise UnsupportedError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is "
            f"{known.get(gating, f'{gating} (unknown)')}; {arch} experts are gated by softmax, "
            "the only gating function llmrun supports"
        )
    scale = meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE)
    if scale not in (None, 0.0, 1.0):
        raise UnsupportedError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_WEIGHTS_SCALE)} is {scale}; llmrun supports "
            "unscaled expert weights only"
        )
    norm = meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM)
    width = meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{gg.path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between "
                "layers, which llmrun does not support"
            )
        width = width[0]
    if arch == "llama":
        if norm is False:
            raise UnsupportedError(
                f"{gg.path}: {meta.name(Keys.LLM.EXPERT_WEIGHTS_NORM)} is false, but Mixtral "
                "renormalizes its top-k expert weights"
            )
        # Its experts are feed_forward_length wide (llama.cpp's llama reads no other width).
        config.update(model_type="mixtral", num_local_experts=count, num_experts_per_tok=used)
        return
    config.update(
        num_experts=count,
        num_experts_per_tok=used,
        moe_intermediate_size=width or ff // used,
        norm_topk_prob=arch in ("qwen3moe", "qwen3vlmoe") if norm is None else bool(norm),
    )
    if arch == "qwen2moe":
        shared = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
        config["shared_expert_intermediate_size"] = shared or ff
        config["qkv_bias"] = config["attention_bias"]


# Where a Gemma GGUF leaves out what an HF config says, llmrun reads the file as
# llama.cpp does (its reading defines the format): llama.cpp's
# src/models/gemma2.cpp and gemma3.cpp, llama_model_gemma*::load_arch_hparams
# (llama-model.cpp's load_hparams in older releases), its defaults in
# src/llama-hparams.h, and the general keys in llama-model.cpp load_hparams.
GEMMA2_SWA_PATTERN = 2  # load_swa_pattern(ml, 2): even layers local
GEMMA3_SWA_PATTERN = 6  # load_swa_pattern(ml, 6): every sixth layer global
GEMMA2_SLIDING_WINDOW = 4096  # hparams.n_swa = 4096, "default value of gemma 2"
GEMMA2_SOFTCAPS = (50.0, 30.0)  # f_attn_logit_softcapping, f_final_logit_softcapping
ROPE_BASE = 10000.0  # rope_freq_base_train, and Gemma 3's rope_freq_base_train_swa
# n_layer of the 27B models, whose queries llama.cpp scales by (n_embd / n_head)^-0.5.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def _gemma_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> dict[str, Any]:
    """Gemma's HF config fields from a GGUF (config holds the common ones)."""
    arch, model_type = gg.architecture, config["model_type"]

    config["hidden_activation"] = "gelu_pytorch_tanh"  # its graphs use LLM_FFN_GELU
    context, head_dim = config["max_position_embeddings"], config["head_dim"]
    rope = _rope_from_gguf(gg, meta, head_dim, context)
    if model_type == "gemma":
        config["rope_parameters"] = rope
        return config
    layers = config["num_hidden_layers"]
    # Gemma 2/3: llama.cpp scales the queries itself (f_attention_scale) and reads
    # no key for it: head_dim^-0.5, but (n_embd / n_head)^-0.5 for the 27B.
    if layers == GEMMA_27B_LAYERS[model_type]:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        config["query_pre_attn_scalar"] = head_dim
    local_base = meta.get(Keys.Rope.FREQ_BASE_SWA)
    if model_type == "gemma2":
        window = meta.get(Keys.Attention.SLIDING_WINDOW, GEMMA2_SLIDING_WINDOW)
        pattern = GEMMA2_SWA_PATTERN
        attn_cap, final_cap = GEMMA2_SOFTCAPS
        config["attn_logit_softcapping"] = meta.get(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, attn_cap)
        config["final_logit_softcapping"] = meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, final_cap)
        if local_base is not None and local_base != rope["rope_theta"]:
            raise UnsupportedError(
                f"{gg.path}: {Keys.Rope.FREQ_BASE_SWA.format(arch=arch)} differs from "
                f"{Keys.Rope.FREQ_BASE.format(arch=arch)}; Gemma 2 has one RoPE base"
            )
        config["rope_parameters"] = rope
    else:
        # Without a window llama.cpp runs every layer as a global one (LLAMA_SWA_TYPE_NONE).
        window = meta.get(Keys.Attention.SLIDING_WINDOW) or None
        pattern = GEMMA3_SWA_PATTERN
        final_cap = meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0)
        config["final_logit_softcapping"] = final_cap or None  # 0: none
        # The scaling keys are the global layers'; local layers are never scaled.
        local = {
            "rope_type": "default",
            "rope_theta": ROPE_BASE if local_base is None else local_base,
        }
        config["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    config["sliding_window"] = window
    config["layer_types"] = _gemma_layer_types(gg, meta, layers, pattern if window else None)
    return config


def _gemma_layer_types(
    gg: GGUFFile, meta: ArchMetadata, layers: int, pattern: int | None
) -> list[str]:
    """llama.cpp's load_swa_pattern: a per-layer bool array under
    attention.sliding_window_pattern, else an int n there (default `pattern`): layer
    i is local when n == 0 or i % n < n - 1. No window: every layer global."""
    if pattern is None:
        return ["full_attention"] * layers
    value = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN, pattern)
    if isinstance(value, list):
        if len(value) != layers:
            raise ModelFormatError(
                f"{gg.path}: {Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=gg.architecture)} "
                f"lists {len(value)} layers, but the model has {layers}"
            )
        local = [bool(v) for v in value]
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        local = [value == 0 or i % value < value - 1 for i in range(layers)]
    else:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=gg.architecture)} "
            f"is {value!r}, not a layer count or a list of flags"
        )
    return ["sliding_attention" if s else "full_attention" for s in local]


def _rope_from_gguf(
    gg: GGUFFile, meta: ArchMetadata, head_dim: int, context: int
) -> dict[str, Any]:
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": meta.get(Keys.Rope.FREQ_BASE, 10000.0),
    }
    rot_dims = meta.get(Keys.Rope.DIMENSION_COUNT)
    if rot_dims and rot_dims != head_dim:
        rope["partial_rotary_factor"] = rot_dims / head_dim
    scaling = meta.get(Keys.Rope.SCALING_TYPE, "none")
    original = meta.get(Keys.Rope.SCALING_ORIG_CTX_LEN)
    if scaling == "linear":
        rope.update(rope_type="linear", factor=meta.get(Keys.Rope.SCALING_FACTOR, 1.0))
    elif scaling == "yarn":
        rope.update(
            rope_type="yarn",
            factor=meta.get(Keys.Rope.SCALING_FACTOR),
            original_max_position_embeddings=original or context,  # llama.cpp's default
        )
        for template, field in (
            (Keys.Rope.SCALING_YARN_BETA_FAST, "beta_fast"),
            (Keys.Rope.SCALING_YARN_BETA_SLOW, "beta_slow"),
        ):
            value = meta.get(template)
            if value is not None:
                rope[field] = value
        log_mul = meta.get(Keys.Rope.SCALING_YARN_LOG_MUL)
        if log_mul:
            # HF's mscale_all_dim; llama.cpp takes the config's mscale to be 1.
            rope.update(mscale=1.0, mscale_all_dim=log_mul)
    elif scaling == "longrope" and "rope_factors_long.weight" not in gg.tensors:
        raise ModelFormatError(
            f"{gg.path}: RoPE scaling 'longrope' without its rope_factors_long/short tensors"
        )
    elif scaling not in ("none", None, "longrope"):  # longrope: read from its tensors below
        raise UnsupportedError(
            f"{gg.path}: RoPE scaling {scaling!r} is not supported (none, linear, yarn are)"
        )
    if "rope_factors_long.weight" in gg.tensors:
        rope.update(
            rope_type="longrope",
            long_factor=read_float_list(gg, "rope_factors_long.weight"),
            short_factor=read_float_list(gg, "rope_factors_short.weight"),
            original_max_position_embeddings=original or context,
        )
        attn_factor = meta.get(Keys.Rope.SCALING_ATTN_FACTOR)
        if attn_factor is not None:
            rope["attention_factor"] = attn_factor
    elif "rope_freqs.weight" in gg.tensors:
        # Llama 3.1-style scaling, stored by llama.cpp as per-frequency divisors.
        rope["freq_factors"] = read_float_list(gg, "rope_freqs.weight")
    return rope
