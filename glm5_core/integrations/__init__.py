"""Adapters for other people's code: ``transformers`` (kernelize a GlmMoeDsaForCausalLM). Nothing here is
imported by ``import glm5_core``; each adapter imports its library only when called."""
