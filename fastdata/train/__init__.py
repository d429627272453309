"""Training-loop pieces: ``TrainStep`` (AMP step without host syncs), checkpoints that resume the
sample sequence exactly, and ``evaluate`` (inference through the prefetcher, one transfer at the end).

Its place among the stages: docs/ARCHITECTURE.md.
"""
from fastdata.train._checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from fastdata.train._evaluate import accuracy, evaluate, top_k
from fastdata.train._precision import PRECISIONS, resolve_precision
from fastdata.train._step import TrainStep

__all__ = ["PRECISIONS", "Checkpoint", "CheckpointError", "TrainStep", "accuracy", "evaluate", "load_checkpoint",
           "resolve_precision", "save_checkpoint", "top_k"]
