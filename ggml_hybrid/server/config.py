"""Per-model configuration files (TOML).

    [models.qwen3]
    path = "models/Qwen3-30B-A3B-Q4_K_M.gguf"
    role = "main"
    aliases = ["qwen", "gpt-4o-mini"]  # other names ``serve`` answers to
    [models.qwen3.session_options]
    disk_experts = true
    expert_cache_slots = 32
    main.moe_cpu_share = "auto"        # role-scoped: applies when the model runs as "main"

A model is picked by name or by role; a relative path is relative to the file.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..options import SessionOptions

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# a config lists models and their options: far below this; a larger file is a mistake (or /dev/zero)
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: str
    role: str | None
    options: SessionOptions
    aliases: tuple[str, ...] = ()
    chat_template: str | None = None  # Jinja source used instead of the file's (serve --chat-template)
    jinja: bool = True  # False (serve --no-jinja): the file's template is not run, and tools are refused


def read_bounded(path: str, what: str = "config file", limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; FIFOs and devices are never read."""
    try:
        # non-blocking: opening a FIFO for reading would otherwise wait for a writer forever
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            if stat.S_ISDIR(st.st_mode):
                raise ConfigError(f"{what} {path!r} is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{what} {path!r} is not a regular file (a device, FIFO or socket)")
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path!r} is a directory") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {path!r} is larger than {limit} bytes")
    return data


def _flatten(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """``{"main": {"k": v}, "k2": v}`` -> ``{"main.k": v, "k2": v}``; one key spelled twice is an error.

    TOML reads an unquoted ``main.moe_cpu_share = 0.5`` as a table ``main`` (a role scope) and a
    quoted ``"main.moe_cpu_share"`` as one key; both spellings of one key must not silently last-win.
    """
    flat: dict[str, Any] = {}

    def put(key: str, value: object) -> None:
        if key in flat:
            raise ConfigError(f"{where}: session option {key!r} is given twice (quoted and dotted spellings of "
                              "one key)")
        flat[key] = value

    for key, value in raw.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, dict):
                    raise ConfigError(f"{where}: session option {key}.{sub} is a table; options are "
                                      "KEY = VALUE or ROLE.KEY = VALUE")
                put(f"{key}.{sub}", v)
        else:
            put(key, value)
    return flat


def load_config(path: str | os.PathLike[str]) -> dict[str, ModelEntry]:
    path = os.fspath(path)
    data = read_bounded(path)
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not UTF-8 text: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} cannot be read as TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {path!r} nests tables or arrays too deeply to read") from None
    models = doc.get("models")
    if not isinstance(models, dict) or not models:
        raise ConfigError(f"{path}: needs a [models.NAME] table with at least one model")
    base = os.path.dirname(os.path.abspath(path))
    out = {}
    taken: dict[str, str] = {}  # alias -> model
    for name, m in models.items():
        where = f"{path}: [models.{name}]"
        if not isinstance(m, dict):
            raise ConfigError(f"{where} must be a table")
        unknown = set(m) - {"path", "role", "aliases", "session_options"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: path, role, aliases, "
                              "session_options")
        if not isinstance(m.get("path"), str) or not m["path"]:
            raise ConfigError(f"{where}: 'path' must be a non-empty string")
        role = m.get("role")
        if role is not None and not isinstance(role, str):
            raise ConfigError(f"{where}: 'role' must be a string")
        aliases = m.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise ConfigError(f"{where}: 'aliases' must be a list of non-empty strings")
        for a in aliases:
            if a in models or a in taken:
                other = a if a in models else taken[a]
                raise ConfigError(f"{where}: aliases: {a!r} already names model {other!r}")
            taken[a] = name
        raw = m.get("session_options", {})
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: 'session_options' must be a table")
        raw = _flatten(raw, where)
        try:
            opts = SessionOptions.from_dict(raw, role=role)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        out[name] = ModelEntry(name, os.path.join(base, m["path"]), role, opts, tuple(aliases))
    return out


def pick(models: dict[str, ModelEntry], key: str) -> ModelEntry | None:
    """The entry named ``key``, else the one with role ``key``; None if neither exists."""
    if key in models:
        return models[key]
    by_role = [m for m in models.values() if m.role == key]
    if len(by_role) > 1:
        raise ConfigError(f"role {key!r} is given to several models: {[m.name for m in by_role]}")
    return by_role[0] if by_role else None


__all__ = ["ConfigError", "ModelEntry", "load_config", "pick", "read_bounded"]
