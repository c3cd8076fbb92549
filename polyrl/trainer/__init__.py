"""The RL loop (sync colocated; async disaggregated later), checkpoints and metrics."""
