"""On-disk shard formats: WebDataset-style tar shards and HDF5 shards.

- :mod:`fastdata.shards.tar`: deterministic tar writer, sidecar index, mmap random-access reader,
  stream reader; key/field splitting rule in :mod:`fastdata.shards._keys`.
- :mod:`fastdata.shards.hdf5`: HDF5 layout (documented there) writer and reader.
- :mod:`fastdata.shards.reader`: ``open_shard``, ``verify``, the ``ShardReader`` protocol.
- :mod:`fastdata.shards.writer`: ``ShardWriter`` (folder of shards + ``manifest.json``).
- :func:`shard_format`: the registry entry of a format (suffixes, open, write, verify, size model).

Heavy optional imports (h5py) happen only in :mod:`fastdata.shards.hdf5`. Remote files (URLs,
retries, redaction) are the ``fastdata.io`` stage's, below this one.
"""

# Key/field rules and the required-field policy: used by the dataset and by conversion.
from fastdata.shards._fields import missing_fields, required_fields
# The registry of shard formats: what differs between tar and HDF5, looked up by the manifest's format.
from fastdata.shards._formats import SHARD_FORMATS, ShardFormat, shard_format
from fastdata.shards._keys import split_member_name

__all__ = ["SHARD_FORMATS", "ShardFormat", "missing_fields", "required_fields", "shard_format", "split_member_name"]
