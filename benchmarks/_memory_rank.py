"""One gloo rank of `benchmarks/memory.py`: load, one GRPO update, one weight publish, and the
peak resident memory of each phase above the process's own baseline.

A module of its own (not memory.py) so that the spawned ranks import it by name: `polyrl bench`
loads memory.py under another module name, which a spawned child could not unpickle.
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

MiB = 2**20


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def rss() -> int:
    """Resident bytes now (anonymous + file-backed + shared memory pages)."""
    return _status_kib("VmRSS") * 1024


def peak() -> int:
    """The kernel's high-water mark of the resident set since the last `reset_peak()`."""
    return _status_kib("VmHWM") * 1024


def trim_heap() -> None:
    """Hand the free pages glibc keeps in its heaps back to the kernel (`malloc_trim(0)`): what
    an earlier phase freed and glibc kept would otherwise count in the next phase's resident
    peak, though the code holds none of it (and the next phase's allocations reuse it)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def return_freed_memory(threshold_bytes: int) -> None:
    """Serve every allocation of at least `threshold_bytes` with its own mmap, returned to the
    kernel when freed (`mallopt(M_MMAP_THRESHOLD)`, which also turns off glibc's dynamic
    threshold, up to 32 MiB by default, and trims the heap top as soon as 2x that is free):
    the resident set then follows what the code holds, not the freed tensors glibc keeps, which
    otherwise land wherever its free lists put the next allocation and stay resident."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, threshold_bytes)
    libc.mallopt(m_trim_threshold, 2 * threshold_bytes)


def reset_peak() -> None:
    """Set the high-water mark to the current resident set (Linux >= 4.0, `clear_refs` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def make_batch(num_samples: int, prompt_len: int, response_len: int, vocab: int):
    """A GRPO batch (groups of 4 samples, random tokens and advantages, rollout log-probs) of
    fixed lengths: the same global batch at every world size, sharded over the ranks."""
    import torch

    from polyrl.batch import Ragged, RolloutBatch

    g = torch.Generator().manual_seed(0)
    prompts = Ragged.from_rows([torch.randint(2, vocab, (prompt_len,), generator=g)
                                for _ in range(num_samples)], torch.long)
    responses = Ragged.from_rows([torch.randint(2, vocab, (response_len,), generator=g)
                                  for _ in range(num_samples)], torch.long)
    zeros = torch.zeros(num_samples, dtype=torch.long)
    return RolloutBatch(
        prompt_ids=prompts, response_ids=responses, loss_mask=Ragged.full_like(responses, 1.0, torch.float32),
        group=torch.arange(num_samples) // 4, stop_reason=zeros,
        finished_with_eos=torch.ones(num_samples, dtype=torch.bool), weight_version=zeros,
        min_version=zeros, max_version=zeros, continuations=zeros,
        rollout_logprobs=responses.with_values(-torch.rand(len(responses.values), generator=g) * 3),
        advantages=torch.randn(num_samples, generator=g))


def warm_up(cfg, platform, device, rank: int, world: int) -> None:
    """The three phases once on a 2-layer model built in memory, freed before the baseline: the
    first forward, backward, optimizer step and gather of a process page in torch's code and
    start its thread pools and allocator arenas (~80-100 MiB here), a cost of the runtime paid
    once whatever the model, which would otherwise count in the first phase that runs it."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config

    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.batch import shard
    from polyrl.training import build_engine
    from polyrl.training.mesh import ParallelDims
    from polyrl.workers.actor import PPOActor

    tiny = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=128, tie_word_embeddings=True, max_position_embeddings=256), attn_implementation="sdpa")
    for p in tiny.parameters():
        dist.broadcast(p.data, src=0)
    engine = build_engine(tiny.to(device), cfg, platform, device, rank=rank, world_size=world,
                          group=dist.group.WORLD, horizon=10)
    actor = PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)
    dims = ParallelDims.from_actor(cfg)  # under --tp the ranks of a tp group train on one shard
    actor.update(shard(make_batch(8, 16, 48, 256), dims.data_parallel_size)[dims.data_rank(rank)],
                 num_mini_batches=1, use_rollout_logprobs=False)
    for _ in engine.weight_stream():
        pass


