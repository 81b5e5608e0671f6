"""The type each tensor gets under each preset (llmrun.quant.presets) is llama.cpp's, and so
is the refusal of a mix that needs an importance matrix when none is given.

The expected types are llama.cpp's own: the models of quantize_helpers (16 layers with
4x GQA and tied embeddings, 16 with MHA and an output matrix, 4 with 8 experts, 80 with
GQA, which llama.cpp takes for a 70B, and a falcon; rows of 256) quantized once by llama_model_quantize of the llama-cpp-python
0.3.36 wheel under each preset and option, their 'name TYPE' lines (in file order)
recorded as a sha256 beside a count of each type (which says more when a digest
differs).
"""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from gguf import GGMLQuantizationType as T
from quantize_helpers import VARIANTS, write_falcon_model, write_model

from llmrun.errors import UnsupportedError, UsageError
from llmrun.loading.gguf_io import read_gguf
from llmrun.quant import presets
from llmrun.quantize import plan

OPTIONS = {
    "": presets.Overrides(),
    "leave-output": presets.Overrides(leave_output_tensor=True),
    "pure": presets.Overrides(pure=True),
    "output-q8_0-embd-q4_0": presets.Overrides(
        output_tensor_type=T.Q8_0, token_embedding_type=T.Q4_0
    ),
    "output-q5_k": presets.Overrides(output_tensor_type=T.Q5_K),
    "embd-f16": presets.Overrides(token_embedding_type=T.F16),
}
# (variant, preset, option): (sha256 of llama.cpp's "name TYPE" lines, its type counts)
LLAMA_CPP_TYPES = {
    ("gqa4-tied", "F32", ""): (
        "f427a4aee10397c8e30ee61bc43d5a21108fcbdab32fc98d14ae1cc96f00aced",
        "F32:146",
    ),
    ("gqa4-tied", "F16", ""): (
        "6939aeb998facf237bc451ff39e06fa97e9c992683ae5846e425fc8bfab3b5ba",
        "F16:113 F32:33",
    ),
    ("gqa4-tied", "BF16", ""): (
        "d20b63a41bc648c32e4649ebdd52aa77119b94658e9b9ff46c1e65d90173e301",
        "BF16:113 F32:33",
    ),
    ("gqa4-tied", "Q8_0", ""): (
        "8192ce1d3283a12db81d3271ea489dcfbc899225d1405b74a4ea469c5d0d0a8a",
        "F32:33 Q8_0:113",
    ),
    ("gqa4-tied", "Q4_0", ""): (
        "2b0723b6c164e55fdf7387f94ff31b99561e2065ecc6ba294aa7c489d41c9ff4",
        "F32:33 Q4_0:112 Q6_K:1",
    ),
    ("gqa4-tied", "Q4_1", ""): (
        "b595a72d60de73a6260f0bb0fe0958001f237d55473bd5cabc4c422a0de29f34",
        "F32:33 Q4_1:112 Q6_K:1",
    ),
    ("gqa4-tied", "Q5_0", ""): (
        "ec8f89d00f16c0dd349d4ada23fb4f8d9e8a18267983ebccc0fec3c535cc1f72",
        "F32:33 Q5_0:112 Q6_K:1",
    ),
    ("gqa4-tied", "Q5_1", ""): (
        "8a863f820c853ebb593b4618c14be70da446e4fee1f0679cd27bec64cb2fd6c7",
        "F32:33 Q5_1:112 Q6_K:1",
    ),
    ("gqa4-tied", "Q2_K", ""): (
        "edfe74a3005ba881b30c3a7d9694d8b49d96244a1b480ce83fe0f9b34dfea26a",
        "F32:33 Q2_K:64 Q3_K:32 Q4_K:16 Q6_K:1",
    ),
    ("gqa4-tied", "Q3_K_S", ""): (
        "4503510f2d37541dc2d50b2cd22cde97634f2485eec6abe01da45ab0dcc50e42",
        "F32:33 Q3_K:112 Q6_K:1",
    ),
    ("gqa4-tied", "Q3_K_M", ""): (
        "b961d76fd079c5d95fe8692530b716dc464d6a58040981ae0327a9efd04926c4",
        "F32:33 Q3_K:64 Q4_K:45 Q5_K:3 Q6_K:1",
    ),
    ("gqa4-tied", "Q3_K_L", ""): (
        "088870dff71876dd64891e60316049336fbacf12ee9b3622790bcf896a21c2c7",
        "F32:33 Q3_K:64 Q5_K:48 Q6_K:1",
    ),
    ("gqa4-tied", "Q4_K_S", ""): (
        "250bd2a7fe44b8d5978559cfef9481345b55429fb3e001048a3ae39d4dce4b10",
        "F32:33 Q4_K:106 Q5_K:6 Q6_K:1",
    ),
    ("gqa4-tied", "Q4_K_M", ""): (
        "786f6eec33fb82d2c127597d4948221b82ee4fc46114dee2a21d0a9bb2075af8",
        "F32:33 Q4_K:96 Q6_K:17",
    ),
    ("gqa4-tied", "Q5_K_S", ""): (
        "f712f36d3407e1bce7e0b63504d104690623ebbb005cd59827dc4fede2e2da00",
        "F32:33 Q5_K:112 Q6_K:1",
    ),
    ("gqa4-tied", "Q5_K_M", ""): (
        "47f5a26b9abef03c27b21831a5c9f07d6a4bf5d48e119602ca9ad2fdbff4cce0",
        "F32:33 Q5_K:96 Q6_K:17",
    ),
    ("gqa4-tied", "Q6_K", ""): (
        "ca85e3b5889aa6a9ada2eb7a65820092f004407efa32c863416fad202e70dd85",
        "F32:33 Q6_K:113",
    ),
    ("mha-untied", "F32", ""): (
        "78e81f748b23a34a0464a016e98eff9323d44110aeb5057e5c33f7c870578557",
        "F32:147",
    ),
    ("mha-untied", "F16", ""): (
        "fd1bad70989be952b2baf0d5a844cd831f69478081f9c97eb20a3480c1e4701b",
        "F16:114 F32:33",
    ),
    ("mha-untied", "BF16", ""): (
        "f7fd10b37a7143645e9bc88c94294e3587ba2d8fa1377be0bd51fe8888e7f9a1",
        "BF16:114 F32:33",
    ),
    ("mha-untied", "Q8_0", ""): (
        "b64723e1f33689906a6959156ad1d0159ec21d939a3a739bd5f557b01b4f37eb",
        "F32:33 Q8_0:114",
    ),
    ("mha-untied", "Q4_0", ""): (
        "b154466ea6268a5bf8eef24730d4c3aa84deaa87395dae0eea8f0c6645dd13f0",
        "F32:33 Q4_0:113 Q6_K:1",
    ),
    ("mha-untied", "Q4_1", ""): (
        "16c51e50d43f5afbe8217b6d4bdfee7f7cb1bcef23c686767e112e8aa389b718",
        "F32:33 Q4_1:113 Q6_K:1",
    ),
    ("mha-untied", "Q5_0", ""): (
        "7a462598e36821ed8760991be673c47d88c1ac51e3119672ccac4be028ccec17",
        "F32:33 Q5_0:113 Q6_K:1",
    ),
    ("mha-untied", "Q5_1", ""): (
        "4857a4b7caa6f8480a3e17240b09a6a20d03a99754200f94c9e43aec17d7ee3c",
        "F32:33 Q5_1:113 Q6_K:1",
    ),
    ("mha-untied", "Q2_K", ""): (
        "7629a34f1adfb3d3eb8801cd8bc7be151c18734cb30ff40e1b12f6044830fc22",
        "F32:33 Q2_K:65 Q3_K:48 Q6_K:1",
    ),
    ("mha-untied", "Q3_K_S", ""): (
        "9cb19653bf2e3788ededc05f21c11eb5437e5d613b7b26b57c8b159701236916",
        "F32:33 Q3_K:113 Q6_K:1",
    ),
    ("mha-untied", "Q3_K_M", ""): (
        "da14c3e56e90980ecbbf7b486e990023e7d265571c091e7a14af47fcd6315845",
        "F32:33 Q3_K:65 Q4_K:45 Q5_K:3 Q6_K:1",
    ),
    ("mha-untied", "Q3_K_L", ""): (
        "a7bfce777ececd08e04664506681ff47f90d7e6a23f0bd833ebc4eca28ee8beb",
        "F32:33 Q3_K:65 Q5_K:48 Q6_K:1",
    ),
    ("mha-untied", "Q4_K_S", ""): (
        "439f38c4faeb2ac089586cc5f5eec77b9107f876c681338f26c70d7eff23794b",
        "F32:33 Q4_K:107 Q5_K:6 Q6_K:1",
    ),
    ("mha-untied", "Q4_K_M", ""): (
        "549b9fec10a806cbc98cf1fe503c70ea079b95b65953164ff26eec9325605535",
        "F32:33 Q4_K:97 Q6_K:17",
    ),
    ("mha-untied", "Q5_K_S", ""): (
        "80fdba67301d57cf3677dc69177cbf8a5712c095a92aebb3874a3fdb6820774e",
        "F32:33 Q5_K:113 Q6_K:1",
    ),
    ("mha-untied", "Q5_K_M", ""): (
        "2335944467ef165d67a17ae59980f48abe42974cab554a27a701d4f69d2c86ed",
        "F32:33 Q5_K:97 Q6_K:17",
    ),
    ("mha-untied", "Q6_K", ""): (
        "701a1c5417798126eef4cf5e17eb28941f2bd86ba03a67cb0d08fb501f768e58",
        "F32:33 Q6_K:114",
    ),
    ("8-experts", "F32", ""): (
        "cbf0270c6d87ee7953443554d2f0ffdd5cf42ad6d1c94b4c100e295b7bf73c70",
        "F16:4 F32:39",
    ),
    ("8-experts", "F16", ""): (
        "373046545f0b73ac1e5dedf6af36140b690362a5e3d7932454e9c48e3accb381",
        "F16:34 F32:9",
    ),
    ("8-experts", "BF16", ""): (
        "461ac5fe9acd1e48b96deba1d00aa3f1807aecf6677a7bfc3c642ad7ed533c9a",
        "BF16:30 F16:4 F32:9",
    ),
    ("8-experts", "Q8_0", ""): (
        "b2be914516da124f4b47c662e40a2dd7fd93011354fba5d3f2f54cececbf9756",
        "F16:4 F32:9 Q8_0:30",
    ),
    ("8-experts", "Q4_0", ""): (
        "e6b0383231bd3558b0c12578aa555b004d1b0124aa8d0a40a2ab52ff25aa5df2",
        "F16:4 F32:9 Q4_0:21 Q6_K:1 Q8_0:8",
    ),
    ("8-experts", "Q4_1", ""): (
        "1a01dc1e838c9d24c48a1226afbbd26ac8572854f85df9f2772eee5c211c5ce5",
        "F16:4 F32:9 Q4_1:21 Q6_K:1 Q8_0:8",
    ),
    ("8-experts", "Q5_0", ""): (
        "07e765ce7914f43a6343006727f27a8057228dd5aacf1b251789e4f23cfa5b5f",
        "F16:4 F32:9 Q5_0:21 Q6_K:1 Q8_0:8",
    ),
    ("8-experts", "Q5_1", ""): (
        "97dedf0dafb2253f31ebe9f61ebec17accaa185b7b5d5ad537ee7ddd542a32cf",
        "F16:4 F32:9 Q5_1:21 Q6_K:1 Q8_0:8",
    ),
    ("8-experts", "Q2_K", ""): (
        "298502b9ca0b324fe2b91e0e477b85401f2f8d352fdd9ef5bce14ebaab68e46e",
        "F16:4 F32:9 Q2_K:13 Q3_K:4 Q5_K:4 Q6_K:1 Q8_0:8",
    ),
    ("8-experts", "Q3_K_S", ""): (
        "08fa2862d7d7e78cc1483967b5637a3b80f29026ff92a6c60b62d41a482e8d51",
        "F16:4 F32:9 Q3_K:17 Q5_K:4 Q6_K:1 Q8_0:8",
    ),
    ("8-experts", "Q3_K_M", ""): (
        "b004f0bc21cb60bcb0666d1b1204db9f6c2bfa97737f45b25d3ba7bab3b9c95d",
        "F16:4 F32:9 Q3_K:13 Q4_K:4 Q5_K:4 Q6_K:1 Q8_0:8",
    ),
    ("8-experts", "Q3_K_L", ""): (
        "10996f734312255653062b36318d3ddf7ab9dedeb79516f880f8e9ae02ac91a1",
        "F16:4 F32:9 Q3_K:17 Q5_K:4 Q6_K:1 Q8_0:8",
    ),
    ("8-experts", "Q4_K_S", ""): (
        "2937f88db15de200696d12ac715a61c492b49b9c738d433668d901db3c339f1e",
        "F16:4 F32:9 Q4_K:17 Q5_K:4 Q6_K:1 Q8_0:8",
    ),
    ("8-experts", "Q4_K_M", ""): (
        "a1c55b49f6984ddea0002f1feda969bf5f10299729468e7fa99c9092d5dfdba0",
        "F16:4 F32:9 Q4_K:15 Q5_K:4 Q6_K:3 Q8_0:8",
    ),
    ("8-experts", "Q5_K_S", ""): (
        "dbb1367932c6cd2bd48286d5708ad6065d9053a230347852e0a5f0572e5cbbd4",
        "F16:4 F32:9 Q5_K:21 Q6_K:1 Q8_0:8",
    ),
    ("8-experts", "Q5_K_M", ""): (
        "815a6bc5d9664f5aee46246cf3f0a09b77c79433912477338b5b1e99fb27c516",
        "F16:4 F32:9 Q5_K:19 Q6_K:3 Q8_0:8",
    ),
    ("8-experts", "Q6_K", ""): (
        "bcb673bc28fb116ea28e9bf445d22e763cd5d4710ebf620fa446d1b40bd254c5",
        "F16:4 F32:9 Q6_K:22 Q8_0:8",
    ),
    ("mha-untied", "Q4_K_M", "leave-output"): (
        "71b5988cda6e8abff9231aa997e8e9a9d0054d39b71df032b74a4c771d4f9a82",
        "F16:1 F32:33 Q4_K:97 Q6_K:16",
    ),
    ("mha-untied", "Q3_K_M", "pure"): (
        "7a4a6e2df32debaeb082b83637484ae05a5e3dbf321f5afdf612a65403931c15",
        "F32:33 Q3_K:114",
    ),
    ("mha-untied", "Q5_K_M", "output-q8_0-embd-q4_0"): (
        "466152eb17c59e38b572ea0775d318391384b53b198718598c291d80c7cfe118",
        "F32:33 Q4_0:1 Q5_K:96 Q6_K:16 Q8_0:1",
    ),
    ("gqa4-tied", "Q4_K_S", "output-q5_k"): (
        "8ea13d22b018c52b4ae4399fd0e7be2137e0fd25a1b1842d8ee6d949ae3ddd2d",
        "F32:33 Q4_K:106 Q5_K:7",
    ),
    ("gqa4-tied", "Q2_K", "embd-f16"): (
        "fcede9e435f261b5c2468d8b9e770848e9e7dacd10288ac1f5547024cfc0269f",
        "F16:1 F32:33 Q2_K:64 Q3_K:32 Q4_K:16",
    ),
    ("80-layers-gqa", "Q2_K", ""): (
        "d71c81f20e14969352d753d17c45b395bf8bda431f4a6173a0088c89bffa092d",
        "F32:161 Q2_K:321 Q3_K:160 Q5_K:80 Q6_K:1",
    ),
    ("80-layers-gqa", "Q3_K_M", ""): (
        "e2635940622886c87ee47131e4aecf234f621005ddada62b9e9744a00a79d476",
        "F32:161 Q3_K:321 Q4_K:155 Q5_K:85 Q6_K:1",
    ),
    ("80-layers-gqa", "Q3_K_L", ""): (
        "09214e76d9ece1d6cb36f9353a7e842b8842f02feb1b1fe07e51c07820c9e8b7",
        "F32:161 Q3_K:321 Q5_K:240 Q6_K:1",
    ),
    ("80-layers-gqa", "Q4_K_M", ""): (
        "09836ecf21fb62e747172f8f0203ba230f07c8391c720e4156a78820340126e5",
        "F32:161 Q4_K:441 Q5_K:40 Q6_K:81",
    ),
    ("80-layers-gqa", "Q4_K_S", ""): (
        "d7f0e64ab30060d12a023df4ab85f04283211eaed3af78e3018c381ea610c335",
        "F32:161 Q4_K:471 Q5_K:90 Q6_K:1",
    ),
    ("80-layers-gqa", "Q5_K_M", ""): (
        "e0e82aacd66bb41c11f8d06584fb80025691d2e557bc82546a94927f4a62ac10",
        "F32:161 Q5_K:481 Q6_K:81",
    ),
    ("falcon", "Q2_K", ""): (
        "225989753f79ff0c68d804e806a1ebeeb22b797280a109f87aed0a186bfcedaa",
        "F32:18 Q2_K:17 Q3_K:8 Q4_K:8 Q8_0:1",
    ),
    ("falcon", "Q3_K_M", ""): (
        "72f4787fe9e2e9a54d11c065c83e7208930b127518fc3e3fddcc5204beafe808",
        "F32:18 Q3_K:21 Q4_K:10 Q5_K:2 Q8_0:1",
    ),
    ("falcon", "Q3_K_L", ""): (
        "3baedbf5a79248d46fdeef3337deec546301c94644785262f5efde9d9a21ff7c",
        "F32:18 Q3_K:9 Q4_K:16 Q5_K:8 Q8_0:1",
    ),
    ("falcon", "Q4_K_M", ""): (
        "b273d2752b8b435dc96c3d147e3409bed06cd2ebb37d4c85c229f07a5902601b",
        "F32:18 Q4_K:25 Q5_K:4 Q6_K:4 Q8_0:1",
    ),
    ("falcon", "Q4_K_S", ""): (
        "229c15358fa96e750d56272525af949a5c0001f8478f697fc7391c700e74fec7",
        "F32:18 Q4_K:29 Q5_K:4 Q8_0:1",
    ),
    ("falcon", "Q5_K_M", ""): (
        "c7db5c1995753f2a10e4e38e69b013faf404eba232dd5a8403b0386ac85bb0e7",
        "F32:18 Q5_K:25 Q6_K:8 Q8_0:1",
    ),
}

