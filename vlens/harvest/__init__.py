"""Activation datasets: `harvest` writes them (resumable safetensors shards + manifest), `ActivationDataset`
reads them, `export` converts them for SAELens, `difference_of_means` makes a steering vector of two. One job
per module: config (the options), sources, windows, model, job (what both backends drive), rows (a shard's
forwards and its rows' way to host memory), pipeline (the threads), run (the entry and the local backend),
ray_backend and ray_source, writer, stats, features (SAE latents), edits (interventions), dataset, export,
cli."""

from vlens.harvest.config import HarvestConfig
from vlens.harvest.dataset import ActivationDataset, difference_of_means
from vlens.harvest.export import export
from vlens.harvest.job import HarvestSummary
from vlens.harvest.run import harvest

__all__ = ["ActivationDataset", "HarvestConfig", "HarvestSummary", "difference_of_means", "export", "harvest"]
