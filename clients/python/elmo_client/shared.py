"""The classes the client answers with and raises from.

``values.py`` is one file with ``elmo_service/values.py`` (a symlink in the repository,
a copy in the wheel). Where the library is installed too, its own module is used, so a
client's ``EmbeddedSentence`` *is* the library's class and ``except InputError`` catches
both (a script swaps ``Embedder`` for ``Client`` and changes nothing else); alone, the
client uses its copy of the same source. Neither path imports torch.
"""

try:
    from elmo_service import values as _values
except ImportError:  # the client installed alone (pip install ./clients/python)
    from elmo_client import values as _values

ElmoServiceError, InputError = _values.ElmoServiceError, _values.InputError
EmbeddedSentence, Token = _values.EmbeddedSentence, _values.Token
check_document, decode_array = _values.check_document, _values.decode_array

__all__ = [
    "ElmoServiceError",
    "EmbeddedSentence",
    "InputError",
    "Token",
    "check_document",
    "decode_array",
]
