"""What the policy actually wrote: example prompts, responses and rewards every few steps.

`RUN_DIR/samples.jsonl` holds one record per example (`{"step", "prompt", "response", "reward",
"acc", "ground_truth", ...}`) for scripts; `RUN_DIR/samples.txt` shows the same as readable blocks:

    ===== step 10 =====
    --- sample 1/4 | reward 1.0 | acc 1.0 | ground truth 42 ---
    [prompt]
    ...
    [response]
    ...

Long texts are cut in the middle with a marker, so a run that babbles cannot fill the disk.
Prompts with images show their placeholders here; the images themselves, with the model's answers
to a few validation prompts, are drawn to `RUN_DIR/samples/step_NNNNNN.png` by
`polyrl/trainer/sample_images.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REQUIRED = ("prompt", "response", "reward", "acc", "ground_truth")


class SampleLog:
    """Appends examples to `run_dir/samples.jsonl` and `run_dir/samples.txt`.

    Like `build_sinks`: `resume_step=S` (a run resumed from the checkpoint of step S) drops the
    examples of steps after S, which the run is about to redo, and keeps the rest; None (a fresh
    run) starts both files empty.
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None, max_chars: int = 2000):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.run_dir / "samples.jsonl"
        self.txt = self.run_dir / "samples.txt"
        self.max_chars = max_chars
        self._truncate(-1 if resume_step is None else resume_step)

    def write(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        for row in rows:
            missing = [k for k in REQUIRED if k not in row]
            if missing:
                raise ValueError(f"sample row lacks {', '.join(missing)}; "
                                 f"each row needs {', '.join(REQUIRED)}")
        records = [{"step": step, **{k: self._cut(_jsonable(v)) for k, v in row.items()}} for row in rows]
        with self.jsonl.open("a") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with self.txt.open("a") as f:
            f.write(render(step, records))

    def _cut(self, value: Any) -> Any:
        return truncate(value, self.max_chars) if isinstance(value, str) else value

    def _truncate(self, keep_through: int) -> None:
        if not self.jsonl.is_file():
            self.txt.unlink(missing_ok=True)
            return
        kept: list[dict[str, Any]] = []
        for line in self.jsonl.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", keep_through + 1) <= keep_through:
                kept.append(record)
        self.jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
        by_step: dict[int, list[dict[str, Any]]] = {}
        for r in kept:
            by_step.setdefault(r["step"], []).append(r)
        self.txt.write_text("".join(render(step, rs) for step, rs in by_step.items()))


def render(step: int, records: list[dict[str, Any]]) -> str:
    """The human-readable block of one step's examples."""
    out = [f"===== step {step} =====\n"]
    for i, r in enumerate(records, 1):
        head = [f"sample {i}/{len(records)}", f"reward {_fmt(r['reward'])}", f"acc {_fmt(r['acc'])}",
                f"ground truth {_short(r['ground_truth'])}"]
        head += [f"{k} {_short(v)}" for k, v in r.items() if k not in ("step", *REQUIRED)]
        out.append(f"--- {' | '.join(head)} ---\n")
        out.append(f"[prompt]\n{_text(r['prompt'])}\n[response]\n{_text(r['response'])}\n\n")
    return "".join(out)


def truncate(text: str, max_chars: int) -> str:
    """`text` if short enough, else its start and end around a marker saying how much was cut."""
    if len(text) <= max_chars:
        return text
    head = max_chars * 2 // 3
    tail = max_chars - head
    return f"{text[:head]}\n[... {len(text) - head - tail} characters cut ...]\n{text[-tail:]}"


def rows_from_batch(batch: Any, num: int) -> list[dict[str, Any]]:
    """Up to `num` example rows of a scored `RolloutBatch` (with `texts` and `prompts`), one per
    prompt first."""
    firsts, rest, seen = [], [], set()
    for i, g in enumerate(batch.group.tolist()):
        (rest if g in seen else firsts).append(i)
        seen.add(g)
    lengths, reasons = batch.response_lengths.tolist(), batch.stop_reasons()
    rows = []
    for i in (firsts + rest)[:num]:
        prompt = batch.prompts[i]
        rows.append({
            "prompt": getattr(prompt, "prompt_text", ""),
            "response": batch.texts[i],
            "reward": float(batch.rewards[i]),
            "acc": float(batch.acc[i]),
            "ground_truth": getattr(prompt, "ground_truth", None),
            "data_source": getattr(prompt, "data_source", None),
            "response_tokens": lengths[i],
            "stop_reason": reasons[i],
        })
    return rows


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    if hasattr(v, "tolist"):
        return v.tolist()
    try:
        json.dumps(v)
        return v
    except TypeError:
        return str(v)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _short(v: Any, limit: int = 120) -> str:
    text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text(s: Any) -> str:
    return (s if isinstance(s, str) else json.dumps(s, ensure_ascii=False)).rstrip("\n")
