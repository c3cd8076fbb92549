"""Supervised fine-tuning on chat data (`polyrl sft`, docs/sft.md): the warm start RL begins with.

It trains on the same engine, batch type, checkpoints and metric sinks as `polyrl train`:

    config.py    SFTConfig (model / data / actor / trainer / logging sections)
    template.py  token ids + assistant-token mask from the model's chat template
    data.py      verl SFT schemas (messages / prompt+response) -> one columnar RolloutBatch
    step.py      the masked-NLL optimizer step and validation, on the engine seam
    trainer.py   the loop: resume, validate, log, checkpoint, summary.json
    launch.py    one process per rank (torch.distributed) when actor.world_size > 1
"""

from polyrl.sft.config import SFTConfig, SFTDataConfig
from polyrl.sft.template import ChatEncoder, Encoded, TemplateError

__all__ = ["ChatEncoder", "Encoded", "SFTConfig", "SFTDataConfig", "TemplateError"]
