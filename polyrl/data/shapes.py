"""Seeded synthetic visual task (data_source ``"shapes"``): count or name coloured shapes.

An image is 56x56 pixels split into a 2x2 grid of 28-pixel cells, exactly one merged vision token
each for a Qwen2-VL model (patch 14, spatial merge 2: polyrl/assets/tiny-vl). One to four cells
hold a shape (square, circle or triangle) in one of four colours, drawn with PIL at a jittered
size and position. Each row asks one question with a one-word answer::

    "How many shapes?"            -> "3"
    "What colour is the circle?"  -> "blue"   (asked only when the image has one circle)

Rows follow verl's multimodal schema (polyrl/data/vision.py), so the RL data path reads them
unchanged::

    {"data_source": "shapes",
     "prompt": [{"role": "user", "content": "<image>How many shapes?"}],
     "images": [{"bytes": b"<png>", "path": None}],
     "ability": "vision",
     "reward_model": {"style": "rule", "ground_truth": "3"},
     "extra_info": {"split": "train", "index": 0, "question": "count"}}

Train and held-out images are disjoint as scenes (which cell holds which shape in which colour),
so held-out accuracy measures reading new images, not recalling seen ones. Everything is a pure
function of its arguments (a `random.Random(seed)` per call).

Command line (writes ``shapes_train.parquet`` and ``shapes_val.parquet``)::

    python -m polyrl.data.shapes --out /tmp/data --n-train 2000 --n-val 200 --seed 0
"""

from __future__ import annotations

import argparse
import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

DATA_SOURCE = "shapes"
ABILITY = "vision"
SIDE = 56
"""Image side in pixels: 2x2 cells of 28 = one merged 2x2 block of 14-pixel patches each."""
CELL = SIDE // 2
KINDS = ("square", "circle", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
COUNT_QUESTION = "How many shapes?"
BACKGROUND = (123, 117, 104)
"""Grey at the image processor's mean (CLIP's, which Qwen2-VL uses): the background normalises to
about zero, so a patch's features come from the shape in it. On white, a tiny vision tower
learned where shapes are (their count) but not their colour."""


@dataclass(frozen=True)
class Shape:
    cell: int
    """0..3: top-left, top-right, bottom-left, bottom-right."""
    kind: str
    colour: str
    size: int
    """Pixels across (16..22)."""
    dx: int
    dy: int
    """Offset of the shape inside its cell (keeps it inside)."""


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]

    @property
    def key(self) -> tuple:
        """What the split keeps disjoint: the shapes' cells, kinds and colours (not their jitter)."""
        return tuple(sorted((s.cell, s.kind, s.colour) for s in self.shapes))

    def render(self):
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (SIDE, SIDE), BACKGROUND)
        draw = ImageDraw.Draw(image)
        for s in self.shapes:
            x0 = (s.cell % 2) * CELL + s.dx
            y0 = (s.cell // 2) * CELL + s.dy
            box = [x0, y0, x0 + s.size - 1, y0 + s.size - 1]
            fill = COLOURS[s.colour]
            if s.kind == "square":
                draw.rectangle(box, fill=fill)
            elif s.kind == "circle":
                draw.ellipse(box, fill=fill)
            else:
                draw.polygon([(x0 + s.size // 2, y0), (x0, y0 + s.size - 1), (x0 + s.size - 1, y0 + s.size - 1)],
                             fill=fill)
        return image

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.render().save(buf, format="PNG")
        return buf.getvalue()

    def questions(self) -> list[tuple[str, str, str]]:
        """(kind of question, question, answer) this scene can be asked."""
        out = [("count", COUNT_QUESTION, str(len(self.shapes)))]
        for kind in KINDS:
            having = [s for s in self.shapes if s.kind == kind]
            if len(having) == 1:  # a colour question needs one shape of the kind it names
                out.append(("colour", f"What colour is the {kind}?", having[0].colour))
        return out


def random_scene(rng: random.Random) -> Scene:
    cells = rng.sample(range(4), rng.randint(1, 4))
    shapes = []
    for cell in sorted(cells):
        size = rng.randint(16, 22)
        shapes.append(Shape(cell, rng.choice(KINDS), rng.choice(list(COLOURS)), size,
                            rng.randint(1, CELL - size - 1), rng.randint(1, CELL - size - 1)))
    return Scene(tuple(shapes))


@dataclass(frozen=True)
class Example:
    scene: Scene
    question_type: str
    question: str
    answer: str


def examples(n: int, rng: random.Random, exclude: set, p_count: float = 0.5) -> list[Example]:
    """`n` examples whose scenes' keys are not in `exclude` (the held-out split's)."""
    out = []
    while len(out) < n:
        scene = random_scene(rng)
        if scene.key in exclude:
            continue
        asked = scene.questions()
        colour = [q for q in asked if q[0] == "colour"]
        pick = asked[0] if not colour or rng.random() < p_count else rng.choice(colour)
        out.append(Example(scene, *pick))
    return out


def split_examples(n_train: int, n_val: int, seed: int = 0,
                   n_extra: int = 0) -> tuple[list[Example], list[Example], list[Example]]:
    """(train, val, extra): val first, then train and `extra` (warm-start material) drawn from
    scenes whose keys never occur in val."""
    rng = random.Random(seed)
    val = examples(n_val, rng, exclude=set())
    held_out = {e.scene.key for e in val}
    train = examples(n_train, rng, exclude=held_out)
    extra = examples(n_extra, rng, exclude=held_out)
    return train, val, extra


def make_row(e: Example, split: str, index: int) -> dict:
    """One RL row in verl's multimodal schema."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"<image>{e.question}"}],
        "images": [{"bytes": e.scene.png(), "path": None}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": e.answer},
        "extra_info": {"split": split, "index": index, "question": e.question_type},
    }


def make_chat(e: Example, answer: str | None = None) -> dict:
    """One SFT conversation (`polyrl sft`'s messages schema with an image part): the question
    about the image and `answer` (default: the right one). Every content is a list of parts,
    since a parquet column cannot mix lists and strings."""
    reply = e.answer if answer is None else answer
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": e.question}]},
            {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        ],
        "images": [{"bytes": e.scene.png(), "path": None}],
    }


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_shapes_dataset(out_dir: str | Path, n_train: int = 2000, n_val: int = 200,
                         seed: int = 0) -> dict[str, Path]:
    """Write ``shapes_train.parquet`` and ``shapes_val.parquet`` into ``out_dir``."""
    train, val, _ = split_examples(n_train, n_val, seed)
    out_dir = Path(out_dir)
    return {
        "train": write_parquet([make_row(e, "train", i) for i, e in enumerate(train)],
                               out_dir / "shapes_train.parquet"),
        "val": write_parquet([make_row(e, "val", i) for i, e in enumerate(val)], out_dir / "shapes_val.parquet"),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the synthetic shapes train/val parquet files.")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-val", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for split, p in write_shapes_dataset(args.out, args.n_train, args.n_val, args.seed).items():
        print(f"{split}: {p}")


if __name__ == "__main__":
    main()
