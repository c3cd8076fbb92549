"""polyrl: reinforcement-learning post-training for language models, laptop to cluster.

Importing polyrl has no side effects: no environment writes, no logging set-up, no device probes.
"""

__version__ = "0.1.0"
