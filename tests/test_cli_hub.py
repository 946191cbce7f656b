"""``-hf REPO[:QUANT]``, ``--hf-file`` and ``ggml-hybrid pull`` against a fake Hugging Face Hub on 127.0.0.1.

The fake hub answers huggingface_hub as the real one does (``HF_ENDPOINT`` points at it): the model API with
its ``siblings`` listing, ``HEAD``/``GET`` on ``/{repo}/resolve/{revision}/{file}`` with ``ETag``,
``X-Repo-Commit``, ``Content-Length`` and ranges, and 404s carrying ``X-Error-Code``. It serves the real bytes
of GGUF files written by the synthetic generator. The command runs as a user runs it, in a subprocess with
``HF_HOME`` in a temporary folder. Oracles: the bytes the server holds (sha256) and the server's request log.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggml_hybrid.cli.hub import choose, parse_repo, quant_tag, split_info
from ggml_hybrid.errors import HubError
from ggml_hybrid.synthetic import ModelSpec, write_model

REPO = "tester/tiny-moe-GGUF"
SHA = "0123456789abcdef0123456789abcdef01234567"


def _split_copy(src: Path, dst: Path, max_tensors: int) -> list[Path]:
    """The GGUF ``src`` rewritten by the gguf package as a split GGUF (``dst`` stem -00001-of-0000N.gguf ...)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents(), split_max_tensors=max_tensors)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    for t in r.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.array(t.data))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(dst.parent.glob(dst.stem + "-0*-of-*.gguf"))


