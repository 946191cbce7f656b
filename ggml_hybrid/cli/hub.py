"""``-hf REPO[:QUANT]`` / ``--hf-file FILE`` and ``ggml-hybrid pull``: a GGUF model from the Hugging Face Hub.

Downloads go through ``huggingface_hub``: its cache (``HF_HOME``, ``HF_HUB_CACHE``), its token (``HF_TOKEN``),
its endpoint (``HF_ENDPOINT``), its offline mode (``HF_HUB_OFFLINE=1``), its progress bars, and its retries,
which resume a transfer that breaks off with an HTTP range request.

The file is chosen as llama.cpp's ``-hf`` chooses it (``common/download.cpp``, ``find_best_model``): among the
repository's ``.gguf`` files that are models (not ``mmproj``, ``imatrix``, ``mtp-`` ... side files), the first,
in the repository's order, whose path holds the quant tag followed by ``.`` or ``-``, compared without regard
to case; without a tag, ``Q4_K_M``, then ``Q8_0``, then the first model file. A split GGUF
(``NAME-00001-of-00003.gguf``) is chosen by its first part and downloaded whole, every part; the first part is
what a loader opens. ggml-hybrid loads single-file GGUFs only, so a split model is refused after the download,
naming where its parts are and how to merge them.

What the hub answers is checked before huggingface_hub acts on it (:mod:`.hub_http`: headers that would name paths
outside the cache, reads that stall or drip), and so is the listing (every file a relative path without ``..``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import HubError

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
_SIDE_FILES = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>[0-9]{5})-of-(?P<count>[0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def parse_repo(spec: str) -> tuple[str, str | None]:
    """``owner/name[:QUANT]`` -> (repository, tag or None)."""
    repo, sep, tag = spec.partition(":")
    if not _REPO.match(repo):
        raise HubError(f"-hf {spec!r}: a repository is OWNER/NAME[:QUANT] (e.g. Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M)")
    if sep and not re.fullmatch(r"[A-Za-z0-9_]+", tag):
        raise HubError(f"-hf {spec!r}: the quant tag after ':' must be letters, digits and '_' (e.g. Q4_K_M), "
                       f"not {tag!r}")
    return repo, (tag or None)


def split_info(path: str) -> tuple[str, int, int]:
    """(the name without ``.gguf`` and the split suffix, part index, part count); 1 of 1 for a single file."""
    stem = path[:-5] if path.lower().endswith(".gguf") else path
    m = _SPLIT.match(stem)
    if m is None:
        return stem, 1, 1
    return m["prefix"], int(m["index"]), int(m["count"])


def quant_tag(path: str) -> str | None:
    """The quant tag a file name ends with (``...-Q4_K_M.gguf`` -> ``Q4_K_M``), upper case; None if none."""
    m = _TAG.search(split_info(path)[0].rsplit("/", 1)[-1])
    return m[1].upper() if m else None


def is_model_gguf(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(s in name for s in _SIDE_FILES)


def _first_parts(files: Sequence[str]) -> list[str]:
    return [f for f in files if is_model_gguf(f) and split_info(f)[1] == 1]


def available_tags(files: Sequence[str]) -> list[str]:
    tags: list[str] = []
    for f in _first_parts(files):
        t = quant_tag(f)
        if t is not None and t not in tags:
            tags.append(t)
    return tags


def choose(repo: str, files: Sequence[str], tag: str | None, hf_file: str | None) -> list[str]:
    """The files to download, the one to load first (every part of a split model, in order)."""
    if hf_file is not None:
        found = [f for f in files if f.lower() == hf_file.lower()]
        if not found:
            ggufs = [f for f in files if f.lower().endswith(".gguf")]
            raise HubError(f"--hf-file {hf_file!r}: no such file in {repo}; its GGUF files: "
                           f"{', '.join(ggufs) if ggufs else '(none)'}")
        primary = found[0]
    else:
        models = _first_parts(files)
        if not models:
            raise HubError(f"-hf {repo}: the repository holds no GGUF model file ({len(files)} files, none a "
                           "*.gguf model)")
        primary = ""
        for t in ([tag] if tag else DEFAULT_TAGS):
            pattern = re.compile(re.escape(t) + "[.-]", re.IGNORECASE)
            primary = next((f for f in models if pattern.search(f)), "")
            if primary:
                break
        if not primary:
            if tag:
                tags = available_tags(files)
                raise HubError(f"-hf {repo}:{tag}: no GGUF file of quant tag {tag!r} in {repo}; its tags: "
                               f"{', '.join(tags) if tags else '(none; give --hf-file)'}")
            primary = models[0]
    prefix, _, count = split_info(primary)
    if count == 1:
        return [primary]
    parts = sorted((f for f in files if split_info(f)[0] == prefix and split_info(f)[2] == count),
                   key=lambda f: split_info(f)[1])
    if [split_info(f)[1] for f in parts] != list(range(1, count + 1)):
        raise HubError(f"-hf {repo}: {primary} is part of a GGUF split in {count} parts, but the repository holds "
                       f"{len(parts)} of them")
    return parts


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def list_files(repo: str) -> tuple[list[str], bool]:
    """(the repository's files, whether they come from the local cache instead of the hub)."""
    import httpx2
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    from .hub_http import guarded

    unreachable = None
    if not constants.HF_HUB_OFFLINE:
        try:
            with guarded():
                info = HfApi().model_info(repo)
        except GatedRepoError:
            raise HubError(f"-hf {repo}: the repository is gated; accept its terms on {_endpoint()}/{repo} and set "
                           "HF_TOKEN (or run `hf auth login`)") from None
        except RepositoryNotFoundError:
            raise HubError(f"-hf {repo}: no such model repository on {_endpoint()} (a private one needs HF_TOKEN)"
                           ) from None
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else "?"
            raise HubError(f"-hf {repo}: {_endpoint()} answered HTTP {status} when asked for the repository's "
                           "files") from None
        except HubError as exc:  # an answer that would have named a path outside the cache (hub_http.py)
            raise HubError(f"-hf {repo}: {exc}") from None
        except httpx2.HTTPError as exc:  # the connection (refused, reset, timed out): fall back to the cache
            unreachable = " ".join(str(exc).split()) or type(exc).__name__
        except Exception as exc:  # an answer huggingface_hub could not read as a repository's
            raise HubError(f"-hf {repo}: {_endpoint()} answered a listing of the repository's files that cannot be "
                           f"read ({type(exc).__name__}: {' '.join(str(exc).split())})") from None
        else:
            return _listed(repo, info.siblings), False
    cached = cached_files(repo)
    if not cached:
        where = f"the hub cache ({constants.HF_HUB_CACHE})"
        if unreachable is None:
            raise HubError(f"-hf {repo}: offline (HF_HUB_OFFLINE=1) and the repository is not in {where}; "
                           "download it once online (ggml-hybrid pull)")
        raise HubError(f"-hf {repo}: cannot reach {_endpoint()} ({unreachable}) and the repository is not in {where}")
    return cached, True


def _listed(repo: str, siblings: object) -> list[str]:
    """The file names of a listing, each a relative path inside the repository; HubError naming the first that is
    not (a hostile or broken hub: a null name, a name with '..' or an absolute one)."""
    where = f"-hf {repo}: {_endpoint()} answered a listing of the repository's files"
    if siblings is None:
        return []
    if not isinstance(siblings, list):
        raise HubError(f"{where} whose siblings are not a list ({type(siblings).__name__})")
    names = []
    for i, s in enumerate(siblings):
        name = getattr(s, "rfilename", None)
        if not isinstance(name, str) or not name:
            raise HubError(f"{where} whose siblings[{i}] has no file name (rfilename: {name!r})")
        parts = name.split("/")
        if name.startswith("/") or "\\" in name or "\0" in name:
            raise HubError(f"{where} holding {name!r} (siblings[{i}]): a file's path must be relative, with '/' "
                           "between its parts")
        if any(p in ("", ".", "..") for p in parts):
            raise HubError(f"{where} holding {name!r} (siblings[{i}]): a file's path may have no empty, '.' or '..' "
                           "part")
        names.append(name)
    return names


def cached_files(repo: str) -> list[str]:
    """The files of ``repo``'s cached ``main`` snapshot, as repository paths; [] if none is cached."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    for r in cache.repos:
        if r.repo_type == "model" and r.repo_id == repo:
            for rev in r.revisions:
                if "main" in rev.refs:
                    return sorted(f.file_path.relative_to(rev.snapshot_path).as_posix() for f in rev.files)
    return []


def fetch(spec: str, hf_file: str | None = None, *, progress: bool = True,
          note: Callable[[str], Any] | None = None) -> str:
    """Download the GGUF that ``-hf spec [--hf-file hf_file]`` names (every part) and return the path to load."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled
    from huggingface_hub.utils import disable_progress_bars

    from .hub_http import guarded

    repo, tag = parse_repo(spec)
    if tag is not None and hf_file is not None:
        raise HubError(f"-hf {spec} and --hf-file {hf_file}: give the quant tag or the file, not both")
    files, from_cache = list_files(repo)
    parts = choose(repo, files, tag, hf_file)
    if not progress or not sys.stderr.isatty():
        disable_progress_bars()
    paths = []
    for name in parts:
        try:
            with guarded():
                paths.append(hf_hub_download(repo, name))
        except HubError as exc:  # an answer that would have named a path outside the cache (hub_http.py)
            raise HubError(f"-hf {repo}: downloading {name}: {exc}") from None
        except (LocalEntryNotFoundError, OfflineModeIsEnabled):
            raise HubError(f"-hf {repo}: {name} is not in the hub cache and the hub cannot be reached "
                           f"({'offline, HF_HUB_OFFLINE=1' if from_cache else _endpoint()})") from None
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else "?"
            raise HubError(f"-hf {repo}: downloading {name}: {_endpoint()} answered HTTP {status}") from None
        except Exception as exc:  # a connection that failed for good (huggingface_hub retried): httpx's errors
            why = " ".join(str(exc).split()) or type(exc).__name__
            raise HubError(f"-hf {repo}: downloading {name} failed ({why}); run again to retry") from None
    if note is not None:
        size = sum(os.path.getsize(p) for p in paths)
        from ..units import format_bytes

        more = f" ({len(parts)} parts)" if len(parts) > 1 else ""
        note(f"{repo}: {parts[0]}{more}, {format_bytes(size)}{' (cached)' if from_cache else ''}: {paths[0]}")
    if len(parts) > 1:
        raise HubError(f"-hf {repo}: {parts[0]} is a GGUF split in {len(parts)} parts, all downloaded (first: "
                       f"{paths[0]}); ggml-hybrid loads single-file GGUFs only: merge them with llama.cpp's "
                       "`llama-gguf-split --merge FIRST-PART OUT.gguf` and give OUT.gguf")
    return paths[0]


__all__ = ["available_tags", "choose", "fetch", "parse_repo", "quant_tag", "split_info"]
