"""The one table from C++ status codes to Python exceptions (pdkv.errors) is complete.

A code the C++ core can return but errors.py does not know would surface as the bare
PdkvError base class; a class whose code the core never returns is dead. Both directions
are checked against the core's own list (status_code_names), so adding a StatusCode
without its exception fails here.
"""

import pytest

import pdkv
import pdkv.errors as errors
from pdkv import _native


def _core_codes() -> list[str]:
    return _native.module().status_code_names()


def test_every_core_code_has_its_own_exception_class():
    codes = [c for c in _core_codes() if c != "OK"]
    assert codes, "the core lists no status codes"
    classes = {}
    for code in codes:
        cls = errors.error_class(code)
        assert cls is not errors.PdkvError, f"StatusCode {code} has no exception class in pdkv.errors"
        assert cls.code == code
        classes[code] = cls
    assert len(set(classes.values())) == len(codes), "two codes share one exception class"


def test_every_exception_class_names_a_core_code():
    codes = set(_core_codes())
    subclasses = [c for c in vars(errors).values()
                  if isinstance(c, type) and issubclass(c, errors.PdkvError) and c is not errors.PdkvError]
    assert subclasses
    for cls in subclasses:
        assert cls.code in codes, f"{cls.__name__}.code = {cls.code!r} is not a core StatusCode"
        assert errors.error_class(cls.code) is cls


@pytest.mark.parametrize("code", ["OK", "Unknown", "", "NoSuchCode"])
def test_non_error_names_map_to_the_base_class(code):
    assert errors.error_class(code) is errors.PdkvError


def test_exceptions_raised_by_the_core_use_the_table():
    # One C++ error per path: an argument error and a lookup error, raised through the
    # exception translator in the bindings.
    with pdkv.Agent("errtable", transports=["tcp"]) as a:
        with pytest.raises(errors.NotFound) as e:
            a.peer_info("nobody")
        assert type(e.value) is errors.NotFound and "nobody" in str(e.value)
    assert issubclass(errors.InvalidArgument, ValueError) and issubclass(errors.NotFound, LookupError)