class FakeHub:
    """The few endpoints huggingface_hub calls, over repositories {repo: {path: bytes}} (files in listing order)."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut_once: dict[str, int] = {}  # repo path -> bytes after which the first full GET drops the connection
        self.cut_always: dict[str, int] = {}  # the same for every GET
        # a hostile hub (issue 40): headers replaced per repository path (ETag, X-Linked-Etag, X-Repo-Commit), the
        # X-Repo-Commit of a missing file's 404, the listing's siblings as sent, a body sent a byte at a time
        self.headers_for: dict[str, dict[str, str]] = {}
        self.missing_commit: str | None = None
        self.missing: set[str] = set()  # listed, but their HEAD/GET answers 404 EntryNotFound
        self.siblings: object = None
        self.drip: dict[str, float] = {}  # repo path -> seconds between the bytes of its body
        self.stall_listing = False  # the listing's headers, then nothing
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.handle(self, head=False)

            def do_HEAD(self):
                hub.handle(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.stopping = threading.Event()

    def _error(self, h, status: int, code: str, message: str, head: bool, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def handle(self, h, head: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.log.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            files = self.repos.get(m[1])
            if files is None:
                return self._error(h, 404, "RepoNotFound", "Repository not found", head)
            siblings = [{"rfilename": f} for f in files] if self.siblings is None else self.siblings
            body = json.dumps({"id": m[1], "modelId": m[1], "sha": SHA, "private": False,
                               "siblings": siblings}).encode()
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            if self.stall_listing:
                self._hold(h)
                return
            if not head:
                h.wfile.write(body)
            return
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m or m[1] not in self.repos:
            return self._error(h, 404, "RepoNotFound", "Repository not found", head)
        if m[2] not in ("main", SHA):
            return self._error(h, 404, "RevisionNotFound", "Invalid rev id", head)
        data = self.repos[m[1]].get(m[3])
        if data is None or m[3] in self.missing:
            return self._error(h, 404, "EntryNotFound", "Entry not found", head, commit=self.missing_commit or SHA)
        start = 0
        rng = h.headers.get("Range")
        if rng:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng)[1])
        h.send_response(206 if rng else 200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Accept-Ranges", "bytes")
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": SHA}
        headers.update(self.headers_for.get(m[3], {}))
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data) - start))
        if rng:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        if m[3] in self.drip:
            self._drip(h, data[start:], self.drip[m[3]])
            return
        cut = self.cut_once.pop(m[3], None) if not rng else None
        cut = self.cut_always.get(m[3], cut)
        if cut is not None:  # the connection breaks off after `cut` bytes of the body
            h.wfile.write(data[:cut])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(data[start:])

    def _drip(self, h, data: bytes, every: float) -> None:
        """A byte at a time, ``every`` seconds apart, until the client leaves (or the hub stops)."""
        for i in range(len(data)):
            if self.stopping.wait(every):
                return
            try:
                h.wfile.write(data[i:i + 1])
                h.wfile.flush()
            except OSError:  # the client gave up
                return
        h.close_connection = True

    def _hold(self, h) -> None:
        """Nothing more on this connection until the client leaves (or the hub stops)."""
        h.close_connection = True
        self.stopping.wait(600)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("hub-models")
    q8 = Path(write_model(d / "q8.gguf", ModelSpec(weight_type="q8_0", seed=1)))
    q4 = Path(write_model(d / "q4.gguf", ModelSpec(weight_type="q4_0", seed=2)))
    f32 = Path(write_model(d / "f32.gguf", ModelSpec(seed=3)))
    parts = _split_copy(f32, d / "tiny-moe-F32.gguf", max_tensors=12)
    assert len(parts) > 1
    files = {
        "README.md": b"# tiny-moe\n",
        # a side file with the default tag, listed first: -hf must not take it for the model
        "mmproj-tiny-moe-Q4_K_M.gguf": q8.read_bytes(),
        "tiny-moe-Q8_0.gguf": q8.read_bytes(),
        "tiny-moe-Q4_K_M.gguf": q4.read_bytes(),
    }
    files.update({p.name: p.read_bytes() for p in parts})
    return files


@pytest.fixture
def hub(repo_files):
    with FakeHub({REPO: dict(repo_files)}) as h:
        yield h


def _env(hub: FakeHub | None, home: Path, offline: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not (k.startswith("HF_") or k.startswith("HUGGINGFACE_")
                                                      or k.lower().endswith("_proxy"))}
    env.update(HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost")
    env["HF_ENDPOINT"] = hub.url if hub is not None else "http://127.0.0.1:9"
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def cmd(env: dict[str, str], *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ggml_hybrid_cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def ok(env, *args) -> subprocess.CompletedProcess:
    r = cmd(env, *args)
    assert r.returncode == 0, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    return r


def user_error(env, *args, expect=()) -> str:
    r = cmd(env, *args)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    for e in expect:
        assert e in errors[0], (e, errors[0])
    return errors[0]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pulled(r: subprocess.CompletedProcess, home: Path) -> Path:
    path = Path(r.stdout.strip())
    assert path.is_file() and home in path.parents, path
    return path


# -- choosing a file -----------------------------------------------------------------------------------------


def test_choose_by_tag_as_llama_cpp(repo_files):
    files = list(repo_files)
    assert choose(REPO, files, None, None) == ["tiny-moe-Q4_K_M.gguf"]  # default tag, side file skipped
    assert choose(REPO, files, "q8_0", None) == ["tiny-moe-Q8_0.gguf"]  # the tag in any case
    assert choose(REPO, [f for f in files if "Q4_K_M" not in f], None, None) == ["tiny-moe-Q8_0.gguf"]  # then Q8_0
    parts = choose(REPO, files, "F32", None)
    assert len(parts) > 1 and parts == sorted(f for f in files if "-F32-" in f)
    assert choose(REPO, files, None, "TINY-MOE-q8_0.GGUF") == ["tiny-moe-Q8_0.gguf"]
    assert choose(REPO, ["a.gguf", "b-Q2_K.gguf"], None, None) == ["a.gguf"]  # no default tag: the first model
    with pytest.raises(HubError, match=r"Q5_K_M.*its tags: Q8_0, Q4_K_M, F32"):
        choose(REPO, files, "Q5_K_M", None)
    assert quant_tag("x/Model-IQ4_XS-00002-of-00004.gguf") == "IQ4_XS"
    assert split_info("a-Q8_0-00002-of-00004.gguf") == ("a-Q8_0", 2, 4)
    assert parse_repo("a/b:q4_k_m") == ("a/b", "q4_k_m") and parse_repo("a/b") == ("a/b", None)
    for bad in ("ab", "a/b/c", "a/b:", "a/b:Q4 K"):
        with pytest.raises(HubError):
            parse_repo(bad)


# -- downloads -----------------------------------------------------------------------------------------------


def test_pull_default_tag_and_tags(hub, repo_files, tmp_path):
    env = _env(hub, tmp_path)
    r = ok(env, "pull", REPO)
    path = _pulled(r, tmp_path)
    assert _sha(path.read_bytes()) == _sha(repo_files["tiny-moe-Q4_K_M.gguf"]) and path.name == "tiny-moe-Q4_K_M.gguf"
    path8 = _pulled(ok(env, "pull", f"{REPO}:q8_0"), tmp_path)
    assert path8.read_bytes() == repo_files["tiny-moe-Q8_0.gguf"]
    assert _pulled(ok(env, "pull", REPO, "--hf-file", "tiny-moe-q8_0.gguf"), tmp_path) == path8
    # nothing but the chosen files was fetched: the side file with the default tag never was
    fetched = {p for m, p, _ in hub.log if m == "GET" and "/resolve/" in p}
    assert fetched == {f"/{REPO}/resolve/main/tiny-moe-Q4_K_M.gguf", f"/{REPO}/resolve/main/tiny-moe-Q8_0.gguf"}


def test_hf_on_the_model_commands(hub, repo_files, tmp_path):
    env = _env(hub, tmp_path)
    local = tmp_path / "local.gguf"
    local.write_bytes(repo_files["tiny-moe-Q8_0.gguf"])
    want = json.loads(ok(env, "inspect", local, "--json").stdout)
    r = ok(env, "inspect", "-hf", f"{REPO}:Q8_0", "--json")
    assert r.stderr == ""  # --json: no progress bar and no note
    got = json.loads(r.stdout)
    assert got.pop("path").endswith("tiny-moe-Q8_0.gguf") and want.pop("path") == str(local)
    assert got == want
    a = json.loads(ok(env, "run", "--temp", "0", "-hf", f"{REPO}:Q8_0", "--tokens", "1,2,3", "-n", "3", "-t", "1",
                      "--json").stdout)
    b = json.loads(ok(env, "run", "--temp", "0", local, "--tokens", "1,2,3", "-n", "3", "-t", "1", "--json").stdout)
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 3
    p = json.loads(ok(env, "plan", "--hf-repo", f"{REPO}:Q8_0", "--json").stdout)
    assert p["model"].endswith("tiny-moe-Q8_0.gguf")
    # the model once: -hf with MODEL or -m is an error, as is --hf-file without -hf
    user_error(env, "inspect", local, "-hf", REPO, expect=["give the model once"])
    user_error(env, "inspect", "--hf-file", "x.gguf", expect=["give -hf REPO too"])
    user_error(env, "inspect", "-hf", f"{REPO}:Q8_0", "--hf-file", "tiny-moe-Q8_0.gguf", expect=["not both"])


def test_progress_bar_on_a_terminal(hub, repo_files, tmp_path):
    # huggingface_hub's own bar, on stderr when it is a terminal (here a pseudo-terminal); stdout keeps the path
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm draws nothing in 0 columns
    try:
        p = subprocess.Popen([sys.executable, "-m", "ggml_hybrid_cli", "pull", f"{REPO}:Q8_0"], env=_env(hub, tmp_path),
                             stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        out, _ = p.communicate(timeout=300)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(master)
    assert p.returncode == 0 and Path(out.strip()).read_bytes() == repo_files["tiny-moe-Q8_0.gguf"]
    size = len(repo_files["tiny-moe-Q8_0.gguf"])
    assert b"100%" in seen and b"tiny-moe-Q8_0.gguf" in seen, seen[-500:]
    assert f"{size / 1e3:.0f}k/{size / 1e3:.0f}k".encode() in seen, seen[-500:]  # tqdm's count: 329k/329k


def test_split_gguf_downloaded_whole_then_refused(hub, repo_files, tmp_path):
    env = _env(hub, tmp_path)
    err = user_error(env, "pull", f"{REPO}:F32", expect=["split in 3 parts", "llama-gguf-split --merge"])
    first = Path(re.search(r"first: (\S+?)\)", err)[1])
    assert first.name == "tiny-moe-F32-00001-of-00003.gguf"
    for name in (f"tiny-moe-F32-0000{i}-of-00003.gguf" for i in (1, 2, 3)):
        assert (first.parent / name).read_bytes() == repo_files[name]
    # the loader refuses a part given directly, with the same advice
    user_error(env, "inspect", first, expect=["part 1 of a GGUF split in 3 parts", "llama-gguf-split"])


def test_interrupted_download_resumes(hub, tmp_path):
    # huggingface_hub writes what it reads in chunks of 10 MiB and, when the connection breaks off, asks for the
    # rest from the end of the last whole chunk (a Range request): a 26 MiB file cut off at 15 MiB resumes at 10 MiB
    name = "big-moe-Q8_0.gguf"
    data = Path(write_model(tmp_path / "big.gguf", ModelSpec(weight_type="q8_0", n_embd=256, n_ff_exp=512,
                                                             n_expert=32, seed=4))).read_bytes()
    assert len(data) > 20 << 20
    hub.repos["tester/big-moe-GGUF"] = {name: data}
    hub.cut_once[name] = 15 << 20
    home = tmp_path / "home"
    path = _pulled(ok(_env(hub, home), "pull", "tester/big-moe-GGUF"), home)
    assert _sha(path.read_bytes()) == _sha(data)
    gets = [rng for m, p, rng in hub.log if m == "GET" and p.endswith(name)]
    assert gets == [None, f"bytes={10 << 20}-"], gets


def test_a_download_that_keeps_failing_is_one_error_and_leaves_nothing(hub, repo_files, tmp_path):
    name = "tiny-moe-Q8_0.gguf"
    hub.cut_always[name] = 1000
    user_error(_env(hub, tmp_path), "pull", f"{REPO}:Q8_0", expect=[f"downloading {name} failed", "run again"])
    gets = [p for m, p, _ in hub.log if m == "GET" and p.endswith(name)]
    assert len(gets) > 1  # huggingface_hub retried before giving up
    left = [p for p in (tmp_path / "hub").rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert not any(p.suffix == ".incomplete" or p.name.endswith(name) for p in left), left


def test_missing_repo_and_tag(hub, tmp_path):
    env = _env(hub, tmp_path)
    user_error(env, "pull", "tester/no-such-repo", expect=["no such model repository", hub.url])
    user_error(env, "run", "-hf", "tester/no-such-repo:Q4_K_M", "-p", "x", expect=["no such model repository"])
    user_error(env, "pull", f"{REPO}:Q5_K_M", expect=["Q5_K_M", "its tags: Q8_0, Q4_K_M, F32"])
    user_error(env, "pull", REPO, "--hf-file", "nope.gguf", expect=["no such file", "tiny-moe-Q8_0.gguf"])
    user_error(env, "pull", "not-a-repo", expect=["OWNER/NAME"])
    user_error(env, "serve", "-hf", "tester/no-such-repo", expect=["no such model repository"])
    user_error(env, "serve", "-hf", REPO, "--config", tmp_path / "none.toml", expect=["--config, not both"])
    user_error(env, "bench", "-hf", f"{REPO}:Q5_K_M", expect=["its tags"])
    assert not any("/resolve/" in p for _, p, _ in hub.log)  # nothing was downloaded


def test_offline_uses_the_cache(hub, repo_files, tmp_path):
    online = _env(hub, tmp_path)
    path = _pulled(ok(online, "pull", f"{REPO}:Q8_0"), tmp_path)
    n = len(hub.log)
    offline = _env(hub, tmp_path, offline=True)
    assert _pulled(ok(offline, "pull", f"{REPO}:Q8_0"), tmp_path) == path
    assert _pulled(ok(offline, "pull", REPO), tmp_path) == path  # no Q4_K_M in the cache: then Q8_0, as llama.cpp
    assert len(hub.log) == n, hub.log[n:]  # offline: not one request
    user_error(offline, "pull", f"{REPO}:Q4_K_M", expect=["its tags: Q8_0"])
    user_error(offline, "pull", "tester/other", expect=["offline (HF_HUB_OFFLINE=1)", "not in the hub cache"])
    assert len(hub.log) == n
    # the hub out of reach (nothing listens there), online: the cache answers too
    unreachable = _env(None, tmp_path)
    assert _pulled(ok(unreachable, "pull", f"{REPO}:Q8_0"), tmp_path) == path
    user_error(unreachable, "pull", "tester/other", expect=["cannot reach", "not in the hub cache"])


# -- a hostile hub (issue 40: E3, E13, E17) ------------------------------------------------------------------
# huggingface_hub 2.4.0 builds the path of a download from the hub's ETag (blobs/<etag>) and of a missing file's
# marker from its X-Repo-Commit (.no_exist/<commit>/<file>), unchecked: '../..' or an absolute path there wrote
# outside the cache. Whatever the hub answers, nothing may be written outside HF_HOME's hub cache.


def _outside(root: Path, home: Path) -> list[Path]:
    """Every file or folder under ``root`` that is not under the hub cache (``home/hub``) or ``home`` itself."""
    cache = home / "hub"
    return [p for p in root.rglob("*") if p != home and p != cache and home not in p.parents and p != home.parent
            or (home in p.parents and cache not in p.parents and p != cache)]


@pytest.mark.parametrize("header, value", [
    ("ETag", '"../../../../escaped"'),           # from blobs/ up to the test's folder, beside HF_HOME
    ("X-Linked-Etag", '"../../../../escaped"'),  # the header huggingface_hub prefers (large files)
    ("ETag", "ABSOLUTE"),                        # an absolute path: os.path.join keeps only it
    ("ETag", 'W/"../../../../escaped"'),         # a weak ETag
])
def test_a_hostile_etag_writes_nothing_outside_the_cache(hub, tmp_path, header, value):
    home = tmp_path / "home"
    if value == "ABSOLUTE":
        value = f'"{tmp_path / "escaped"}"'
    hub.headers_for["tiny-moe-Q8_0.gguf"] = {header: value}
    err = user_error(_env(hub, home), "pull", f"{REPO}:Q8_0", expect=[header, "ETag", "plain file name"])
    assert value.strip('"W/')[-20:] in err
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "escaped.incomplete").exists()
    assert _outside(tmp_path, home) == []
    assert not any(m == "GET" and "/resolve/" in p for m, p, _ in hub.log)  # refused before any byte was fetched


@pytest.mark.parametrize("where", ["file", "missing"])
def test_a_hostile_commit_writes_nothing_outside_the_cache(hub, tmp_path, where):
    """The commit names snapshots/<commit>/ and, for a listed file the hub then calls missing, .no_exist/<commit>/
    (which huggingface_hub touched outside the cache)."""
    home = tmp_path / "home"
    bad = "../../../../escaped"
    if where == "file":
        hub.headers_for["tiny-moe-Q8_0.gguf"] = {"X-Repo-Commit": bad}
    else:
        hub.missing.add("tiny-moe-Q8_0.gguf")
        hub.missing_commit = bad
    user_error(_env(hub, home), "pull", f"{REPO}:Q8_0", expect=["X-Repo-Commit", repr(bad), "40 hexadecimal"])
    assert not (tmp_path / "escaped").exists()
    assert _outside(tmp_path, home) == []


@pytest.mark.parametrize("siblings, fragment", [
    ([{"rfilename": None}], "siblings[0]"),
    ([{"rfilename": "tiny-moe-Q8_0.gguf"}, {}], "rfilename"),
    ([{"rfilename": "../../../../escaped-Q4_K_M.gguf"}], "'..'"),
    ([{"rfilename": "/etc/x-Q4_K_M.gguf"}], "relative"),
    ("tiny-moe-Q8_0.gguf", "listing"),
    ([["tiny-moe-Q8_0.gguf"]], "listing"),
])
def test_a_malformed_listing_is_one_error_line(hub, tmp_path, siblings, fragment):
    hub.siblings = siblings
    err = user_error(_env(hub, tmp_path / "home"), "pull", REPO, expect=[fragment])
    assert hub.url in err
    assert not any("/resolve/" in p for _, p, _ in hub.log)  # nothing was downloaded
    assert _outside(tmp_path, tmp_path / "home") == []


def _timed_env(hub: FakeHub, home: Path) -> dict[str, str]:
    env = _env(hub, home)
    env["HF_HUB_DOWNLOAD_TIMEOUT"] = "2"  # huggingface_hub's read timeout, also the window of the low-speed rule
    return env


def test_a_hub_that_drips_the_file_is_a_timeout(hub, tmp_path):
    """A byte every 0.2 s never ended (E17: each byte reset the read timeout). Now a body must bring 16 KiB in each
    HF_HUB_DOWNLOAD_TIMEOUT seconds; huggingface_hub retries from where it got to (five times), then one error."""
    hub.drip["tiny-moe-Q8_0.gguf"] = 0.2
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid_cli", "pull", f"{REPO}:Q8_0"], capture_output=True,
                       text=True, env=_timed_env(hub, tmp_path / "home"), timeout=180)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "downloading tiny-moe-Q8_0.gguf failed" in errors[0] and "16384 bytes" in errors[0], errors[0]
    gets = [p for m, p, _ in hub.log if m == "GET" and p.endswith("tiny-moe-Q8_0.gguf")]
    assert 1 < len(gets) <= 6, gets  # retried, and not for ever


def test_a_hub_that_stalls_the_listing_is_a_timeout(hub, tmp_path):
    """The listing asked for no timeout at all: a hub that sent its headers and then nothing held `pull` for good."""
    hub.stall_listing = True
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid_cli", "pull", f"{REPO}:Q8_0"], capture_output=True,
                       text=True, env=_timed_env(hub, tmp_path / "home"), timeout=180)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "timed out" in errors[0] and "not in the hub cache" in errors[0], errors[0]
