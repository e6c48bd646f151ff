"""Asynchronous RL driver (slime-style): rollout engines generate continuously, a trainer consumes batches
and pushes weights back every K steps.

Layers (each imports only the layers above it in this list, checked by tests/test_layering.py):
  device       the backend's runtime device                             } leaves: they import nothing else
  plugins      user callables named by import path                      } of rl, and every layer may read
  config       the RL config's declarations and the value checks every  } them
               layer shares (temperature, top-p, engine URLs, devices)  }
  serving/     inference: rollout engine (continuous batching, latent KV slots, prefix cache per trajectory),
               sampling, SGLang-compatible protocol, HTTP server (127.0.0.1), client, worker
  fleet/       replicas (supervision, restarts), DP-aware and round-robin routers, executors (local, Ray)
  rollout/     trajectories, the token-in-token-out gateway, environments and context management, the
               agent-loop runner (environment <-> gateway <-> router <-> engines)
  algorithm/   trajectory buffer (staleness, exactly-once), advantages, double-sided IS loss, trainer
Top level (may import every layer): ``config_loader`` (YAML -> config: the declarations' checks, then the ones that
need a component, then ``run_memory``), ``policy``, ``driver`` (composes the components; the sync /
async run), ``metrics``, ``cli`` (``glm5 rl``), ``serve_cli`` (``glm5 serve``: one engine as a standalone server),
and the run's helpers.

Nothing here imports a model, ray or an HTTP stack at ``import glm5_core.rl`` time.
"""
