"""The on-disk model artifact: a directory anyone can inspect.

    model_dir/
      config.json          schema_version, model (BiLMConfig), tokenizer, provenance
      weights.safetensors  the BiLM's tensors (never pickle)
      tokenizer.model      sentencepiece models only
      manifest.json        sha256 of every file above; their hash is the model version
      tasks/NAME.json      optional learned scalar mixes (not part of the version)

Loading checks every file against the manifest and every tensor's name, shape
and dtype against the config, refuses NaN or inf weights, and names what is wrong.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from elmo_service import atomic
from elmo_service.atomic import sha256_file
from elmo_service.bilm.config import BiLMConfig
from elmo_service.bilm.model import BiLM
from elmo_service.errors import ArtifactError, ConfigError
from elmo_service.scalar_mix import MixSpec, check_task_name
from elmo_service.tokenizers import Tokenizer, load_tokenizer

SCHEMA_VERSION = 1
FORMAT = "elmo-service-bilm"
CONFIG, WEIGHTS, MANIFEST, TASKS = "config.json", "weights.safetensors", "manifest.json", "tasks"
# the repository's models folder (models/default is the bundled model)
BUNDLED_MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


def default_model_dir() -> Path:
    """The model ``elmo-service serve`` serves when given none: ``ELMO_MODEL_PATH``, else
    ``ELMO_MODELS_DIR``/``ELMO_MODEL`` (as set in the Docker image), else the bundled
    ``models/default``. The command-line tools default to it too."""
    if os.environ.get("ELMO_MODEL_PATH"):
        return Path(os.environ["ELMO_MODEL_PATH"])
    root = Path(os.environ.get("ELMO_MODELS_DIR") or BUNDLED_MODELS_DIR)
    return root / (os.environ.get("ELMO_MODEL") or "default")


def version_of(file_hashes: dict[str, str]) -> str:
    """The model version: a hash over the manifest's files, 16 hex chars."""
    h = hashlib.sha256()
    for name in sorted(file_hashes):
        h.update(f"{name}\0{file_hashes[name]}\n".encode())
    return h.hexdigest()[:16]


@dataclass
class Artifact:
    path: Path
    config: BiLMConfig
    tokenizer: Tokenizer
    model: BiLM
    version: str
    provenance: dict[str, Any] = field(default_factory=dict)
    tasks: dict[str, MixSpec] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name


@contextlib.contextmanager
def atomic_dir(directory: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory in a sibling temp dir and rename it into place on success,
    so readers never see half of it; refuses a non-empty target unless ``overwrite``."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise ArtifactError(
            f"{directory} exists and is not empty (pass overwrite=True)", field="out"
        )
    with atomic.atomic_dir(directory) as tmp:
        yield tmp


def save_artifact(
    model: BiLM,
    tokenizer: Tokenizer,
    directory: str | Path,
    provenance: dict[str, Any] | None = None,
    tasks: dict[str, MixSpec] | None = None,
    overwrite: bool = False,
) -> str:
    """Write an artifact atomically (temp dir + rename). Returns its version."""
    with atomic_dir(directory, overwrite) as tmp:
        state = {
            k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in model.state_dict().items()
        }
        save_file(state, str(tmp / WEIGHTS), metadata={"format": FORMAT})
        config = {
            "schema_version": SCHEMA_VERSION,
            "format": FORMAT,
            "model": model.cfg.to_dict(),
            "tokenizer": tokenizer.save(tmp),
            "provenance": provenance or {},
        }
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        hashes = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        version = version_of(hashes)
        manifest = {"version": version, "files": hashes}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name, spec in (tasks or {}).items():
            write_task(tmp, name, spec)
    return version


def write_task(directory: str | Path, name: str, spec: MixSpec) -> Path:
    path = Path(directory) / TASKS / f"{check_task_name(name)}.json"
    path.parent.mkdir(exist_ok=True)
    atomic.write_json(path, spec.to_dict(), sort_keys=True)
    return path


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ArtifactError(f"missing {path.name} in {path.parent}", field=path.name)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"corrupt {path.name}: {e}", field=path.name) from e
    if not isinstance(data, dict):
        raise ArtifactError(f"corrupt {path.name}: expected a JSON object", field=path.name)
    return data


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest (version and file hashes) without loading weights."""
    if not Path(directory).is_dir():
        raise ArtifactError(f"model directory {directory} does not exist", field="model")
    return _read_json(Path(directory) / MANIFEST)


def read_config(directory: str | Path) -> dict[str, Any]:
    return _read_json(Path(directory) / CONFIG)


@dataclass(frozen=True)
class ArtifactHeader:
    """What an artifact folder says about itself, read without its weights."""

    path: Path
    manifest: dict[str, Any]
    config: BiLMConfig
    tokenizer: dict[str, Any]  # config.json's tokenizer section
    provenance: dict[str, Any]

    @property
    def version(self) -> str | None:
        """The manifest's version (not checked against the files: load_artifact does that)."""
        return self.manifest.get("version")


