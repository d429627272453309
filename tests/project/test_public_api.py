"""The public API: names resolve and are sorted, every error is importable from fastdata, the
subpackages the docs name are reachable, the dataset's type hints resolve."""
from __future__ import annotations

import pytest

import fastdata


def test_public_names_resolve_and_are_sorted():
    assert fastdata.__all__ == sorted(fastdata.__all__)
    for name in fastdata.__all__:
        assert getattr(fastdata, name) is not None


def test_every_error_the_readme_names_is_importable_from_fastdata():
    # the README tells users they get SourceError, MissingFieldError, SkipBudgetError: catchable as
    # fastdata.<Name> like the other errors (FastdataError, ShardError, DecodeError, ...)
    import fastdata.errors
    for name in fastdata.errors.__all__:
        assert getattr(fastdata, name) is getattr(fastdata.errors, name)
        assert name in fastdata.__all__


def test_subpackages_named_in_the_docs_are_reachable_after_import_fastdata():
    import subprocess
    import sys

    # fastdata.train.accuracy (README), fastdata.monitor.search_batch_size: "module 'fastdata' has no attribute"
    # unless something had imported the subpackage first. Light modules here: torch's import takes seconds.
    code = ("import fastdata, sys; m = fastdata.manifest.Manifest; e = fastdata.errors.FastdataError; "
            "s = fastdata.io.is_url; assert 'torch' not in sys.modules; "
            "assert fastdata.manifest is sys.modules['fastdata.manifest']")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="module 'fastdata' has no attribute 'nosuch'"):
        fastdata.nosuch  # noqa: B018


def test_every_public_method_of_the_dataset_has_resolvable_hints() -> None:
    """typing.get_type_hints(ShardedDataset.cache_store) raised NameError: 'Store' was imported for type
    checkers only."""
    import inspect
    import typing

    from fastdata import ShardedDataset
    from fastdata.dataset import LoaderSeam

    for cls in (ShardedDataset, LoaderSeam):
        for name, member in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_") or name == "__init__":
                typing.get_type_hints(member)
