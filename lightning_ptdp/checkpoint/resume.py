"""Resume mid-epoch at the sample where the checkpoint was taken.

Lightning restores the loop's counters from a checkpoint but starts the interrupted epoch's
dataloader from its first batch again, so a mid-epoch resume repeats that epoch's first batches
and never sees its last ones (it warns). For a map-style dataset the strategy instead skips, in
the resumed epoch only, the index batches the checkpointed run had already trained on; the
sampler's epoch seed is restored by Lightning, so the order is the same and no sample is read,
repeated or lost. Only indices are skipped: no skipped sample is loaded.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from torch.utils.data import DataLoader, IterableDataset, Sampler

log = logging.getLogger(__name__)


class SkipFirstBatches(Sampler[list[int]]):
    """``batch_sampler`` without its first ``skip`` batches, in the next pass only."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip
        self.sampler = getattr(batch_sampler, "sampler", None)  # Lightning sets the epoch on it

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        for index, batch in enumerate(self.batch_sampler):
            if index >= skip:
                yield batch

    def __len__(self) -> int:  # the epoch's length: Lightning counts the skipped batches as done
        return len(self.batch_sampler)


def resume_at(dataloader: Any, batches_done: int) -> Any:
    """``dataloader`` whose next pass starts after ``batches_done`` batches (unchanged if it
    cannot: an iterable-style dataset or a loader that is not a torch DataLoader)."""
    if batches_done <= 0:
        return dataloader
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        log.warning(
            "resuming mid-epoch: %s cannot skip to the checkpoint's sample; the epoch restarts",
            type(dataloader).__name__,
        )
        return dataloader
    workers = dataloader.num_workers
    return DataLoader(
        dataloader.dataset,
        batch_sampler=SkipFirstBatches(dataloader.batch_sampler, batches_done),
        num_workers=workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        prefetch_factor=dataloader.prefetch_factor if workers > 0 else None,
        persistent_workers=dataloader.persistent_workers,
    )


def resume_dataloader(trainer: Any, dataloader: Any) -> Any:
    """The training dataloader to use: when fit restarts mid-epoch from a checkpoint, the one that
    starts at the checkpoint's batch; otherwise ``dataloader`` itself."""
    if trainer is None or not trainer.training or not trainer.fit_loop.restarting:
        return dataloader
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    try:
        total = len(dataloader)
    except TypeError:
        total = None
    return dataloader if total is not None and done >= total else resume_at(dataloader, done)
