"""The models folder: which artifacts it holds (read with the core's artifact reader,
no weights loaded), and resolving a name in it safely."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from api.served import ServedModel
from elmo_service.artifact import MANIFEST, read_header
from elmo_service.errors import InputError
from elmo_service.names import check_model_name


def list_artifacts(models_dir: Path, served: ServedModel | None = None) -> list[dict[str, Any]]:
    """Every artifact folder in ``models_dir`` (config and manifest only, no weights),
    plus the served model if it lives elsewhere; ``served`` marks the one being served."""
    served_path = served.path.resolve() if served is not None else None
    found: list[Path] = []
    root = Path(models_dir)
    if root.is_dir():
        found = sorted(
            d for d in root.iterdir() if not d.name.startswith(".") and (d / MANIFEST).is_file()
        )
    if served_path is not None and all(d.resolve() != served_path for d in found):
        found.append(served.path)  # type: ignore[union-attr]
    out = []
    for d in found:
        entry: dict[str, Any] = {"id": d.name, "object": "model", "path": str(d)}
        try:
            head = read_header(d)
            entry.update(
                version=head.version,
                created=int((d / MANIFEST).stat().st_mtime),
                n_layers=head.config.n_output_layers,
                dim=head.config.output_dim,
                tokenizer=head.tokenizer.get("type"),
                provenance=head.provenance,
            )
        except Exception as e:  # noqa: BLE001 - listed, with what is wrong with it
            entry["error"] = f"unreadable artifact: {e}"
        entry["served"] = served_path is not None and d.resolve() == served_path
        if entry["served"]:
            entry["version"] = served.version  # type: ignore[union-attr]
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
