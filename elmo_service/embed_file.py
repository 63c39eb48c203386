"""A text file, one sentence a line -> HDF5 in AllenNLP's ``elmo`` command's layout.

``embed-file`` (``cli/core.py``) and ``Embedder.embed_file`` both call
:func:`write_hdf5`: dataset ``str(i)`` holds line ``i``'s vectors (``"all"``: ``[L+1, T, D]``;
``"top"``, ``"average"`` or a task: ``[T, D]``), ``sentence_to_index`` maps each line to its
dataset (a JSON string), and the file's ``granularity`` attribute says what ``T`` counts.
Positions and mixes are ``elmo_service/outputs.py``'s, as on every other surface.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from elmo_service.atomic import atomic_path
from elmo_service.errors import ConfigError, ElmoServiceError, InputError, at_line
from elmo_service.outputs import GRANULARITIES, OutputSpec, plan_output, render
from elmo_service.scalar_mix import MixSpec

WHAT = ("all", "top", "average")


def h5py_module():
    """h5py, from the ``hdf5`` extra (AllenNLP's HDF5 files): a clear error where it is missing."""
    try:
        import h5py
    except ImportError as e:
        raise ConfigError(
            "HDF5 files need h5py: pip install 'elmo-service[hdf5]'", field="output"
        ) from e
    return h5py


def default_granularity(whitespace: bool) -> str:
    """Pre-tokenized input means one vector per given word, as AllenNLP users expect."""
    return "word" if whitespace else "token"


def check_lines(path: Path, documents: bool = False) -> int:
    """The file's line count; ElmoServiceError naming ``input`` when it is not a file. One
    pass, before any model loads. A blank line is a sentence with no tokens: its dataset is
    empty (``[L+1, 0, D]``), as every surface answers an empty sentence (#51); AllenNLP's
    `elmo` refuses the file instead. A blank line as a *document* (``documents``) is refused
    here, as an empty document is everywhere (docs/documents.md)."""
    if not path.is_file():
        raise ElmoServiceError(f"{path}: not a file (missing, or a folder)", field="input")
    n, blank = 0, []
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):  # noqa: B007 - n is the count after the loop
            if documents and not line.strip():
                blank.append(n)
    if not blank:
        return n
    more = f" (and {len(blank) - 5} more)" if len(blank) > 5 else ""
    raise ElmoServiceError(
        f"{path} has blank lines ({', '.join(map(str, blank[:5]))}{more}); with --documents "
        "each line is a document, and an empty document has nothing to embed (drop them with: "
        "grep -v '^[[:space:]]*$')",
        field="input",
    )


def check_output(path: Path) -> None:
    if not path.resolve().parent.is_dir():
        raise ElmoServiceError(
            f"{path}: its folder {path.resolve().parent} does not exist", field="output"
        )


def file_spec(emb: Any, what: str = "all", task: str | None = None, granularity: str = "token"):
    """The output spec of ``what`` (``"all"``, ``"top"``, ``"average"``) or of a stored task."""
    if granularity not in GRANULARITIES:
        raise InputError(f"granularity must be one of {GRANULARITIES}", field="granularity")
    if task is not None:
        tasks = emb.artifact.tasks
        return plan_output(emb.n_layers, task=task, granularity=granularity).with_mix(
            tasks.get(task), tasks
        )
    if what not in WHAT:
        raise InputError(f"what must be one of {WHAT}", field="what")
    if what == "average":
        mix = MixSpec.average(emb.n_layers)
        return plan_output(emb.n_layers, mix=mix, granularity=granularity)
    layers = [emb.n_layers - 1] if what == "top" else None
    return plan_output(emb.n_layers, output="layers", layers=layers, granularity=granularity)


