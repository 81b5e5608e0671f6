"""Reading model files: gguf_io (GGUF), safetensors_io (HF directories), and
loader (checkpoint -> model). This package file imports nothing, so the
torch-free readers stay cheap to import (`llmrun tokenize`, `llmrun list`)."""
