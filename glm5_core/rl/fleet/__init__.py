"""The engine fleet: replica supervision, DP-aware routing, and the executors that start engine workers
(local processes or Ray actors)."""
