"""What a vision-language policy answered about which image: `RUN_DIR/samples/step_NNNNNN.png`.

At every validation of a run whose held-out prompts have images, the first few such prompts
(one sample each, in the validation set's fixed order, so every grid shows the same prompts) are
drawn as a grid: each prompt's image, captioned with its question, the model's answer, the
ground truth and the reward, green when right and red when wrong. A text-only run writes nothing.

The images are the data rows' own, decoded again on the driver from the split's files by
`PromptSample.index` (`RowImages`): a `PromptSample` carries only the processor's normalised,
possibly resized patches, and must stay small since it travels to the engines with every batch.
They are read once, on the first grid, for the few prompts drawn.

The directory is bounded: the first grid and the latest `MAX_FILES - 1` are kept. Like
samples.jsonl, a resumed run drops the grids of steps after its checkpoint and a fresh run in the
same directory starts without any.
"""

from __future__ import annotations

import logging
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

NUM_IMAGES = 8
"""Prompts per grid."""
MAX_FILES = 10
"""Grids kept in RUN_DIR/samples: the first and the latest MAX_FILES - 1."""
COLUMNS = 4
CELL_INCHES = (2.6, 3.1)
"""Width and height of one captioned image."""
HEADER_INCHES = 0.4
"""The grid's title line."""
DPI = 100
WRAP = 34
"""Caption characters per line."""
FILE_NAME = re.compile(r"step_(\d+)\.png")


@dataclass
class ImageSample:
    """One validation prompt as drawn: its images (PIL, the row's own; empty when they could not
    be read again) and what the model answered."""

    images: list[Any]
    question: str
    answer: str
    ground_truth: Any
    reward: float
    right: bool


def caption(sample: ImageSample) -> str:
    """The lines under an image: question, answer, ground truth, reward and right / wrong."""
    extra = len(sample.images) - 1
    more = f" (+{extra} more image{'s' * (extra > 1)})" if extra > 0 else ""
    lines = _wrapped("Q: ", f"{sample.question}{more}", keep="start")
    lines += _wrapped("A: ", sample.answer, keep="end")  # a reasoning answer ends with its result
    lines += _wrapped("truth: ", str(sample.ground_truth), keep="start", max_lines=1)
    lines.append(f"reward {sample.reward:.3g}: {'right' if sample.right else 'wrong'}")
    return "\n".join(lines)