# The i-quant, ternary and Q2_K_S presets and Q4_0/Q5_0 with an importance matrix, on the
# same models, without one and with one (llama_model_quantize's params.imatrix, seeded
# values for every 2-D tensor but token_embd.weight): (variant, preset, has_imatrix) -> the
# first 16 hex digits of the sha256 of llama.cpp's "name TYPE" lines, or the first tensor
# it named when it refused the mix ("this quantization requires an importance matrix").
LLAMA_CPP_IQ_TYPES = {
    ("gqa4-tied", "IQ4_NL", False): "cd1bd574f15ccb89",
    ("gqa4-tied", "IQ4_NL", True): "55fabcea8f89af1f",
    ("gqa4-tied", "IQ4_XS", False): "01a5bb6df08d9737",
    ("gqa4-tied", "IQ4_XS", True): "c08b6896c47cf001",
    ("gqa4-tied", "IQ3_M", False): "0f68936bf7c260a5",
    ("gqa4-tied", "IQ3_M", True): "0f68936bf7c260a5",
    ("gqa4-tied", "IQ3_S", False): "0b35cafb6b7c90b7",
    ("gqa4-tied", "IQ3_S", True): "0b35cafb6b7c90b7",
    ("gqa4-tied", "IQ3_XS", False): "refused: blk.0.attn_k.weight",
    ("gqa4-tied", "IQ3_XS", True): "a3b7d3360fedc753",
    ("gqa4-tied", "IQ3_XXS", False): "refused: blk.0.attn_k.weight",
    ("gqa4-tied", "IQ3_XXS", True): "ba591862249ddf2c",
    ("gqa4-tied", "IQ2_M", False): "refused: blk.0.attn_k.weight",
    ("gqa4-tied", "IQ2_M", True): "cf3d290340c08c1a",
    ("gqa4-tied", "IQ2_S", False): "refused: blk.0.attn_k.weight",
    ("gqa4-tied", "IQ2_S", True): "53f217a9618f44f7",
    ("gqa4-tied", "IQ2_XS", False): "refused: blk.0.attn_k.weight",
    ("gqa4-tied", "IQ2_XS", True): "1fad126d5a6cb02e",
    ("gqa4-tied", "IQ2_XXS", False): "refused: blk.0.attn_k.weight",
    ("gqa4-tied", "IQ2_XXS", True): "72721e58360e8e25",
    ("gqa4-tied", "IQ1_M", False): "refused: blk.0.attn_k.weight",
    ("gqa4-tied", "IQ1_M", True): "8f28586aaa7a36d9",
    ("gqa4-tied", "IQ1_S", False): "refused: blk.0.attn_k.weight",
    ("gqa4-tied", "IQ1_S", True): "519d881853aba699",
    ("gqa4-tied", "TQ2_0", False): "b43c0bba2d63cf77",
    ("gqa4-tied", "TQ2_0", True): "b43c0bba2d63cf77",
    ("gqa4-tied", "TQ1_0", False): "6a8e0d5d7356d111",
    ("gqa4-tied", "TQ1_0", True): "6a8e0d5d7356d111",
    ("gqa4-tied", "Q2_K_S", False): "refused: blk.0.attn_k.weight",
    ("gqa4-tied", "Q2_K_S", True): "2fc72af282734e4f",
    ("gqa4-tied", "Q4_0", True): "9eea8ceb59d6b663",
    ("gqa4-tied", "Q5_0", True): "b24c89c10baf535f",
    ("mha-untied", "IQ4_NL", False): "b72a8b4e32f8dd28",
    ("mha-untied", "IQ4_NL", True): "52b08571908549dc",
    ("mha-untied", "IQ4_XS", False): "581e922fd08ad729",
    ("mha-untied", "IQ4_XS", True): "3eff8c5fa630ab09",
    ("mha-untied", "IQ3_M", False): "8d612e4be07b73bb",
    ("mha-untied", "IQ3_M", True): "8d612e4be07b73bb",
    ("mha-untied", "IQ3_S", False): "6b85c97b1693ddcd",
    ("mha-untied", "IQ3_S", True): "6b85c97b1693ddcd",
    ("mha-untied", "IQ3_XS", False): "refused: blk.0.attn_k.weight",
    ("mha-untied", "IQ3_XS", True): "5da3476b200d0098",
    ("mha-untied", "IQ3_XXS", False): "refused: blk.0.attn_k.weight",
    ("mha-untied", "IQ3_XXS", True): "525b5b44addc405d",
    ("mha-untied", "IQ2_M", False): "refused: blk.0.attn_k.weight",
    ("mha-untied", "IQ2_M", True): "8e4c84a0e4f39bf5",
    ("mha-untied", "IQ2_S", False): "refused: blk.0.attn_k.weight",
    ("mha-untied", "IQ2_S", True): "72dadadb674f0a7d",
    ("mha-untied", "IQ2_XS", False): "refused: blk.0.attn_k.weight",
    ("mha-untied", "IQ2_XS", True): "8203af77bec238da",
    ("mha-untied", "IQ2_XXS", False): "refused: blk.0.attn_k.weight",
    ("mha-untied", "IQ2_XXS", True): "a2ad8ac02879ef84",
    ("mha-untied", "IQ1_M", False): "refused: blk.0.attn_k.weight",
    ("mha-untied", "IQ1_M", True): "0361af9e8a97237f",
    ("mha-untied", "IQ1_S", False): "refused: blk.0.attn_k.weight",
    ("mha-untied", "IQ1_S", True): "7fe39d8611fdc573",
    ("mha-untied", "TQ2_0", False): "009656cdb7891a4c",
    ("mha-untied", "TQ2_0", True): "009656cdb7891a4c",
    ("mha-untied", "TQ1_0", False): "abec7365989c6fdd",
    ("mha-untied", "TQ1_0", True): "abec7365989c6fdd",
    ("mha-untied", "Q2_K_S", False): "refused: blk.0.attn_k.weight",
    ("mha-untied", "Q2_K_S", True): "58e28eab9467a191",
    ("mha-untied", "Q4_0", True): "905185357c51dd5b",
    ("mha-untied", "Q5_0", True): "87123a31f32ef654",
    ("8-experts", "IQ4_NL", False): "e33a930e2f27db40",
    ("8-experts", "IQ4_NL", True): "e33a930e2f27db40",
    ("8-experts", "IQ4_XS", False): "0f6daedd9bd2ee46",
    ("8-experts", "IQ4_XS", True): "0f6daedd9bd2ee46",
    ("8-experts", "IQ3_M", False): "2e6130787f628566",
    ("8-experts", "IQ3_M", True): "2e6130787f628566",
    ("8-experts", "IQ3_S", False): "2aeaf790b514d043",
    ("8-experts", "IQ3_S", True): "2aeaf790b514d043",
    ("8-experts", "IQ3_XS", False): "refused: blk.0.attn_q.weight",
    ("8-experts", "IQ3_XS", True): "1432747ec55b191c",
    ("8-experts", "IQ3_XXS", False): "refused: blk.0.attn_q.weight",
    ("8-experts", "IQ3_XXS", True): "554d8efb9b7afe0f",
    ("8-experts", "IQ2_M", False): "refused: blk.0.attn_q.weight",
    ("8-experts", "IQ2_M", True): "94e117642ef7fe7e",
    ("8-experts", "IQ2_S", False): "refused: blk.0.attn_q.weight",
    ("8-experts", "IQ2_S", True): "d559693e7d27ec76",
    ("8-experts", "IQ2_XS", False): "refused: blk.0.attn_q.weight",
    ("8-experts", "IQ2_XS", True): "bc70cacc9bb5b5a4",
    ("8-experts", "IQ2_XXS", False): "refused: blk.0.attn_q.weight",
    ("8-experts", "IQ2_XXS", True): "1bd06556f491c0c3",
    ("8-experts", "IQ1_M", False): "refused: blk.0.attn_q.weight",
    ("8-experts", "IQ1_M", True): "30847679aface37b",
    ("8-experts", "IQ1_S", False): "refused: blk.0.attn_q.weight",
    ("8-experts", "IQ1_S", True): "bac8274293711bea",
    ("8-experts", "TQ2_0", False): "923ebbae8c551b66",
    ("8-experts", "TQ2_0", True): "923ebbae8c551b66",
    ("8-experts", "TQ1_0", False): "2b2cefb3b10446b1",
    ("8-experts", "TQ1_0", True): "2b2cefb3b10446b1",
    ("8-experts", "Q2_K_S", False): "refused: blk.0.attn_output.weight",
    ("8-experts", "Q2_K_S", True): "129dcadc3dcd4816",
    ("8-experts", "Q4_0", True): "e6b0383231bd3558",
    ("8-experts", "Q5_0", True): "07e765ce7914f43a",
    ("80-layers-gqa", "IQ4_NL", False): "e638930a8308fa9e",
    ("80-layers-gqa", "IQ4_NL", True): "b3894541ee396fda",
    ("80-layers-gqa", "IQ4_XS", False): "bd4b9bc4457242f3",
    ("80-layers-gqa", "IQ4_XS", True): "b58b9b83289ec81b",
    ("80-layers-gqa", "IQ3_M", False): "ee9823a3158027d0",
    ("80-layers-gqa", "IQ3_M", True): "ee9823a3158027d0",
    ("80-layers-gqa", "IQ3_S", False): "868953c5c49f74c8",
    ("80-layers-gqa", "IQ3_S", True): "868953c5c49f74c8",
    ("80-layers-gqa", "IQ3_XS", False): "refused: blk.0.attn_k.weight",
    ("80-layers-gqa", "IQ3_XS", True): "c766eadfd303d8c7",
    ("80-layers-gqa", "IQ3_XXS", False): "refused: blk.0.attn_k.weight",
    ("80-layers-gqa", "IQ3_XXS", True): "6670ec5dbdb3ab51",
    ("80-layers-gqa", "IQ2_M", False): "refused: blk.0.attn_k.weight",
    ("80-layers-gqa", "IQ2_M", True): "ebfde7fcbf41873f",
    ("80-layers-gqa", "IQ2_S", False): "refused: blk.0.attn_k.weight",
    ("80-layers-gqa", "IQ2_S", True): "c5935265d4f82e0f",
    ("80-layers-gqa", "IQ2_XS", False): "refused: blk.0.attn_k.weight",
    ("80-layers-gqa", "IQ2_XS", True): "2d962d79da382170",
    ("80-layers-gqa", "IQ2_XXS", False): "refused: blk.0.attn_k.weight",
    ("80-layers-gqa", "IQ2_XXS", True): "0a650a241fc5f92d",
    ("80-layers-gqa", "IQ1_M", False): "refused: blk.0.attn_k.weight",
    ("80-layers-gqa", "IQ1_M", True): "5aa6505d7862c54c",
    ("80-layers-gqa", "IQ1_S", False): "refused: blk.0.attn_k.weight",
    ("80-layers-gqa", "IQ1_S", True): "a2a153872231f3ab",
    ("80-layers-gqa", "TQ2_0", False): "4ffdfb995ff0cb07",
    ("80-layers-gqa", "TQ2_0", True): "4ffdfb995ff0cb07",
    ("80-layers-gqa", "TQ1_0", False): "01b145afe83f99ed",
    ("80-layers-gqa", "TQ1_0", True): "01b145afe83f99ed",
    ("80-layers-gqa", "Q2_K_S", False): "refused: blk.0.attn_k.weight",
    ("80-layers-gqa", "Q2_K_S", True): "bb7ec3f0d31bfd73",
    ("80-layers-gqa", "Q4_0", True): "32e8237751bb2007",
    ("80-layers-gqa", "Q5_0", True): "750ba732146a1458",
    ("falcon", "IQ4_NL", False): "cdb8ad613aef5d80",
    ("falcon", "IQ4_NL", True): "7b4a0b1cc4ff91ec",
    ("falcon", "IQ4_XS", False): "d8fedcccd29aee47",
    ("falcon", "IQ4_XS", True): "2e804ab38ca39b85",
    ("falcon", "IQ3_M", False): "6e4a11cdfc2a6030",
    ("falcon", "IQ3_M", True): "6e4a11cdfc2a6030",
    ("falcon", "IQ3_S", False): "21257d191969b06a",
    ("falcon", "IQ3_S", True): "21257d191969b06a",
    ("falcon", "IQ3_XS", False): "refused: blk.1.ffn_up.weight",
    ("falcon", "IQ3_XS", True): "eb8d69d1ac827885",
    ("falcon", "IQ3_XXS", False): "refused: blk.0.attn_output.weight",
    ("falcon", "IQ3_XXS", True): "8cc0fe14cbcd6eff",
    ("falcon", "IQ2_M", False): "refused: blk.0.ffn_up.weight",
    ("falcon", "IQ2_M", True): "0f1cb084f7605c56",
    ("falcon", "IQ2_S", False): "refused: blk.0.ffn_up.weight",
    ("falcon", "IQ2_S", True): "9c68ccb56f7b85e2",
    ("falcon", "IQ2_XS", False): "refused: blk.0.attn_output.weight",
    ("falcon", "IQ2_XS", True): "fa84fac5ad1e23f6",
    ("falcon", "IQ2_XXS", False): "refused: blk.0.attn_output.weight",
    ("falcon", "IQ2_XXS", True): "8ab79975e0a9ac54",
    ("falcon", "IQ1_M", False): "refused: blk.0.attn_output.weight",
    ("falcon", "IQ1_M", True): "1b53be6113394d3d",
    ("falcon", "IQ1_S", False): "refused: blk.0.attn_output.weight",
    ("falcon", "IQ1_S", True): "22bb026419cbada4",
    ("falcon", "TQ2_0", False): "ada79693e57cca25",
    ("falcon", "TQ2_0", True): "ada79693e57cca25",
    ("falcon", "TQ1_0", False): "f72342e8a553e927",
    ("falcon", "TQ1_0", True): "f72342e8a553e927",
    ("falcon", "Q2_K_S", False): "refused: blk.0.attn_output.weight",
    ("falcon", "Q2_K_S", True): "4493f4ec09674efa",
    ("falcon", "Q4_0", True): "000cb3bd82ec4d2c",
    ("falcon", "Q5_0", True): "96eaa97f35990530",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("presets")
    written = {
        name: read_gguf(write_model(folder / f"{name}.gguf", **kwargs))
        for name, kwargs in VARIANTS.items()
    }
    return {**written, "falcon": read_gguf(write_falcon_model(folder / "falcon.gguf"))}


@pytest.mark.parametrize("case", list(LLAMA_CPP_TYPES), ids="-".join)
def test_types_equal_llama_cpp(case: tuple[str, str, str], models: dict):
    variant, preset, option = case
    plans = plan(models[variant], presets.parse_preset(preset), OPTIONS[option])
    lines = "".join(f"{p.info.name} {p.new_type.name}\n" for p in plans)
    counts = Counter(p.new_type.name for p in plans)
    digest, summary = LLAMA_CPP_TYPES[case]
    assert " ".join(f"{k}:{counts[k]}" for k in sorted(counts)) == summary
    assert hashlib.sha256(lines.encode()).hexdigest() == digest


@pytest.mark.parametrize("case", list(LLAMA_CPP_IQ_TYPES), ids=lambda c: "-".join(map(str, c)))
def test_iq_types_and_refusals_equal_llama_cpp(case: tuple[str, str, bool], models: dict):
    variant, preset, has_imatrix = case
    expected = LLAMA_CPP_IQ_TYPES[case]
    args = (models[variant], presets.parse_preset(preset), presets.Overrides(), has_imatrix)
    if expected.startswith("refused: "):
        tensor = expected.removeprefix("refused: ")
        with pytest.raises(UsageError, match=f"needs an importance matrix: tensor '{tensor}'"):
            plan(*args)
        return
    plans = plan(*args)
    lines = "".join(f"{p.info.name} {p.new_type.name}\n" for p in plans)
    assert hashlib.sha256(lines.encode()).hexdigest()[:16] == expected


def test_tensor_order_is_llama_cpps():
    names = ["blk.10.ffn_up.weight", "output.weight", "blk.2.attn_q.weight", "blk.2.attn_k.weight"]
    assert presets.tensor_order([*names, "token_embd.weight"]) == [
        "output.weight",
        "token_embd.weight",
        "blk.2.attn_k.weight",
        "blk.2.attn_q.weight",
        "blk.10.ffn_up.weight",
    ]


@pytest.mark.parametrize(
    "name, found", [("q4_k_m", "Q4_K_M"), ("Q4_K", "Q4_K_M"), ("q3_k", "Q3_K_M"), ("f16", "F16")]
)
def test_presets_by_llama_quantize_names(name: str, found: str):
    assert presets.parse_preset(name).name == found


@pytest.mark.parametrize(
    "name, error, message",
    [
        ("Q7_K", UsageError, "unknown quantization type 'Q7_K'"),
        ("mxfp4_moe", UnsupportedError, "cannot write MXFP4_MOE yet"),
    ],
)
def test_presets_refused(name: str, error: type, message: str):
    with pytest.raises(error, match=message):
        presets.parse_preset(name)


def test_tensor_types_refused():
    with pytest.raises(UnsupportedError, match="cannot write MXFP4"):
        presets.parse_tensor_type("mxfp4", "--output-tensor-type")
    with pytest.raises(UsageError, match="unknown tensor type 'q9'"):
        presets.parse_tensor_type("q9", "--token-embedding-type")
    assert presets.parse_tensor_type("q6_k", "--output-tensor-type") == T.Q6_K
