"""RL environments: a single-turn arithmetic task and a multi-turn calculator-tool task."""