def grid_size(n: int) -> tuple[int, int]:
    """(width, height) in pixels of the grid of `n` images."""
    columns, rows = min(n, COLUMNS), -(-n // COLUMNS)
    return round(columns * CELL_INCHES[0] * DPI), round((rows * CELL_INCHES[1] + HEADER_INCHES) * DPI)


def draw_grid(samples: Sequence[ImageSample], out: Path, title: str) -> Path:
    """Write the captioned images of `samples` to `out` (PNG of `grid_size(len(samples))`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(samples)
    columns, rows = min(n, COLUMNS), -(-n // COLUMNS)
    width, height = grid_size(n)
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(fig)  # Agg drawing for this figure only; pyplot's global backend is untouched
    header = HEADER_INCHES * DPI / height
    plain = {"parse_math": False}  # answers hold $...$ and backslashes: text, not mathtext to parse
    fig.suptitle(title, fontsize=11, y=1 - header / 4, va="top", **plain)
    caption_share = 0.32  # of each cell's height: room for a caption's 6 lines
    for i, sample in enumerate(samples):
        row, column = divmod(i, columns)
        left = column / columns
        bottom = (1 - header) * (1 - (row + 1) / rows)
        cell_h = (1 - header) / rows
        ax = fig.add_axes((left + 0.06 / columns, bottom + 0.02 * cell_h, 0.88 / columns, cell_h * (1 - caption_share)))
        ax.set_xticks([])
        ax.set_yticks([])
        if sample.images:
            image = sample.images[0]  # a small image stays sharp; a large one is smoothed as it shrinks
            ax.imshow(image, interpolation="nearest" if max(image.size) <= 256 else "antialiased")
        else:
            ax.text(0.5, 0.5, "image not readable\nfrom the data file", ha="center", va="center", fontsize=8,
                    transform=ax.transAxes)
        colour = "#1a7f37" if sample.right else "#c62828"
        for side in ax.spines.values():
            side.set_edgecolor(colour)
            side.set_linewidth(2)
        ax.set_title(caption(sample), fontsize=8, color=colour, loc="left", pad=4, **plain)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)  # no bbox_inches="tight": the size stays grid_size(n)
    return out


class RowImages:
    """The original images of a split's prompts, decoded again from the split's data files.

    `PromptSample.index` is the row's number among the split's readable rows, files concatenated
    (polyrl/data/dataset.py), so reading the same files the same way finds the row; a row whose
    prompt is no longer the sample's (the file changed since the run started) gives no image.
    """

    def __init__(self, files: Sequence[str], prompt_key: str = "prompt"):
        self.files = list(files)
        self.prompt_key = prompt_key
        self._cache: dict[int, list[Any]] = {}

    def __call__(self, prompts: Sequence[Any]) -> list[list[Any]]:
        missing = {p.index for p in prompts} - self._cache.keys()
        if missing:
            self._load({p.index: p for p in prompts if p.index in missing})
        return [self._cache.get(p.index, []) for p in prompts]

    def _load(self, wanted: dict[int, Any]) -> None:
        from polyrl.builtin import resolve
        from polyrl.data import vision
        from polyrl.data.files import read_source_rows
        from polyrl.data.rows import BadRows

        for index in wanted:
            self._cache[index] = []  # unless found below: never read the files again for it
        try:
            rows = [r.data for f in self.files
                    for r in read_source_rows(resolve(f), self.prompt_key, BadRows("skip"))]
        except Exception as exc:  # the images are a courtesy: never stop a run for them
            logger.warning("sample images: cannot read %s again (%s); grids show no images",
                           ", ".join(self.files), exc)
            return
        for index, prompt in wanted.items():
            row = rows[index] if index < len(rows) else None
            if row is None or row.get(self.prompt_key) != prompt.raw_prompt:
                continue
            try:
                messages, inline = vision.with_image_parts(
                    row[self.prompt_key], placeholders=row.get(vision.IMAGES_KEY) is not None)
                self._cache[index] = [vision.open_image(e) for e in vision.images_for(row, inline)]
            except vision.ImageRowError:
                continue


class SampleImages:
    """Writes `run_dir/samples/step_NNNNNN.png` for validation batches whose prompts have images.

    `images_of(prompts)` gives each prompt's original images (`RowImages` of the validation
    files). `resume_step` as in `SampleLog`: grids of later steps are dropped, None drops all.
    """

    def __init__(self, run_dir: Path, resume_step: int | None, images_of: Callable[[Sequence[Any]], list[list[Any]]],
                 num: int = NUM_IMAGES, max_files: int = MAX_FILES):
        self.dir = Path(run_dir) / "samples"
        self.images_of = images_of
        self.num = num
        self.max_files = max(max_files, 2)
        keep_through = -1 if resume_step is None else resume_step
        for step, path in self._files():
            if step > keep_through:
                path.unlink(missing_ok=True)

    def write(self, step: int, batch: Any) -> Path | None:
        """The grid of `batch`'s first image prompts (a scored validation `RolloutBatch`), or
        None, writing nothing, when no prompt has images. Drawing problems are logged, not
        raised: a finished step must not fail for its picture."""
        samples = self.samples(batch)
        if not samples:
            return None
        right = sum(s.right for s in samples)
        try:
            out = draw_grid(samples, self.dir / f"step_{step:06d}.png",
                            f"step {step}: {right} of {len(samples)} validation answers right")
        except Exception as exc:
            logger.warning("could not draw the sample images of step %d: %s", step, exc)
            return None
        self._bound()
        return out

    def samples(self, batch: Any) -> list[ImageSample]:
        """One sample per prompt with images, the first `num` in batch order."""
        picked, seen = [], set()
        for i, (group, prompt) in enumerate(zip(batch.group.tolist(), batch.prompts)):
            if group in seen or getattr(prompt, "images", None) is None:
                continue
            seen.add(group)
            picked.append(i)
            if len(picked) == self.num:
                break
        if not picked:
            return []
        prompts = [batch.prompts[i] for i in picked]
        return [ImageSample(images=images, question=question_text(p.raw_prompt), answer=batch.texts[i],
                            ground_truth=p.ground_truth, reward=float(batch.rewards[i]),
                            right=float(batch.acc[i]) > 0)
                for i, p, images in zip(picked, prompts, self.images_of(prompts))]

    def _files(self) -> list[tuple[int, Path]]:
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := FILE_NAME.fullmatch(p.name))]
        return sorted(found)

    def _bound(self) -> None:
        files = self._files()
        for _, path in files[1:len(files) - (self.max_files - 1)]:  # keep the first and the latest
            path.unlink(missing_ok=True)


def question_text(prompt: str | list[dict[str, Any]]) -> str:
    """The last user message's text, without image placeholders (the image is drawn above it)."""
    if isinstance(prompt, str):
        return " ".join(prompt.split())
    users = [m for m in prompt if m.get("role") == "user"] or list(prompt)
    content = users[-1].get("content") if users else ""
    if isinstance(content, list):
        content = " ".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    return " ".join(str(content or "").replace("<image>", " ").split())


def _wrapped(label: str, text: str, keep: str, max_lines: int = 2) -> list[str]:
    """`label` + `text` on lines of WRAP characters, at most `max_lines`: a longer text is cut
    at its end (keep="start") or its start (keep="end") with an ellipsis."""
    text = " ".join(text.split())
    limit = WRAP * max_lines - len(label)
    if len(text) > limit:
        text = text[:limit - 3] + "..." if keep == "start" else "..." + text[-(limit - 3):]
    text = label + text
    lines = textwrap.wrap(text, WRAP)
    if len(lines) > max_lines:  # word breaks wasted room: cut at fixed widths, which fit
        lines = [text[i:i + WRAP] for i in range(0, len(text), WRAP)]
    return lines
