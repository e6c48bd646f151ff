"""RL environments: a single-turn arithmetic task, a multi-turn calculator-tool task, and ``openai_agent`` (an
``openai``-package agent trained through the OpenAI proxy)."""