def write_hdf5(
    emb: Any,
    input_file: Path,
    output_file: Path,
    *,
    what: str = "all",
    task: str | None = None,
    granularity: str | None = None,
    whitespace: bool = False,
    chunk_lines: int = 1024,
    progress: bool = False,
    lines: int | None = None,
    documents: bool = False,
    chunk_tokens: int | None = None,
    documents_at_once: int | None = None,
) -> int:
    """Embed ``input_file`` with ``emb`` into ``output_file`` (written whole or not at all);
    returns the sentences written. ``whitespace``: lines are pre-tokenized words (then
    ``granularity`` defaults to ``"word"``); ``lines``: the count :func:`check_lines`
    already gave (the file is checked here otherwise). ``documents``: each line is a
    document, embedded as one sequence (``Embedder.embed_document``, any length) and
    written chunk by chunk (``chunk_tokens``) into its dataset, at constant memory;
    ``documents_at_once`` documents (default ``document.DOCUMENTS_AT_ONCE``) advance
    together, a row each in one batched step."""
    import numpy as np
    from tqdm import tqdm

    h5py = h5py_module()

    input_file, output_file = Path(input_file), Path(output_file)
    if lines is None:
        lines = check_lines(input_file, documents)
    check_output(output_file)
    spec = file_spec(emb, what, task, granularity or default_granularity(whitespace))
    sentence_to_index: dict[str, str] = {}
    index = 0
    with (
        atomic_path(output_file) as tmp,  # a crash never leaves a half-written file behind
        input_file.open(encoding="utf-8", errors="replace") as fin,
        h5py.File(tmp, "w") as fout,
        tqdm(total=lines, unit="sent", disable=not progress) as bar,
    ):
        if documents:
            lines_in = (line.rstrip("\n") for line in fin)
            names = _write_documents(
                emb, fout, lines_in, input_file, spec, whitespace, chunk_tokens,
                documents_at_once, bar,
            )  # fmt: skip
            for index, line in enumerate(names):  # in line order: the last of equal lines wins
                sentence_to_index[line] = str(index)
            index = len(names)
        else:
            for chunk in chunks((line.rstrip("\n") for line in fin), chunk_lines):
                inputs = [line.split() for line in chunk] if whitespace else chunk
                token_lists = emb.tokenize(
                    inputs, field="input", where=at_line(input_file, 1), offset=index
                )
                layers = emb.embed_tokens([[t.piece for t in toks] for toks in token_lists])
                for line, toks, x in zip(chunk, token_lists, layers, strict=True):
                    # a blank line (or one the tokenizer empties, e.g. U+200B) is a sentence with
                    # no tokens: its dataset has no positions, as the library answers it (#51)
                    data = _dataset(x, toks, spec)
                    if not np.isfinite(data).all():  # never write a NaN a reader would trust
                        raise ElmoServiceError(
                            f"line {index + 1} of {input_file}: the model produced non-finite values",
                            field="input",
                        )
                    fout.create_dataset(str(index), data=data, dtype="float32")
                    sentence_to_index[line] = str(index)
                    index += 1
                bar.update(len(chunk))
        ds = fout.create_dataset("sentence_to_index", (1,), dtype=h5py.string_dtype())
        ds[0] = json.dumps(sentence_to_index)
        fout.attrs["granularity"] = spec.granularity  # which positions the datasets hold
    return index


def _dataset(x: Any, toks: list, spec: OutputSpec) -> Any:
    layers, mix = render(x, toks, spec)
    if mix is not None:
        return mix
    return layers if spec.all_layers else layers[0]  # "top": [T, D]


def _write_documents(
    emb: Any,
    fout: Any,
    lines: Iterator[str],
    input_file: Path,
    spec: OutputSpec,
    whitespace: bool,
    chunk_tokens: int | None,
    at_once: int | None,
    bar: Any,
) -> list[str]:
    """Each line a document, ``at_once`` of them advancing together
    (``elmo_service.document.advance_all``); a document whose first pass is done is written
    chunk by chunk into its dataset (sized from its tokens), so none is held whole. Returns
    the lines in order."""
    import numpy as np

    from elmo_service.document import (
        DOCUMENTS_AT_ONCE,
        DocumentRun,
        advance_all,
        tokenize_document,
    )

    names: list[str] = []
    datasets: dict[int, Any] = {}

    def runs() -> Iterator[DocumentRun]:
        for index, line in enumerate(lines):
            where = f"line {index + 1} of {input_file}"
            try:
                words = line.split() if whitespace else line
                doc = tokenize_document(emb.tokenizer, words, field="input", max_tokens=None)
            except InputError as e:
                raise InputError(f"{where}: {e.message}", field="input", index=index) from e
            n = len(doc) if spec.granularity == "token" else int(doc.word[-1] - doc.word[0]) + 1
            shape = (len(spec.layers), n, emb.dim) if spec.all_layers else (n, emb.dim)
            datasets[index] = fout.create_dataset(str(index), shape=shape, dtype="float32")
            names.append(line)
            yield DocumentRun(emb, doc, spec, chunk_tokens)

    for index, run in advance_all(runs(), DOCUMENTS_AT_ONCE if at_once is None else at_once):
        ds, at = datasets.pop(index), 0
        for c in run.answer():
            data = c.mix if c.mix is not None else (c.layers if spec.all_layers else c.layers[0])
            if not np.isfinite(data).all():  # never write a NaN a reader would trust
                raise ElmoServiceError(
                    f"line {index + 1} of {input_file}: the model produced non-finite values",
                    field="input",
                )
            k = data.shape[-2]
            if spec.all_layers:
                ds[:, at : at + k] = data
            else:
                ds[at : at + k] = data
            at += k
        assert at == ds.shape[-2], (at, ds.shape)
        bar.update(1)
    return names


T = TypeVar("T")


def chunks(items: Iterable[T], n: int) -> Iterator[list[T]]:
    """Lists of ``n`` items (the last one shorter), reading ``items`` only as far as needed."""
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
