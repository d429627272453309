"""Remote and local file access: URL rules, redaction, retries, fsspec streams and downloads.

The lowest stage above the base modules: it imports only ``fastdata.errors``, and
every stage that reads or writes a URL goes through it (the dataset's sources, the node cache,
conversion, verify, the CLI). fsspec and its protocol packages are imported lazily, at first use.
Design note: ``docs/design/io.md``.
"""
from fastdata.io._redact import redact, redact_url, safe_cause
from fastdata.io._remote import (
    RemoteStream,
    download,
    filesystem,
    read_bytes,
    remote_size,
    remove,
    upload,
)
from fastdata.io._retry import (
    RetryPolicy,
    env_retry,
    is_transient,
    remote_error,
    with_retries,
)
from fastdata.io._urls import (
    folder_url,
    is_url,
    local_path,
    split_query,
    url_identity,
    url_join,
)

__all__ = [
    "RemoteStream", "RetryPolicy", "download", "env_retry", "filesystem", "folder_url", "is_transient", "is_url",
    "local_path", "read_bytes", "redact", "redact_url", "remote_error", "remote_size", "remove", "safe_cause",
    "split_query", "upload", "url_identity", "url_join", "with_retries",
]
