"""On-disk shard formats: WebDataset-style tar shards and HDF5 shards.

- :mod:`fastdata.shards.tar`: deterministic tar writer, sidecar index, mmap random-access reader,
  stream reader; key/field splitting rule in :mod:`fastdata.shards._keys`.
- :mod:`fastdata.shards.hdf5`: HDF5 layout (documented there) writer and reader.
- :mod:`fastdata.shards.reader`: ``open_shard``, ``verify``, the ``ShardReader`` protocol.
- :mod:`fastdata.shards.writer`: ``ShardWriter`` (folder of shards + ``manifest.json``).

Heavy optional imports (h5py) happen only in :mod:`fastdata.shards.hdf5`.
"""

# Remote files (fsspec; imported lazily inside): used by the dataset's sources, convert and verify.
from fastdata.shards._remote import (  # noqa: E402
    RemoteStream,
    RetryPolicy,
    download,
    folder_url,
    env_retry,
    filesystem,
    is_transient,
    is_url,
    read_bytes,
    redact,
    redact_url,
    remote_error,
    remote_size,
    safe_cause,
    split_query,
    upload,
    url_identity,
    url_join,
    with_retries,
)

# Key/field rules and the required-field policy (issue 13): used by the dataset and by conversion.
from fastdata.shards._fields import missing_fields, required_fields  # noqa: E402
from fastdata.shards._keys import split_member_name  # noqa: E402
