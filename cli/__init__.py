"""The ``elmo-service`` command: the core commands (``core``) and the service ones (``main``:
``serve``, ``worker``, imported only when run)."""
