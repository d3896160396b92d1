"""Activation datasets: `harvest` writes them (resumable safetensors shards + manifest), `ActivationDataset`
reads them, `export` converts them for SAELens. One job per module: sources, windows, model, run,
writer, stats, dataset, export, cli."""

from vlens.harvest.dataset import ActivationDataset
from vlens.harvest.export import export
from vlens.harvest.run import HarvestSummary, harvest

__all__ = ["ActivationDataset", "HarvestSummary", "export", "harvest"]
