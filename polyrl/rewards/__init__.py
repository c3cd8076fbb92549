"""Verifiable rewards: a scoring function per `data_source`, run by `RewardManager`.

    manager = RewardManager(RewardConfig(...))
    result = manager.score([RewardRequest(data_source, text, ground_truth, finished_with_eos)])
    result.scores, result.accs, result.metrics
"""

from polyrl.rewards.config import RewardConfig
from polyrl.rewards.manager import RewardBatchResult, RewardManager, RewardRequest, ended_with_eos
from polyrl.rewards.registry import REWARD_FNS, UnknownDataSourceError, load_function

__all__ = [
    "REWARD_FNS",
    "RewardBatchResult",
    "RewardConfig",
    "RewardManager",
    "RewardRequest",
    "UnknownDataSourceError",
    "ended_with_eos",
    "load_function",
]
