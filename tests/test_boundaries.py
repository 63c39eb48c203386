"""Package boundaries, read from the source with ``ast`` (every import, lazy ones too).

The picture (``docs/architecture.md``)::

    elmo_cli ─────> elmo_api, elmo_jobs, elmo_bulk, elmo_service   (the commands, lazily)
    elmo_api ─────> elmo_jobs ──> elmo_pretrain ──> elmo_service
     └────────────────────────────────────────────> elmo_service
    elmo_bulk ────> elmo_service                                    (the Ray corpus job)
    elmo_api, elmo_jobs ──> elmo_storage   (Redis clients, replies, file locks; imports none of ours)
    elmo_client (clients/python) ──> its own values module (one file with elmo_service.values)

* ``elmo_service`` (the core library) imports none of the others;
* ``elmo_pretrain`` imports only the core; ``elmo_jobs`` the core and ``elmo_pretrain``;
* ``elmo_api`` imports the core and ``elmo_jobs``' public interface (``jobs/__init__.py``),
  never ``elmo_pretrain``;
* ``elmo_bulk`` (the corpus job) imports only the core; ``elmo_cli`` (the applications'
  entry point) may import every package;
* ``elmo_storage`` (the stores' plumbing) imports none of the others; ``elmo_api`` and
  ``elmo_jobs`` may import it;
* no two modules import each other, directly or around a loop;
* LSTM math (gate nonlinearities, the fused LSTM ops) lives in the core only;
* every ``torch.load`` reads tensors only (``weights_only=True``), and a foreign checkpoint's
  header is read by a module that imports no torch (``elmo_service/bilm/tensor_header.py``);
* every third-party import of a product module is a declared dependency, and the core's
  are the library's own (``pip install elmo-service``: no server packages).

Folders keep short names (``api/``, ``jobs/``...); installed, they are ``elmo_*`` packages
(``pyproject.toml``'s package-dir).

Imports under ``if TYPE_CHECKING:`` count: they are still a dependency of the code's shape.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# installed package -> its folder in the repository
FOLDERS = {
    "elmo_service": "elmo_service",
    "elmo_pretrain": "pretrain",
    "elmo_jobs": "jobs",
    "elmo_api": "api",
    "elmo_storage": "storage",
    "elmo_bulk": "bulk",
    "elmo_cli": "cli",
}
PACKAGES = tuple(FOLDERS)
# package -> the packages it may import (besides itself)
ALLOWED = {
    "elmo_service": set(),
    "elmo_pretrain": {"elmo_service"},
    "elmo_jobs": {"elmo_service", "elmo_pretrain", "elmo_storage"},
    "elmo_api": {"elmo_service", "elmo_jobs", "elmo_storage"},
    "elmo_storage": set(),  # the stores' plumbing (Redis clients, replies, file locks)
    "elmo_bulk": {"elmo_service"},
    "elmo_cli": {"elmo_service", "elmo_api", "elmo_jobs", "elmo_bulk", "elmo_pretrain"},
}
# import name -> distribution, where packages_distributions() cannot tell (not installed)
DIST_OF = {
    "yaml": "pyyaml",
    "google": "protobuf",
    "uvicorn": "uvicorn",
    "elmo_client": "elmo-service-client",  # clients/python: this repository's own client
}


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    target: str  # the imported module (or the name's module, for ``from m import name``)
    names: tuple[str, ...]  # for ``from m import a, b``
    line: int
    guarded: bool  # inside ``try: ... except ImportError``


def _module_name(pkg: str, path: Path) -> str:
    parts = [pkg, *path.relative_to(ROOT / FOLDERS[pkg]).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / FOLDERS[pkg]).rglob("*.py")):
            out[_module_name(pkg, path)] = path
    return out


def _guards_import_error(node: ast.Try) -> bool:
    for h in node.handlers:
        names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
        if any(
            isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
            for n in names
        ):
            return True
    return False


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    path = modules()[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                found.append(Import(module, a.name, (), node.lineno, guarded))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parent = package.split(".")
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            found.append(
                Import(module, base, tuple(a.name for a in node.names), node.lineno, guarded)
            )
        try_guard = isinstance(node, ast.Try) and _guards_import_error(node)
        for child in ast.iter_child_nodes(node):
            in_body = try_guard and child in node.body  # type: ignore[attr-defined]
            visit(child, guarded or in_body)

    visit(tree, False)
    return tuple(found)


def _resolve(name: str) -> str | None:
    """The product module ``name`` refers to (its longest known prefix), or None."""
    mods = modules()
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def edges(module: str) -> set[str]:
    """The product modules ``module`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    out = set()
    for imp in imports_of(module):
        if imp.target.split(".")[0] not in PACKAGES:
            continue
        subs = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in modules()]
        targets = subs if subs and len(subs) == len(imp.names) else [imp.target, *subs]
        out.update(t for t in map(_resolve, targets) if t and t != module)
    return out


def package_of(module: str) -> str:
    return module.split(".")[0]


# ------------------------------------------------------------------ the tests


def test_the_scan_sees_the_code():
    """Guards the other tests against passing on nothing."""
    mods = modules()
    assert {
        "elmo_service.bilm.model",
        "elmo_api.main",
        "elmo_jobs.runner",
        "elmo_pretrain.train",
    } <= set(mods)
    assert "elmo_jobs.runner" in edges("elmo_jobs.worker")
    assert "elmo_pretrain.lm" in edges("elmo_pretrain.train")
    # a lazy import inside a function is seen
    assert any(i.target == "elmo_pretrain.evaluate" for i in imports_of("elmo_pretrain.train"))


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_the_picture_allows(package):
    bad = [
        f"{m}:{i.line} imports {i.target}"
        for m in modules()
        if package_of(m) == package
        for i in imports_of(m)
        if i.target.split(".")[0] in PACKAGES
        and package_of(i.target) != package
        and package_of(i.target) not in ALLOWED[package]
    ]
    assert not bad, f"{package} may import only {sorted(ALLOWED[package])}: " + "; ".join(bad)


def test_api_uses_only_the_public_interface_of_jobs():
    import elmo_jobs as jobs

    public = set(jobs.__all__)
    bad = []
    for m in modules():
        if package_of(m) != "elmo_api":
            continue
        for i in imports_of(m):
            if package_of(i.target) != "elmo_jobs":
                continue
            if i.target != "elmo_jobs" or not set(i.names) <= public:
                bad.append(f"{m}:{i.line} imports {i.target} {list(i.names)}")
    assert not bad, f"api may import only jobs' exports {sorted(public)}: " + "; ".join(bad)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the graph's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    comps.append(sorted(comp))
    return comps


def test_the_cycle_finder_finds_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert sorted(_strongly_connected(g)) == [["a", "b", "c"], ["d"], ["e"]]


def test_no_two_modules_import_each_other():
    graph = {m: edges(m) for m in modules()}
    loops = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not loops, "modules importing each other (around a loop): " + "; ".join(
        " <-> ".join(c) for c in loops
    )


def test_packages_form_no_loop():
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for m in modules():
        graph[package_of(m)] |= {package_of(t) for t in edges(m)} - {package_of(m)}
    assert all(len(c) == 1 for c in _strongly_connected(graph)), graph


# LSTM math: the gate nonlinearities and the fused LSTM ops
_LSTM_CALLS = {"sigmoid", "tanh", "lstm", "lstm_cell", "LSTM", "LSTMCell", "hardsigmoid"}
# a downstream task network's own biLSTM (torch's nn.LSTM), not the biLM's math
_LSTM_EXEMPT = {"elmo_pretrain.finetune.network"}


def _bench_modules() -> dict[str, Path]:
    """The benchmarks (``bench/*.py``): scripts, but their baselines must not grow LSTM math."""
    return {f"bench.{p.stem}": p for p in sorted((ROOT / "bench").glob("*.py"))}


def test_no_lstm_math_outside_the_core():
    bad = []
    for m, path in {**modules(), **_bench_modules()}.items():
        if m.startswith("elmo_service") or m in _LSTM_EXEMPT:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = (
                f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            )
            gates = (
                name == "chunk"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == 4
            )
            if name in _LSTM_CALLS or gates:
                bad.append(f"{m}:{node.lineno} calls {name}")
    assert not bad, "LSTM math belongs in elmo_service/: " + "; ".join(bad)


# the native loops read the pre-scaled layout of kernels/bilstm.py's ScaledLayer (doubled
# g rows, doubled cell, doubled projection): only that class may call them
_SCALED_LOOPS = {
    "lstm_cell",
    "lstmp_row",
    "lstmp_row_from",
    "_cell_row",
}
_SCALED_HOME = {
    "elmo_service.bilm.kernels.bilstm",
    "elmo_service.bilm.kernels.native_step",
    "elmo_service.bilm.kernels.native_rounded",  # the compact weights' products
}


def test_the_pre_scaled_native_loops_are_called_only_through_scaled_layer():
    bad = []
    for m, path in {**modules(), **_bench_modules()}.items():
        if m in _SCALED_HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            bad += [f"{m}:{node.lineno} uses {n}" for n in names if n in _SCALED_LOOPS]
    assert not bad, "the pre-scaled native loops are ScaledLayer's alone: " + "; ".join(bad)
    # and ScaledLayer is the one place that calls them
    tree = ast.parse((ROOT / "elmo_service/bilm/kernels/bilstm.py").read_text(encoding="utf-8"))
    callers = {
        cls.name
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for n in ast.walk(cls)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _SCALED_LOOPS
    }
    assert callers == {"ScaledLayer"}, callers


def _canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()  # PEP 503


def _requirement_names(reqs: list[str]) -> set[str]:
    return {_canonical(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in reqs}


# package -> the extras its audience installs (the core's are the library's own dependencies)
AUDIENCE = {
    "elmo_service": (),
    "elmo_pretrain": (),
    "elmo_api": ("server",),
    "elmo_jobs": ("server",),
    "elmo_storage": ("server",),
    "elmo_bulk": ("bulk", "hdf5"),
    "elmo_cli": (),  # the service commands import elmo_api lazily, under a guard
}


def test_every_third_party_import_is_a_declared_dependency():
    """Each package imports the library's dependencies and its own audience's extras; any other
    extra only under an ImportError guard (that names the extra to install)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = _requirement_names(project["dependencies"])
    extras = project.get("optional-dependencies", {})
    optional = _requirement_names([r for reqs in extras.values() for r in reqs])
    dists = importlib.metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = []
    for m in modules():
        own = required | _requirement_names(
            [r for e in AUDIENCE[package_of(m)] for r in extras.get(e, [])]
        )
        imps = imports_of(m)
        guarded = {i.target.split(".")[0] for i in imps if i.guarded}
        for i in imps:
            top = i.target.split(".")[0]
            if not top or top in stdlib or top in PACKAGES or top == "elmo_client":
                continue
            names = {_canonical(d) for d in dists.get(top, [])} | {
                _canonical(DIST_OF.get(top, top))
            }
            if names & own:
                continue
            if names & optional and top in guarded:  # another extra, imported under a guard
                continue
            bad.append(f"{m}:{i.line} imports {top} (distribution {sorted(names)})")
    assert not bad, "undeclared (or unguarded optional) imports: " + "; ".join(sorted(set(bad)))


def test_the_library_install_has_none_of_the_servers_packages():
    """``pip install elmo-service`` is the library: the server's packages are an extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = _requirement_names(project["dependencies"])
    server = {"fastapi", "uvicorn", "redis", "rq", "prometheus-client", "httpx", "starlette"}
    assert not required & server, sorted(required & server)
    assert server - {"httpx"} <= _requirement_names(project["optional-dependencies"]["server"])


def test_the_job_worker_and_the_preparing_cli_start_without_torch():
    """A job's worker and its ``prepare`` phase are processes of their own, started per job:
    neither needs torch (~2 CPU-seconds to import), so neither imports it."""
    code = (
        "import sys, elmo_jobs.worker, elmo_pretrain.cli, elmo_pretrain.prepare\n"
        "import elmo_pretrain.probe as probe\n"
        "assert 'word_features' in probe.__all__ and not hasattr(probe, 'nothing')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_every_package_folder_is_installed():
    """The package-dir mapping lists packages one by one: a new sub-package must be added."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {**FOLDERS, **setup["package-dir"]} and set(
        setup["package-dir"]
    ) == set(FOLDERS)
    found = {
        ".".join([pkg, *init.parent.relative_to(ROOT / folder).parts])
        for pkg, folder in FOLDERS.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found == set(setup["packages"]), found ^ set(setup["packages"])


def _renames(tree: ast.AST) -> list[int]:
    """Lines renaming a file: ``os.replace``/``os.rename``, or ``Path.replace``/``.rename``
    (one positional argument; ``str.replace`` takes two)."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        if f.attr not in ("replace", "rename"):
            continue
        on_os = isinstance(f.value, ast.Name) and f.value.id == "os"
        one_arg = len(node.args) == 1 and not node.keywords
        if on_os or (one_arg and not isinstance(node.args[0], ast.Starred)):
            found.append(node.lineno)
    return found


def test_files_are_renamed_into_place_only_by_the_atomic_helper():
    """Temp-file-then-rename is ``elmo_service/atomic.py``'s (it fsyncs file and folder)."""
    assert _renames(ast.parse("import os\nos.replace(a, b)\np.rename(q)\ns.replace('a', 'b')")) == [
        2,
        3,
    ]
    bad = [
        f"{m}:{line}"
        for m, path in modules().items()
        if m != "elmo_service.atomic"
        for line in _renames(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not bad, "use elmo_service.atomic instead of renaming by hand: " + "; ".join(bad)


# optional heavy dependencies -> the only modules that may import them
_CONFINED = {"ray": {"elmo_bulk.cluster"}, "pyarrow": {"elmo_bulk.shard"}}


def test_ray_and_pyarrow_stay_inside_the_bulk_package():
    """``import elmo_service`` (and the service) never pulls in Ray: the bulk package's
    cluster module alone imports it, and its shard module alone imports pyarrow."""
    assert {"elmo_bulk.plan", "elmo_bulk.run"} <= set(modules())
    bad = [
        f"{m}:{i.line} imports {i.target}"
        for m in modules()
        for i in imports_of(m)
        if i.target.split(".")[0] in _CONFINED and m not in _CONFINED[i.target.split(".")[0]]
    ]
    assert not bad, "Ray and pyarrow are imported only in bulk/: " + "; ".join(bad)


def _loads_without_weights_only(tree: ast.AST) -> list[int]:
    """Lines calling ``torch.load`` without ``weights_only=True``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "load"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
        and not any(
            k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in node.keywords
        )
    ]


def test_no_pickle_is_read_but_as_tensors():
    """Every ``torch.load`` passes ``weights_only=True``; the reader of a foreign
    checkpoint's header (``elmo_service/bilm/tensor_header.py``, run before any ``torch.load`` of
    a converted model) imports only the standard library and the core's errors: nothing a
    pickle names is imported and no tensor is built while its sizes are unchecked (#56)."""
    assert _loads_without_weights_only(
        ast.parse("torch.load(p)\ntorch.load(p, weights_only=True)")
    ) == [1]
    bad = [
        f"{m}:{line}"
        for m, path in modules().items()
        for line in _loads_without_weights_only(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not bad, "torch.load without weights_only=True: " + "; ".join(bad)
    allowed = set(sys.stdlib_module_names) | {"__future__", "elmo_service"}
    header = [i.target for i in imports_of("elmo_service.bilm.tensor_header")]
    assert header and all(t.split(".")[0] in allowed for t in header), header
    assert {t for t in header if t.startswith("elmo_service")} == {"elmo_service.errors"}


def _token_texts_batched(tree: ast.AST) -> list[int]:
    """Lines building a batch of token texts, ``[[t.text for t in ts] for ts in ...]``: the
    shape of a model's input, which must be the tokens' pieces."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ListComp) or not isinstance(node.elt, ast.ListComp):
            continue
        inner = node.elt
        targets = {g.target.id for g in inner.generators if isinstance(g.target, ast.Name)}
        elt = inner.elt
        if (
            isinstance(elt, ast.Attribute)
            and elt.attr == "text"
            and isinstance(elt.value, ast.Name)
            and elt.value.id in targets
        ):
            lines.append(node.lineno)
    return lines


def test_the_model_is_fed_token_pieces_not_texts():
    """A token's ``text`` is its span of the input; what the model reads is its ``piece``
    (a byte piece, sentencepiece's NFKC form, a lowercased word: #57). A batch of token
    texts handed to a model would compute other vectors for those tokens."""
    assert _token_texts_batched(ast.parse("[[t.text for t in ts] for ts in x]")) == [1]
    assert _token_texts_batched(ast.parse("[[t.piece for t in ts] for ts in x]")) == []
    bad = [
        f"{m}:{line}"
        for m, path in {**modules(), **_bench_modules()}.items()
        for line in _token_texts_batched(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not bad, "feed the model t.piece: " + "; ".join(bad)


# ------------------------------------------------------------------ the core's shape

# the core package: top-level modules, a subpackage (``bilm/``) counted as one node
CORE_MODULES_AT_MOST = 22
CORE_ARROWS_AT_MOST = 75


def _core_node(module: str) -> str:
    return ".".join(module.split(".")[:2])


def core_graph() -> tuple[set[str], set[tuple[str, str]]]:
    core = [m for m in modules() if package_of(m) == "elmo_service"]
    nodes = {_core_node(m) for m in core}
    arrows = {
        (_core_node(m), _core_node(t))
        for m in core
        for t in edges(m)
        if package_of(t) == "elmo_service" and _core_node(m) != _core_node(t)
    }
    return nodes, arrows


def test_the_core_stays_small():
    """At most 22 modules (``bilm/`` one of them) and 75 import arrows among them."""
    nodes, arrows = core_graph()
    print(f"elmo_service: {len(nodes)} modules, {len(arrows)} import arrows")
    assert "elmo_service.bilm" in nodes and "elmo_service.embedder" in nodes  # the scan sees it
    assert ("elmo_service.embedder", "elmo_service.bilm") in arrows
    assert len(nodes) <= CORE_MODULES_AT_MOST, sorted(nodes)
    assert len(arrows) <= CORE_ARROWS_AT_MOST, sorted(arrows)


# a namedtuple's underscore names are its public interface
_NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make"}


def private_reach_ins(path: Path) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self``/``cls``/``super()``, not a module
    imported with ``import`` (or a chain from one: a third party's), and ``_name`` is defined nowhere in this
    module (so not this module's own class reading its own kind)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    own, imported = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                own.add(n.attr)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            own.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(n, ast.Import):
            imported.update(a.asname or a.name.split(".")[0] for a in n.names)
    found = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for n in ast.walk(tree):
        if not isinstance(n, ast.Attribute) or not n.attr.startswith("_"):
            continue
        if n.attr.startswith("__") or n.attr in own or n.attr in _NAMEDTUPLE:
            continue
        root = n.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
            continue
        if isinstance(root, ast.Name) and root.id in imported:  # a module's (a third party's)
            continue
        if isinstance(n.value, ast.Call) and getattr(n.value.func, "id", None) == "super":
            continue
        found.append(f"{where}:{n.lineno}: {ast.unparse(n)}")
    return found


def test_the_private_scan_finds_a_reach_in(tmp_path):
    p = tmp_path / "probe.py"
    p.write_text(
        "import torch\n\nclass A:\n    def f(self, emb):\n        self._own = torch._C\n"
        "        return emb._lock, emb.lock, self.emb._cache, other._own\n"
    )
    assert [f.split(": ")[1] for f in private_reach_ins(p)] == ["emb._lock", "self.emb._cache"]


def test_no_module_outside_bilm_reads_another_objects_privates():
    """``bilm/`` is the model and how it runs; everything else (the core, the server, the
    CLI, pretraining, the jobs) uses its public names (``Runner``, the kernel protocol), and
    each other's."""
    found = [
        f
        for m, path in modules().items()
        if not m.startswith("elmo_service.bilm")
        for f in private_reach_ins(path)
    ]
    assert found == [], "\n".join(found)
