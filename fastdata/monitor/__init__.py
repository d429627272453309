"""Diagnostics: is a job loader-bound, which stage bounds it, and what to change.

The top stage but the command line (docs/ARCHITECTURE.md). Behind it: ``_stall``
(:class:`StallMeter`, watching a running loop), ``_periodic`` (the saw-tooth detector),
``_nvml`` (GPU utilisation of the right device), ``_stages`` (each pipeline stage measured on its
own and together: ``_diagnose`` turns them into what ``fastdata doctor`` prints), ``_batch`` (the
largest batch that fits), ``_tune`` (the settings search behind ``fastdata tune``).
"""
from fastdata.monitor._batch import BatchSearch, search_batch_size
from fastdata.monitor._diagnose import Diagnosis, DoctorOptions, StageRow, diagnose
from fastdata.monitor._nvml import GPUSampler, nvml_handle
from fastdata.monitor._periodic import PeriodicStalls, find_periodic_stalls
from fastdata.monitor._stages import cores, measure_h2d, pick_fields, shard_folder
from fastdata.monitor._stall import LOADER_BOUND_SHARE, StallMeter, StallReport, advise
from fastdata.monitor._tune import TuneResult, python_snippet, tune

__all__ = [
    "LOADER_BOUND_SHARE",
    "BatchSearch",
    "Diagnosis",
    "DoctorOptions",
    "GPUSampler",
    "PeriodicStalls",
    "StageRow",
    "StallMeter",
    "StallReport",
    "TuneResult",
    "advise",
    "cores",
    "diagnose",
    "find_periodic_stalls",
    "measure_h2d",
    "nvml_handle",
    "pick_fields",
    "python_snippet",
    "search_batch_size",
    "shard_folder",
    "tune",
]
