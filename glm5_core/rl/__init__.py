"""Asynchronous RL driver (slime-style): rollout engines generate continuously, a trainer consumes batches
and pushes weights back every K steps.

Components, one per module:
  sampling        temperature / top-p sampling and per-token log-probs
  engine          continuous-batching rollout engine over the model's KV cache, prefix cache per trajectory
  protocol        SGLang-compatible ``/generate`` request validation and response building
  server          HTTP server around an engine (127.0.0.1 only); ``client`` talks to it
  router          DP-aware router: consistent hashing of trajectory ids onto engine replicas
  gateway         token-in-token-out (TITO) recorder of every generation of a trajectory
  envs/           arithmetic (single turn) and calculator (multi-turn tool) environments, context management
  rollout         agent loops: environment <-> gateway <-> router <-> engines
  buffer          trajectory buffer with batch threshold, staleness filter and exactly-once accounting
  advantages      group-normalised and distillation advantages
  loss            double-sided importance-sampling policy loss with token masking
  trainer         log-prob recomputation, optimizer step, frozen indexer, weight push
  executors/      where engine workers run: local processes (default) or Ray actors
  device          the backend's runtime device, where the policy and engine models are put
  driver          the sync / async loops
  metrics         JSONL + TensorBoard + PNG reward curve

Nothing here imports a model, ray or an HTTP stack at ``import glm5_core.rl`` time.
"""
