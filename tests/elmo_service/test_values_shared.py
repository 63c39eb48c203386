"""One source for what both sides of the wire share (#45 item 1).

``elmo_service/values.py`` (the library's and the API's) and ``clients/python/elmo_client/
values.py`` (the client's) are one file: a git symlink, copied into the client's wheel.
It imports nothing but numpy and the standard library, so it can ship alone; the client
package imports no torch and no library module (except the shared file's, where the
library is installed: ``elmo_client/shared.py``). The array codec is strict both ways.
"""

from __future__ import annotations

import ast
import base64
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from elmo_service import values

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "python" / "elmo_client"


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level module, level, guarded by ``except ImportError``) of every import."""
    out = []
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend((a.name.split(".")[0], 0, guarded) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.append(((node.module or "").split(".")[0], node.level, guarded))
        g = isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in node.handlers
        )
        for child in ast.iter_child_nodes(node):
            visit(child, guarded or (g and child in node.body))

    visit(tree, False)
    return out


def test_the_client_and_the_library_share_one_file():
    link = CLIENT / "values.py"
    assert link.is_symlink() and link.resolve() == (ROOT / "elmo_service" / "values.py").resolve()
    mode = subprocess.run(
        ["git", "ls-files", "-s", "clients/python/elmo_client/values.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert mode and mode[0] == "120000", "committed as a symlink, not a copy"
    import elmo_client.values as client_values

    assert Path(client_values.__file__).resolve() == Path(values.__file__).resolve()


def test_the_shared_file_imports_only_numpy_and_the_standard_library():
    found = _imports(ROOT / "elmo_service" / "values.py")
    allowed = set(sys.stdlib_module_names) | {"__future__", "numpy"}
    assert all(level == 0 for _, level, _ in found), "a relative import resolves differently"
    assert {m for m, _, _ in found} <= allowed, found


def test_the_client_package_imports_no_torch_and_no_library_module():
    allowed = set(sys.stdlib_module_names) | {"__future__", "numpy", "httpx", "httpcore",
                                              "orjson", "elmo_client"}  # fmt: skip
    bad = []
    for path in sorted(CLIENT.glob("*.py")):
        for module, _, guarded in _imports(path):
            if module in allowed:
                continue
            if guarded and module in ("elmo_service", "tqdm"):  # optional, with a fallback
                continue
            bad.append(f"{path.name}: {module}")
    assert not bad, bad
    code = (
        "import sys; import elmo_client; from elmo_client import Client; Client('http://h'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numba')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": f"{ROOT}:{CLIENT.parent}"}, check=True)  # fmt: skip
    assert r.stdout.strip() == "[]"


def test_where_both_are_installed_the_classes_are_the_librarys():
    import elmo_client
    from elmo_service import Client
    from elmo_service.embedder import EmbeddedSentence
    from elmo_service.errors import InputError
    from elmo_service.tokenizers import Token

    assert Client is elmo_client.Client
    assert elmo_client.EmbeddedSentence is EmbeddedSentence is values.EmbeddedSentence
    assert elmo_client.Token is Token and issubclass(elmo_client.ServiceInputError, InputError)


def test_without_the_client_the_library_says_how_to_install_it():
    code = (
        "import sys; sys.modules['elmo_client'] = None\n"
        "try:\n    from elmo_service import Client\nexcept ImportError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT)}, check=True)  # fmt: skip
    assert "pip install ./clients/python" in r.stdout and "elmo-service-client" in r.stdout


def _b64(x: np.ndarray, dtype: str = "<f4") -> str:
    return base64.b64encode(np.ascontiguousarray(x, dtype).tobytes()).decode()


def test_the_codec_round_trips_both_encodings():
    x = np.random.default_rng(0).standard_normal((3, 5, 4)).astype(np.float32)
    for encoding in ("base64", "json"):
        obj = values.encode_array(x, encoding, "float32")
        if encoding == "json":  # as it arrives: JSON lists
            obj = {**obj, "data": obj["data"].tolist()}
        assert np.array_equal(values.decode_array(obj), x)
    empty = np.zeros((3, 0, 4), np.float32)
    assert values.decode_array({"shape": [3, 0, 4], "dtype": "float32", "data": [[], [], []]}
                               ).shape == (3, 0, 4)  # fmt: skip
    assert values.decode_array(values.encode_array(empty, "base64", "float32")).shape == (3, 0, 4)


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        ({"shape": [2, 2], "dtype": "float64", "data": _b64(np.ones(4), "<f8")}, "dtype"),
        ({"shape": [2, 3], "dtype": "float32", "data": _b64(np.ones(4))}, "needs 24"),
        ({"shape": [2, -2], "dtype": "float32", "data": _b64(np.ones(4))}, "list of sizes"),
        ({"shape": [4], "dtype": "float32", "data": "@@not base64@@"}, "not base64"),
        ({"shape": [2, 2], "dtype": "float32", "data": [[1, 2], [3]]}, "neither"),
        ({"shape": [3], "dtype": "float32", "data": [1, 2]}, "not the shape"),
        ({"shape": [2], "dtype": "float32"}, "shape, dtype and data"),
        ([1, 2], "shape, dtype and data"),
    ],
)
def test_the_codec_refuses_what_does_not_hold_together(obj, says):
    with pytest.raises(ValueError, match=says):
        values.decode_array(obj)


def test_the_codec_can_refuse_non_finite_values():
    obj = {"shape": [2], "dtype": "float32", "data": _b64(np.array([1.0, np.inf]))}
    assert np.isinf(values.decode_array(obj)).any()  # the API's own tests may read them
    with pytest.raises(ValueError, match="NaN or an infinity"):
        values.decode_array(obj, finite=True)
