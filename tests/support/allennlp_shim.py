"""Make ``allennlp.modules.elmo`` (AllenNLP 2.10.1) importable beside torch 2.13.

The parity tests run AllenNLP's own ``_ElmoBiLm`` and ``batch_to_ids``. AllenNLP
is installed with ``--no-deps`` (``tests/install_parity_deps.sh``) together
with the small pure-Python packages its import chain needs (cached-path,
requests, rich, dill, base58, lmdb, more-itertools ...). A few packages that
the chain *imports* cannot be installed here, so :func:`import_allennlp_elmo` registers
stand-in modules for them in ``sys.modules``. Every one of them is imported at
module level somewhere in ``allennlp/__init__``, ``allennlp.common``,
``allennlp.data``, ``allennlp.nn`` or ``allennlp.modules`` (or in
cached-path's remote URL schemes), and **none of them is executed** by
``_ElmoBiLm`` / ``_ElmoCharacterEncoder`` / ``ElmoLstm`` /
``LstmCellWithProjection`` / ``Highway`` / ``batch_to_ids`` on local files:

``transformers``
    ``import transformers`` in ``allennlp/__init__``, ``from transformers
    import XLNetConfig`` in the pretrained-transformer embedder, ``ACT2FN`` in
    ``modules/transformer``, optimizers and schedulers. Not installable:
    AllenNLP needs ``transformers<4.21``, which needs ``tokenizers<0.13``,
    which has no wheel for Python 3.11 (a Rust build of a 2022 crate).
``spacy``
    ``allennlp/__init__``, ``common/util`` (model download helpers), the spaCy
    tokenizer, sentence splitter and token indexer. Not installable:
    ``spacy<3.4`` needs ``pydantic<1.9`` (the project runs on pydantic 2) and
    thinc/blis built against numpy 1.
``fairscale``
    ``nn/parallel/fairscale_fsdp_accelerator`` and
    ``nn/checkpoint/fairscale_checkpoint_wrapper`` (distributed training).
    Only an sdist of 0.4.6 exists and its build pulls a second torch.
``torchvision``
    ``modules/vision`` (region detector, grid embedder). Versions AllenNLP
    accepts pin ``torch<1.13``; none exists for Python 3.11 / torch 2.13.
``boto3``, ``botocore``, ``google`` (cloud storage/auth/api_core), ``huggingface_hub``
    cached-path's ``s3://``, ``gs://`` and ``hf://`` scheme clients, imported
    when ``cached_path`` is; a local path never reaches them. Heavy SDKs
    (and old pins: cached-path 1.1 wants ``huggingface-hub<0.11``).

A stand-in is only registered when the real package cannot be found, so an
environment that has it keeps using it. Anything taken from a stand-in is a
class that raises :class:`StubUsed` when instantiated or called: if AllenNLP's
ELMo path ever touched one, the parity tests would fail loudly instead of
computing something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import tempfile
import types

import pytest

STUBBED = (
    "transformers",
    "spacy",
    "fairscale",
    "torchvision",
    "boto3",
    "botocore",
    "google",
    "huggingface_hub",
)


class StubUsed(RuntimeError):
    """A stand-in registered by this shim was actually used."""


class _StubMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item):  # e.g. ACT2FN["gelu"] or Generic-style use
        return _stub_class(f"{cls.__qualname__}[{item!r}]")


def _stub_class(qualname: str) -> type:
    def _refuse(self, *args, **kwargs):
        raise StubUsed(f"{qualname} comes from tests/support/allennlp_shim.py and must not be used")

    return _StubMeta(
        qualname.rsplit(".", 1)[-1],
        (),
        {"__qualname__": qualname, "__init__": _refuse, "__call__": _refuse},
    )


class _StubModule(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name, f"stand-in registered by tests/support/allennlp_shim.py for {name}")
        self.__path__ = []  # a package, so submodule imports come back to the finder
        self.__version__ = "0.0.0+stub"

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".", 1)[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


_used: set[str] = set()


def _cache_root() -> None:
    os.environ.setdefault(
        "ALLENNLP_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "elmo-service-allennlp-cache")
    )


def stubs_in_use() -> list[str]:
    """Names of the stand-in modules AllenNLP's import took."""
    return sorted(_used)


def import_allennlp_elmo() -> types.ModuleType:
    """``allennlp.modules.elmo``, imported with the stand-ins in place.

    The stand-ins live only for the duration of the import: afterwards the
    finder is removed and the stand-in modules leave ``sys.modules`` (AllenNLP
    keeps its references), so other code in the same process that imports or
    probes for ``transformers``, ``boto3``... sees exactly what is installed,
    and a lazy import of a stubbed package at run time raises ImportError.
    """
    _cache_root()
    if "allennlp.modules.elmo" in sys.modules:
        return sys.modules["allennlp.modules.elmo"]
    finder = _StubFinder(set(STUBBED))
    # appended last: it answers only for modules no real finder can locate, so an
    # installed package (or the real ``google.protobuf`` beside a stubbed
    # ``google.cloud``) always wins
    sys.meta_path.append(finder)
    try:
        import allennlp.modules.elmo as elmo
    finally:
        sys.meta_path.remove(finder)
        _withdraw()
    return elmo


def _withdraw() -> None:
    stubs = {n for n, m in sys.modules.items() if isinstance(m, _StubModule)}
    _used.update(stubs)
    for name in stubs:
        del sys.modules[name]
        parent, _, child = name.rpartition(".")
        real_parent = sys.modules.get(parent)
        if (
            parent
            and real_parent is not None
            and isinstance(getattr(real_parent, child, None), _StubModule)
        ):
            delattr(real_parent, child)


@pytest.fixture(scope="module", name="allennlp")
def allennlp_fixture() -> types.ModuleType:
    """``allennlp``: ``allennlp.modules.elmo``; a test fails (never skips) without it.
    A test module imports this function, and its tests take ``allennlp``."""
    try:
        return import_allennlp_elmo()
    except ImportError as e:  # pragma: no cover - the message is the point
        pytest.fail(f"AllenNLP is not importable ({e}); run tests/install_parity_deps.sh")
