"""The tables of docs/scaling.md, printed from the memory model (polyrl/training/memory_plan.py, where
every formula lives; this file re-exports its names for the benchmarks that import them, as
benchmarks/memory.py does `predict_bench`).

    polyrl bench memory_model [--json]      # or: python benchmarks/memory_model.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from polyrl.training.memory_plan import (BANDWIDTH_GBPS, ENGINE_RESERVE_GB, GB, H100_GB, KV_TOKENS,  # noqa: F401
                                         MICRO_BATCH_TOKENS, QWEN3_MOE, QWEN25, USABLE, GiB, MiB, Shape, engine_bytes,
                                         layout, load_bytes_sharded, load_bytes_today, predict_bench,
                                         moe_scaling_rows, scaling_rows, smallest_tp, sync_seconds,
                                         training_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows, moe_rows = scaling_rows(), moe_scaling_rows()
    sync = {name: sync_seconds(Shape.from_config(c)) for name, c in QWEN25.items()}
    if args.json:
        print(json.dumps({"layouts": rows, "sync_seconds": sync, "moe_layouts": moe_rows}))
        return 0
    print("| model | GPUs | layout | trainers | engine TP | update GB | generate GB | fits 72 GB | "
          "bf16 master fits | offload fits | load today GB | load sharded GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    yes = {True: "yes", False: "**no**"}
    for r in rows:
        print(f"| {r['model']} | {r['gpus']} | {r['placement']} | {r['trainers']} | {r['tp'] or '-'} | "
              f"{r['update_gb']:.1f} | {r['generate_gb']:.1f} | {yes[r['fits']]} | {yes[r['fits_bf16_master']]} | "
              f"{yes[r['fits_offload']]} | {r['load_today_gb']:.0f}{'' if r['load_today_fits'] else ' (no)'} | "
              f"{r['load_sharded_gb']:.1f} |")
    print()
    print("| model | bf16 bytes | " + " | ".join(BANDWIDTH_GBPS) + " |")
    print("|---|---|" + "---|" * len(BANDWIDTH_GBPS))
    for name, c in QWEN25.items():
        s = Shape.from_config(c)
        print(f"| {name} | {2 * s.params / GB:.1f} GB | " +
              " | ".join(f"{sec:.2f} s" if sec < 10 else f"{sec:.0f} s" for sec in sync[name].values()) + " |")
    print()
    print_moe(moe_rows)
    return 0


def print_moe(rows: list[dict]) -> None:
    """docs/moe.md's scaling table: mixture-of-experts models per H100, by expert-parallel size."""
    print("| model | total / active | GPUs | layout | ep | experts per rank | gathered layer GB | update GB | "
          "generate GB | engine GPUs | fits 72 GB | bf16 master fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    yes = {True: "yes", False: "**no**"}
    for r in rows:
        print(f"| {r['model']} | {r['params_b']:.1f}B / {r['active_b']:.1f}B | {r['gpus']} | {r['placement']} | {r['ep']} | "
              f"{r['experts_per_rank']} | {r['gathered_layer_gb']:.2f} | {r['update_gb']:.1f} | "
              f"{r['generate_gb']:.1f} | {r['engine_gpus'] or '-'} | {yes[r['fits']]} | {yes[r['fits_bf16_master']]} |")


if __name__ == "__main__":
    sys.exit(main())
