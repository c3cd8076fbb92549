"""Driver + Ray overhead of moving one step's batch: the typed RolloutBatch vs Python lists.

One step at 512 samples x 1024 response tokens (prompt 128) crosses Ray twice per policy call:
the driver ships each rank its shard, and a log-probs call ships per-token floats back. This
times that round trip (2 ranks, real Ray actors that touch every value, as a worker would) for

    lists    the representation polyrl used before RolloutBatch: one dataclass per sample
             holding Python lists of ints / floats (ids, rollout log-probs, advantages per token)
    batch    RolloutBatch: Ragged (flat tensor + offsets) per-token fields, [N] per-sequence ones

and, as the hardware limit of the same run, a memcpy of the batch's bytes. Prints seconds per
round trip and ratios; `--json` ends with one JSON line.

    python benchmarks/batch_overhead.py            # ~1 minute on 2 cores
    polyrl bench batch_overhead --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polyrl.batch import Ragged, RolloutBatch, shard  # noqa: E402


@dataclasses.dataclass
class ListSample:  # the pre-RolloutBatch layout (one per sample, plain lists)
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    advantages: list[float]
    group: int = 0


def make(n: int, prompt: int, response: int, seed: int = 0) -> tuple[list[ListSample], RolloutBatch]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(response // 2, response + 1, (n,), generator=g)
    p = torch.randint(0, 32000, (n, prompt), generator=g)
    r = torch.randint(0, 32000, (n, response), generator=g)
    lp = -torch.rand(n, response, generator=g)
    adv = torch.randn(n, generator=g)
    lists = [ListSample(p[i].tolist(), r[i, :lengths[i]].tolist(), lp[i, :lengths[i]].tolist(),
                        [float(adv[i])] * int(lengths[i]), i // 8) for i in range(n)]
    resp = Ragged.from_padded(r, lengths)
    long = torch.zeros(n, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=Ragged.from_padded(p, torch.full((n,), prompt)), response_ids=resp,
                         loss_mask=Ragged.full_like(resp, 1.0, torch.float32),
                         group=torch.arange(n) // 8, stop_reason=long, finished_with_eos=long.bool(),
                         weight_version=long, min_version=long, max_version=long, continuations=long,
                         rollout_logprobs=Ragged.from_padded(lp, lengths), advantages=adv)
    return lists, batch


def rank_actor():
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        def logprobs_lists(self, samples: list[ListSample]) -> list[list[float]]:
            # a worker reads every id and returns one float per response token
            return [[-0.5] * len(s.response_ids) for s in samples if sum(s.prompt_ids) >= 0]

        def logprobs_batch(self, batch: RolloutBatch) -> Ragged:
            return Ragged.full_like(batch.response_ids, -0.5, torch.float32)

    return Rank


def round_trip(ray, ranks, payload, method: str, split, join) -> float:
    t0 = time.perf_counter()
    parts = split(payload, len(ranks))
    out = ray.get([getattr(r, method).remote(part) for r, part in zip(ranks, parts)])
    join(out)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        lists, batch = make(args.samples, args.prompt, args.response)
        Rank = rank_actor()
        ranks = [Rank.remote() for _ in range(2)]
        split_lists = lambda xs, k: [xs[i * len(xs) // k:(i + 1) * len(xs) // k] for i in range(k)]  # noqa: E731
        join_lists = lambda out: [lp for part in out for lp in part]  # noqa: E731
        nbytes = sum(t.numel() * t.element_size() for t in (
            batch.prompt_ids.values, batch.response_ids.values, batch.rollout_logprobs.values,
            batch.loss_mask.values)) * 2  # there and (log-probs) back, roughly
        flat = torch.empty(nbytes // 4, dtype=torch.float32)
        times = {"lists": [], "batch": [], "memcpy": []}
        for _ in range(args.reps):  # interleaved: both see the same machine load
            times["lists"].append(round_trip(ray, ranks, lists, "logprobs_lists", split_lists, join_lists))
            times["batch"].append(round_trip(ray, ranks, batch, "logprobs_batch", shard, Ragged.cat))
            t0 = time.perf_counter()
            flat.clone()
            times["memcpy"].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        result = {"samples": args.samples, "response_tokens": args.response, "reps": args.reps,
                  "lists_s": med["lists"], "batch_s": med["batch"], "memcpy_s": med["memcpy"],
                  "speedup_vs_lists": med["lists"] / med["batch"],
                  "batch_vs_memcpy": med["memcpy"] / med["batch"], "cpu_flags": cpu_flags()}
    finally:
        ray.shutdown()
    for k, v in result.items():
        print(f"{k:>18}: {v:.4g}" if isinstance(v, float) else f"{k:>18}: {v}")
    if args.json:
        print(json.dumps(result))
    return 0


def cpu_flags() -> str:
    caps = torch.backends.cpu.get_cpu_capability()
    return f"{caps}, {torch.get_num_threads()} threads"


if __name__ == "__main__":
    sys.exit(main())
