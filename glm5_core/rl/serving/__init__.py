"""Inference serving: the rollout engine (continuous batching over the latent KV cache, per-trajectory prefix
cache, sampling), its SGLang-compatible HTTP server and protocol, the client the fleet uses, and the worker
process that hosts one engine."""
