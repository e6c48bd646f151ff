"""Agent rollout: environments, the token-in-token-out gateway that records every generation of a trajectory,
and the runner that drives environment <-> gateway <-> router <-> engines.

For agents that speak the OpenAI API: ``tokenizer`` (a Hugging Face tokenizer directory with a chat template),
``chat_transcript`` (multi-turn prompts built by appending token ids), ``tool_calls`` and ``openai_protocol`` (the
OpenAI request / response formats) and ``proxy`` (the OpenAI-compatible server that records every trajectory
through a gateway)."""
