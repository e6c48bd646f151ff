"""The RL algorithm: trajectory buffer (batching, staleness, exactly-once), advantages, the double-sided
importance-sampling loss, and the trainer (log-prob recomputation, optimizer step, weight push)."""
