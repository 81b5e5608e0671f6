"""`llmrun show` counts the KV cache of a Hugging Face folder from its config.json alone
(llmrun.loading.inspect, torch-free), in the names each family's config.json gives its
sizes: GPT-2's and BLOOM's n_layer/n_head, MPT's and DBRX's n_layers/d_model, Falcon's
multi-query and grouped KV heads. The reference is what the model itself allocates."""

import importlib

import pytest

from llmrun.loading.inspect import kv_cache_bytes
from llmrun.models import kv_cache_bytes as allocated

FORMS = {
    "gpt2": {},
    "gpt_bigcode": {},
    "bloom": {},
    "mpt": {},
    "dbrx": {},
    "falcon": {},  # Falcon-7B: multi-query, one KV head
    "falcon-40b": {"new_decoder_architecture": True, "num_kv_heads": 2},
}


@pytest.mark.parametrize("form", list(FORMS))
def test_show_counts_what_the_model_allocates(form):
    family = form.partition("-")[0]
    config = importlib.import_module(f"test_{family}").hf_model(**FORMS[form]).config.to_dict()
    counted = kv_cache_bytes(config, 8192)
    assert counted is not None and counted > 0
    assert counted == allocated(config, 8192)
