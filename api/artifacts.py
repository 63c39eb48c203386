"""The models folder: which artifacts it holds (read with the core's artifact reader,
no weights loaded), and resolving a name in it safely."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elmo_api.served import ServedModel, provenance_summary
from elmo_service.artifact import MANIFEST, read_header
from elmo_service.errors import InputError
from elmo_service.settings_base import check_model_name


def _served_entry(served: ServedModel, full: bool) -> dict[str, Any]:
    """What is served, as loaded (not what its folder holds now)."""
    prov = served.embedder.artifact.provenance
    return {
        "id": served.name,
        "object": "model",
        "path": served.path.name,
        "version": served.version,
        "created": served.created,
        "n_layers": served.n_layers,
        "dim": served.dim,
        "tokenizer": served.embedder.tokenizer.kind,
        "provenance": prov if full else provenance_summary(prov),
        "served": True,
    }


def list_artifacts(
    models_dir: Path, served: ServedModel | None = None, full: bool = False
) -> list[dict[str, Any]]:
    """Every artifact folder in ``models_dir`` (config and manifest only, no weights),
    plus the served model if it lives elsewhere; ``served: true`` on the one being served.

    The served entry describes the model as loaded; when its folder was replaced or
    deleted since, ``disk_version`` / ``disk_error`` say what the folder holds now.
    ``full``: whole provenance records instead of their summaries.
    """
    served_path = served.path.resolve() if served is not None else None
    found: list[Path] = []
    root = Path(models_dir)
    if root.is_dir():
        found = sorted(
            d for d in root.iterdir() if not d.name.startswith(".") and (d / MANIFEST).is_file()
        )
    if served is not None and all(d.resolve() != served_path for d in found):
        found.append(served.path)
    out = []
    for d in found:
        is_served = served is not None and d.resolve() == served_path
        # the folder's name in the models folder: an answer never shows a server path
        entry: dict[str, Any] = {"id": d.name, "object": "model", "path": d.name}
        try:
            head = read_header(d)
            entry.update(
                version=head.version,
                created=int((d / MANIFEST).stat().st_mtime),
                n_layers=head.config.n_output_layers,
                dim=head.config.output_dim,
                tokenizer=head.tokenizer.get("type"),
                provenance=head.provenance if full else provenance_summary(head.provenance),
            )
        except Exception as e:  # noqa: BLE001 - listed, with what is wrong with it
            entry["error"] = f"unreadable artifact: {e}"
        entry["served"] = False
        if is_served:
            assert served is not None
            disk = entry
            entry = _served_entry(served, full)
            if "error" in disk:
                entry["disk_error"] = disk["error"]
            elif disk["version"] != served.version:
                entry["disk_version"] = disk["version"]  # replaced since loading
        out.append(entry)
    return out


def resolve_artifact(models_dir: Path, name: str) -> Path:
    """``models_dir/name``, refusing names that leave the folder; InputError / LookupError."""
    check_model_name(name, "name")
    root = Path(models_dir).resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise InputError(f"name: {name!r} resolves outside the models folder", field="name")
    if not (path / MANIFEST).is_file():
        raise LookupError(name)
    return path
