"""Small reference models that the example sharding specs are written against.

``llama`` is a dense Llama-style decoder in the Meta/torchtitan layout (fused grouped q/k/v,
fused gate/up); ``moe`` is a DeepSeek-V4-style MoE decoder whose dense maths equals Hugging
Face Qwen3-MoE. Every factory builds a tiny model, also on the meta device.
"""
