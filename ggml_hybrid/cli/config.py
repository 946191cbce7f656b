"""Per-model configuration files (TOML).

    [models.qwen3]
    path = "models/Qwen3-30B-A3B-Q4_K_M.gguf"
    role = "main"
    [models.qwen3.session_options]
    disk_experts = true
    expert_cache_slots = 32
    main.moe_cpu_share = "auto"        # role-scoped: applies when the model runs as "main"

A model is picked by name or by role; a relative path is relative to the file.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ..errors import ConfigError
from ..options import SessionOptions

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib



@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: str
    role: str | None
    options: SessionOptions


def load_config(path) -> dict[str, ModelEntry]:
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path!r} cannot be read as TOML: {exc}") from None
    models = doc.get("models")
    if not isinstance(models, dict) or not models:
        raise ConfigError(f"{path}: needs a [models.NAME] table with at least one model")
    base = os.path.dirname(os.path.abspath(path))
    out = {}
    for name, m in models.items():
        where = f"{path}: [models.{name}]"
        if not isinstance(m, dict):
            raise ConfigError(f"{where} must be a table")
        unknown = set(m) - {"path", "role", "session_options"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: path, role, session_options")
        if not isinstance(m.get("path"), str) or not m["path"]:
            raise ConfigError(f"{where}: 'path' must be a non-empty string")
        role = m.get("role")
        if role is not None and not isinstance(role, str):
            raise ConfigError(f"{where}: 'role' must be a string")
        raw = m.get("session_options", {})
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: 'session_options' must be a table")
        # TOML reads an unquoted `main.moe_cpu_share = 0.5` as a table `main`: a role scope
        flat = {}
        for key, value in raw.items():
            if isinstance(value, dict):
                flat.update({f"{key}.{sub}": v for sub, v in value.items()})
            else:
                flat[key] = value
        raw = flat
        try:
            opts = SessionOptions.from_dict(raw, role=role)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        out[name] = ModelEntry(name, os.path.join(base, m["path"]), role, opts)
    return out


def pick(models: dict[str, ModelEntry], key: str) -> ModelEntry | None:
    """The entry named ``key``, else the one with role ``key``; None if neither exists."""
    if key in models:
        return models[key]
    by_role = [m for m in models.values() if m.role == key]
    if len(by_role) > 1:
        raise ConfigError(f"role {key!r} is given to several models: {[m.name for m in by_role]}")
    return by_role[0] if by_role else None


__all__ = ["ConfigError", "ModelEntry", "load_config", "pick"]
