"""Rollout: the engine interface, the built-in engine, engine adapters, servers and routing."""
