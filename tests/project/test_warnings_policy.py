"""The suite's warning policy (pyproject's filterwarnings): a deprecated or changing call attributed to
fastdata's own modules fails the run; the same warning attributed to another library does not."""
from __future__ import annotations

import warnings

import pytest


@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning, FutureWarning])
@pytest.mark.parametrize("module", ["fastdata", "fastdata.gpu._codec", "fastdata.cli"])
def test_a_deprecation_attributed_to_fastdata_is_an_error(category, module):
    with pytest.raises(category, match="an old call"):
        warnings.warn_explicit("an old call", category, "x.py", 1, module=module)


@pytest.mark.parametrize("module", ["torch.utils.data", "fastdatax", "tests.project.test_readme", "myfastdata"])
def test_the_same_warning_from_elsewhere_is_not(module):
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit("an old call", DeprecationWarning, "x.py", 1, module=module)
    assert [str(w.message) for w in seen] == ["an old call"]


def test_a_library_warning_about_its_fastdata_caller_is_an_error():
    # what a library's warnings.warn(..., stacklevel=2) does when fastdata calls it: attributed to the caller
    namespace = {"__name__": "fastdata.gpu._codec", "warnings": warnings}
    exec(compile("def old():\n    warnings.warn('old', DeprecationWarning, stacklevel=1)\n", "codec.py", "exec"),
         namespace)  # noqa: S102
    with pytest.raises(DeprecationWarning, match="old"):
        namespace["old"]()