def run_rank(rank: int, world: int, model_dir: str, options: dict, store: str, out: str) -> None:
    """`options`: strategy, bucket_mb, num_samples, prompt_len, response_len, vocab, mmap_threshold_mb
    (0: glibc's defaults)."""
    if options.get("mmap_threshold_mb"):
        return_freed_memory(int(options["mmap_threshold_mb"] * MiB))
    import torch
    import torch.distributed as dist
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (in the baseline, not in `load`)

    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.batch import shard
    from polyrl.platform import get_platform
    from polyrl.training import build_engine, sharded_load
    from polyrl.training.checkpoint_io import local_state_bytes
    from polyrl.training.config import ActorConfig
    from polyrl.training.mesh import ParallelDims
    from polyrl.training.model_loading import load_causal_lm
    from polyrl.weights.bucketing import iter_buckets, plan_buckets
    from polyrl.workers.actor import PPOActor

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    platform = get_platform("cpu")
    device = platform.torch_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    cfg = ActorConfig(strategy=options["strategy"], world_size=world, lr=1e-5, ppo_epochs=1,
                      tensor_parallel_size=options.get("tensor_parallel_size", 1))
    dims = ParallelDims.from_actor(cfg)
    batch = make_batch(options["num_samples"], options["prompt_len"], options["response_len"], options["vocab"])
    mine = shard(batch, dims.data_parallel_size)[dims.data_rank(rank)]
    warm_up(cfg, platform, device, rank, world)
    gc.collect()
    trim_heap()
    dist.barrier()
    baseline = rss()
    result: dict = {"rank": rank, "baseline_mib": baseline / MiB}

    def phase(name: str, body) -> None:
        gc.collect()
        found = rss()
        trim_heap()
        start = rss()
        result[f"kept_before_{name}_mib"] = (found - start) / MiB  # free heap glibc had kept
        reset_peak()
        body()
        gc.collect()
        result[f"{name}_mib"] = (peak() - baseline) / MiB  # the measure
        result[f"{name}_rise_mib"] = max(peak() - start, 0) / MiB  # what the phase adds to what it found
        result[f"after_{name}_mib"] = (rss() - baseline) / MiB
        dist.barrier()

    held: dict = {}

    def load() -> None:  # as PolicyWorker.setup loads the policy (polyrl/workers/policy.py)
        # fsdp2: on the meta device, each rank reading its own shards (training/sharded_load.py)
        model = load_causal_lm(model_dir, cfg.param_dtype, deferred=cfg.strategy == "fsdp2")
        if not sharded_load.is_deferred(model):
            model = model.to(device)
            if world > 1:  # identical start on every rank
                for p in model.parameters():
                    dist.broadcast(p.data, src=0)
        held["engine"] = build_engine(model, cfg, platform, device, rank=rank, world_size=world,
                                      group=dist.group.WORLD, horizon=10)

    def step() -> None:  # one GRPO update through the PPO actor (one optimizer step)
        actor = PPOActor(held["engine"], cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)
        actor.update(mine, num_mini_batches=1, use_rollout_logprobs=False)

    bucket_bytes = max(int(options["bucket_mb"] * MiB), 1)

    def sync() -> None:
        # One publish as the object-store / broadcast senders pack it (polyrl/weights/
        # object_store.py, sync mode): buckets planned from the specs, each packed into one
        # reused scratch buffer from the tensors gathered for it, then dropped where the
        # transport would put it in the store (a copy outside this process). A tensor bigger
        # than a bucket comes in row slices, each gathered into a slice-sized buffer (sent as
        # its own bucket, no copy) and freed before the next (polyrl/training/fsdp2.py). The
        # other ranks join each gather (a collective) and keep nothing.
        engine = held["engine"]
        engine.piece_bytes = bucket_bytes  # as PolicyWorker sets weights.bucket_mb on every rank
        stream = engine.weight_stream()
        if rank != 0:  # the same gathers, a slice at a time
            for name, piece in stream.pieces():
                del name, piece  # not alive while the next is gathered (`for _ in` would keep it)
            return
        manifest = plan_buckets(stream.specs, 1, bucket_bytes)
        scratch: list = []

        def reuse(b: int, device: torch.device) -> torch.Tensor:
            need = manifest.buckets[b].nbytes
            if not scratch or scratch[0].numel() < need:
                scratch[:] = [torch.empty(need, dtype=torch.uint8, device=device)]
            return scratch[0]

        for b, packed in iter_buckets(manifest, stream, reuse):
            del b, packed  # "put in the store": gone before the next bucket is packed
        result["sync_bytes"] = manifest.total_bytes
        result["sync_buckets"] = len(manifest.buckets)

    phase("load", load)
    phase("step", step)
    phase("sync", sync)
    engine = held["engine"]
    result["state"] = {k: v / MiB for k, v in local_state_bytes(engine.model, engine.optimizer).items()}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
