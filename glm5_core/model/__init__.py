"""GLM-5-style model built only from ``glm5_core.ops`` entry points, with HF glm_moe_dsa interop.

Public API: GLM5Config, GLM5ForCausalLM, GLM5Output, KVCache, save_pretrained, load_pretrained.
"""
from glm5_core.model.cache import KVCache
from glm5_core.model.checkpoint import load_pretrained, save_pretrained
from glm5_core.model.config import GLM5Config
from glm5_core.model.modeling import GLM5ForCausalLM, GLM5Output

__all__ = ["GLM5Config", "GLM5ForCausalLM", "GLM5Output", "KVCache", "load_pretrained", "save_pretrained"]
