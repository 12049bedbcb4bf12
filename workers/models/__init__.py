"""The model side: configs (`config`), the architecture registry (`registry`), the model classes
(`llama`, ...) and the loader that fills them from safetensors or GGUF (`loader`).

Kept import-free on purpose: `workers.models.config` and `workers.models.registry` are read by
the ingress, which must not pay for importing torch.
"""
