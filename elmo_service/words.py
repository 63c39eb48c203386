"""Sub-word pieces grouped into words: one vector per word is its pieces' mean.

Written once for the library (``EmbeddedSentence.words``, ``granularity="word"``), the
API (``api/outputs.py``) and the Python client: the functions live in
``elmo_service/values.py`` (numpy only, shipped in the client too); this module names them.
"""

from elmo_service.values import average_words, word_groups, word_tokens, words_of

__all__ = ["average_words", "word_groups", "word_tokens", "words_of"]