def read_header(directory: str | Path) -> ArtifactHeader:
    """Manifest and model config, validated as :func:`load_artifact` does; ArtifactError."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    config = read_config(directory)
    if config.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"{CONFIG} has schema_version {config.get('schema_version')!r}, expected {SCHEMA_VERSION}",
            field="schema_version",
        )
    try:
        cfg = BiLMConfig.from_dict(config["model"])
    except KeyError as e:
        raise ArtifactError(f"{CONFIG} lacks 'model'", field="model") from e
    except ConfigError as e:
        raise ArtifactError(f"{CONFIG}: {e.message}", field=e.field) from e
    return ArtifactHeader(
        path=directory,
        manifest=manifest,
        config=cfg,
        tokenizer=config.get("tokenizer", {}),
        provenance=config.get("provenance", {}),
    )


def verify_files(directory: Path, manifest: dict[str, Any]) -> str:
    files = manifest.get("files")
    if not isinstance(files, dict) or CONFIG not in files or WEIGHTS not in files:
        raise ArtifactError(f"corrupt {MANIFEST}: no file list", field=MANIFEST)
    for name, want in files.items():
        p = directory / name
        if not p.is_file():
            raise ArtifactError(f"missing {name} in {directory}", field=name)
        if sha256_file(p) != want:
            raise ArtifactError(
                f"{name} is corrupt: its sha256 does not match {MANIFEST}", field=name
            )
    version = version_of(files)
    if manifest.get("version") != version:
        raise ArtifactError(f"corrupt {MANIFEST}: version does not match its files", field=MANIFEST)
    return version


def check_state_dict(model: BiLM, state: dict[str, torch.Tensor]) -> None:
    """Raise naming the first missing, unexpected, mis-shaped or non-finite tensor."""
    expected = model.state_dict()
    for name, ref in expected.items():
        if name not in state:
            raise ArtifactError(
                f"weights lack tensor {name!r} (shape {list(ref.shape)})", field=name
            )
        t = state[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise ArtifactError(
                f"tensor {name!r} has shape {list(t.shape)}, expected {list(ref.shape)}", field=name
            )
        if not t.is_floating_point():
            raise ArtifactError(
                f"tensor {name!r} has dtype {t.dtype}, expected a float", field=name
            )
        # a NaN or inf weight makes every vector it touches NaN: refuse it at load, by name.
        # Fast path: a sum is non-finite whenever any element is (NaN and inf propagate);
        # only a non-finite sum (or a finite tensor whose sum overflows) is checked per element.
        if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ArtifactError(
                f"tensor {name!r} holds {bad} non-finite value{'s' if bad != 1 else ''} "
                "(NaN or inf): the weights are corrupt",
                field=name,
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ArtifactError(f"weights hold unexpected tensor {extra[0]!r}", field=extra[0])


def read_task(path: Path, n_layers: int) -> MixSpec:
    """One ``tasks/NAME.json``, validated against the model's layer count."""
    try:
        return MixSpec.from_dict(_read_json(path)).validate(n_layers, path.name)
    except ConfigError as e:
        raise ArtifactError(f"task {path.name}: {e.message}", field=path.name) from e


def load_tasks(directory: Path, n_layers: int) -> dict[str, MixSpec]:
    folder = Path(directory) / TASKS
    return {p.stem: read_task(p, n_layers) for p in sorted(folder.glob("*.json"))}


def load_artifact(directory: str | Path, device: str | torch.device = "cpu") -> Artifact:
    directory = Path(directory)
    if not directory.is_dir():
        hint = ""
        if not directory.is_absolute() and (BUNDLED_MODELS_DIR.parent / directory).is_dir():
            # a README path tried from another folder: name the one that exists
            hint = f" here ({Path.cwd()}); did you mean {BUNDLED_MODELS_DIR.parent / directory}?"
        raise ArtifactError(f"model directory {directory} does not exist{hint}", field="model")
    manifest = read_manifest(directory)
    version = verify_files(directory, manifest)
    header = read_header(directory)
    cfg = header.config
    tokenizer = load_tokenizer(header.tokenizer, directory)
    try:
        state = load_file(str(directory / WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"corrupt {WEIGHTS}: {e}", field=WEIGHTS) from e
    model = BiLM(cfg)
    check_state_dict(model, state)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    model.to(device).eval()
    return Artifact(
        path=directory,
        config=cfg,
        tokenizer=tokenizer,
        model=model,
        version=version,
        provenance=header.provenance,
        tasks=load_tasks(directory, cfg.n_output_layers),
    )
