"""Is a run folder safe to train in, and with which config? The checks `elmo-pretrain train`
makes before any work (and the trainer again on every rank, read-only): a folder holding
another run, a mode change on resume, a resumed config that differs from the saved one."""

from __future__ import annotations

import json
import os
from pathlib import Path

from elmo_pretrain.checkpoint import list_checkpoints
from elmo_pretrain.config import RESUMABLE_KEYS, TrainConfig, config_hash, diff_configs, load_config
from elmo_pretrain.run_dir import LAUNCH_FILE, RUN_FILE
from elmo_service.errors import ConfigError


class RunDirError(ConfigError):
    pass


def check_run_dir(run_dir: Path, cfg: TrainConfig, resume: bool, force: bool) -> str:
    """Decide what to do with ``run_dir``: "new", "resume" or "restart". Raises if unsafe."""
    h = config_hash(cfg)
    info = run_dir / RUN_FILE

    # a launch record alone is what a start that failed early leaves behind
    if not run_dir.exists() or not any(p.name != LAUNCH_FILE for p in run_dir.iterdir()):
        return "new"
    if not info.is_file():
        if force:
            return "restart"
        raise RunDirError(
            f"run folder {run_dir} is not empty and holds no run; pass --force to use it anyway",
            field="run_dir",
        )
    old = json.loads(info.read_text())
    if force:
        return "restart"
    if old.get("config_hash") != h:
        try:
            old_cfg = TrainConfig.from_dict(old["config"])
            diff = ", ".join(
                f"{k}: {a!r} -> {b!r}"
                for k, (a, b) in diff_configs(old_cfg, cfg).items()
                if k not in RESUMABLE_KEYS
            )
        except Exception:
            diff = "unreadable old config"
        raise RunDirError(
            f"run folder {run_dir} holds a different run (config hash {old.get('config_hash')}, this config {h}; "
            f"differences: {diff}); pass --force to start over there, or pick another folder",
            field="run_dir",
        )
    if not resume:
        ck = list_checkpoints(run_dir)
        at = f" (latest checkpoint {ck[-1].name})" if ck else ""
        raise RunDirError(
            f"run folder {run_dir} already holds this run{at}; pass --resume to continue or --force to start over",
            field="run_dir",
        )
    return "resume"


def check_mode(run_dir: Path, cfg: TrainConfig) -> None:
    """Refuse to resume a sentence-mode run as a stream run, or the reverse."""
    info = run_dir / RUN_FILE
    if not info.is_file():
        return
    try:
        old = json.loads(info.read_text())["config"].get("data", {}).get("mode", "sentences")
    except (OSError, ValueError, KeyError, AttributeError):
        return
    if old != cfg.data.mode:
        raise RunDirError(
            f"run folder {run_dir} was trained with data.mode={old}; continuing it with "
            f"data.mode={cfg.data.mode} would change what its checkpoints mean (carried LSTM state, "
            "batch geometry); start a new run folder, or pass --force to start over there",
            field="data.mode",
        )


def resolve_config(
    config_path: str | None,
    overrides: list[str],
    run_dir: Path,
    resume: bool,
    log=print,
) -> TrainConfig:
    """The config to train with.

    A new run: the file plus ``--set`` overrides. ``--resume`` of a run that
    exists: the run's saved config (run.json, which holds the overrides it was
    launched with), checked against what is given now. The file is read with
    the run's launch overrides applied first (``launch.json``), so repeating
    the launch command without its ``--set`` flags resumes the same run. A
    field that still differs is taken from what is given now when it only
    changes how long or how loudly the run goes (``RESUMABLE_KEYS``, e.g.
    ``train.steps``); any other difference is a conflict, and the error names
    each field with both values. Runs without a launch record (older ones)
    keep their saved values for fields the file disagrees on, and say so.
    """
    from elmo_pretrain.config import apply_overrides
    from elmo_pretrain.launch import override_keys, read_launch

    info = run_dir / RUN_FILE
    if not (resume and info.is_file()):
        if config_path is None:
            raise ConfigError(
                "a config file is required (except with --resume of an existing run)",
                field="config",
            )
        return load_config(config_path, overrides)
    saved_raw = json.loads(info.read_text())["config"]
    saved = TrainConfig.from_dict(saved_raw)
    if config_path is None:
        return TrainConfig.from_dict(apply_overrides(saved_raw, overrides))
    launch = read_launch(run_dir)
    given = load_config(config_path, [*(launch or {}).get("overrides", []), *overrides])
    explicit = override_keys(overrides)
    accepted: list[str] = []
    conflicts: list[str] = []
    kept: list[str] = []
    for key, (was, now) in diff_configs(saved, given).items():
        if key in RESUMABLE_KEYS and (launch is not None or key in explicit):
            accepted.append(f"{key}={json.dumps(now)}")
        elif launch is not None or key in explicit:
            src = "--set" if key in explicit else config_path
            conflicts.append(f"{key}: the run has {was!r}, {src} gives {now!r}")
        else:
            kept.append(f"{key} {was!r} (the file: {now!r})")
    if conflicts:
        started = f" (launched from {launch['config']})" if launch and launch.get("config") else ""
        raise RunDirError(
            f"--resume: the config given differs from the run in {run_dir}{started}: "
            + "; ".join(conflicts)
            + "; resume with the run's own config (drop the config file or the --set), "
            "or pass --force to start over",
            field=conflicts[0].split(":", 1)[0],
        )
    if kept and int(os.environ.get("RANK", "0")) == 0:
        log(f"--resume: keeping the run's saved {', '.join(kept)}")
    return TrainConfig.from_dict(apply_overrides(saved_raw, accepted))
