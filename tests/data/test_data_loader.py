"""Seeded shuffling, drop_last, and exact resumption mid-epoch and at an epoch boundary."""

import pytest
from verl_files import verl_rows, write_verl_parquet

from polyrl.data import DataConfig, PromptDataset, PromptLoader, build_loaders


@pytest.fixture(scope="module")
def dataset(tiny_tokenizer):
    return PromptDataset(verl_rows(10), tiny_tokenizer)


def ids(batch):
    return [s.index for s in batch]


def run(loader, steps):
    return [ids(loader.next_batch()) for _ in range(steps)]


def test_drop_last_and_keep_last(dataset):
    loader = PromptLoader(dataset, 4, shuffle=False, drop_last=True)
    assert len(loader) == 2 and [ids(b) for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    keep = PromptLoader(dataset, 4, shuffle=False, drop_last=False)
    assert [ids(b) for b in keep] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_batch_larger_than_dataset_is_an_error(dataset):
    with pytest.raises(ValueError, match=r"data.train_batch_size=11 is larger than the train set \(10"):
        PromptLoader(dataset, 11)


def test_shuffle_is_seeded_and_differs_per_epoch(dataset):
    a = run(PromptLoader(dataset, 5, seed=1), 6)
    b = run(PromptLoader(dataset, 5, seed=1), 6)
    c = run(PromptLoader(dataset, 5, seed=2), 6)
    assert a == b and a != c
    epochs = [sorted(a[0] + a[1]), sorted(a[2] + a[3])]
    assert epochs == [list(range(10))] * 2  # every prompt once per epoch
    assert a[0:2] != a[2:4]  # a new permutation each epoch


def test_epoch_iteration_advances_epoch(dataset):
    loader = PromptLoader(dataset, 3, seed=0)
    seen = []
    for epoch in range(loader.epoch, 2):
        seen.append([ids(b) for b in loader])
    assert loader.epoch == 2 and len(seen) == 2 and seen[0] != seen[1]
    assert seen == [[ids(loader._batch(e, p)) for p in range(3)] for e in range(2)]


@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 5, 7])  # 3 batches/epoch: 3 and 6 are boundaries
def test_resume_gives_identical_batches(dataset, stop_after):
    reference = run(PromptLoader(dataset, 3, seed=7), 9)

    first = PromptLoader(dataset, 3, seed=7)
    head = run(first, stop_after)
    state = first.state_dict()

    resumed = PromptLoader(dataset, 3, seed=7)
    resumed.load_state_dict(state)
    assert head + run(resumed, 9 - stop_after) == reference


def test_resume_with_epoch_loops(dataset):
    """The `for epoch: for batch in loader` style, checkpointed right after an epoch's last batch."""
    def train(loader, epochs, stop_at=None):
        out = []
        for _ in range(loader.epoch, epochs):
            for batch in loader:
                out.append(ids(batch))
                if len(out) == stop_at:
                    return out, loader.state_dict()
        return out, loader.state_dict()

    reference, _ = train(PromptLoader(dataset, 3, seed=3), 3)
    head, state = train(PromptLoader(dataset, 3, seed=3), 3, stop_at=3)  # epoch 0's last batch
    resumed = PromptLoader(dataset, 3, seed=3)
    resumed.load_state_dict(state)
    tail, _ = train(resumed, 3)
    assert head + tail == reference


def test_resume_refuses_a_different_dataset(dataset, tiny_tokenizer):
    state = PromptLoader(dataset, 3).state_dict()
    other = PromptLoader(PromptDataset(verl_rows(9), tiny_tokenizer), 3)
    with pytest.raises(ValueError, match="dataset_size=10 but this run has dataset_size=9"):
        other.load_state_dict(state)


def test_build_loaders(tmp_path, tiny_tokenizer):
    write_verl_parquet(tmp_path / "train.parquet", verl_rows(8))
    write_verl_parquet(tmp_path / "val.parquet", verl_rows(5, split="test"))
    cfg = DataConfig(
        train_files=[str(tmp_path / "train.parquet")], val_files=[str(tmp_path / "val.parquet")],
        train_batch_size=4,
    )
    train, val = build_loaders(cfg, tiny_tokenizer)
    assert len(train) == 2 and len(val) == 1 and ids(next(iter(val))) == [0, 1, 2, 3, 4]
    no_val = build_loaders(cfg.model_copy(update={"val_files": []}), tiny_tokenizer)[1]
    assert no_val is None
