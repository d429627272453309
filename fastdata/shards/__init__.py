"""On-disk shard formats: WebDataset-style tar shards and HDF5 shards.

- :mod:`fastdata.shards.tar`: deterministic tar writer, sidecar index, mmap random-access reader,
  stream reader; key/field splitting rule in :mod:`fastdata.shards._keys`.
- :mod:`fastdata.shards.hdf5`: HDF5 layout (documented there) writer and reader.
- :mod:`fastdata.shards.reader`: ``open_shard``, ``verify``, the ``ShardReader`` protocol.
- :mod:`fastdata.shards.writer`: ``ShardWriter`` (folder of shards + ``manifest.json``).

Heavy optional imports (h5py) happen only in :mod:`fastdata.shards.hdf5`. Remote files (URLs,
retries, redaction) are the ``fastdata.io`` stage's, below this one.
"""

# Key/field rules and the required-field policy: used by the dataset and by conversion.
from fastdata.shards._fields import missing_fields, required_fields
from fastdata.shards._keys import split_member_name

__all__ = ["missing_fields", "required_fields", "split_member_name"]
