"""``ggml-hybrid serve``: the OpenAI-compatible server (docs/serve.md).

``serve MODEL [session flags]`` serves one model; ``serve --config server.toml`` serves every model of
the file, each with its own ``session_options`` (the command line's session flags apply on top, to
every model). The server listens at once and loads the models in the background (``/health``: 503,
then 200). SIGTERM stops accepting, lets in-flight requests finish for ``--drain-timeout`` seconds,
cancels what is left and exits 0. It binds to 127.0.0.1 unless told otherwise. With ``--api-key`` (or
``--api-key-file``) every endpoint but ``/health`` needs one of the keys.

llama-server's server-wide flags: the sampling flags, ``--seed`` and ``-n`` set what a request that leaves the field
out gets; ``--chat-template`` (``chatml`` or Jinja text) and ``--chat-template-file`` replace the model's template,
``--no-jinja`` goes with ``--chat-template chatml`` (and refuses tools, as llama-server); ``--cors-origins`` lets
browser pages call the API; ``--metrics`` is accepted (``/metrics`` is always served), ``--no-slots`` turns
``/slots`` off; ``-ub`` above ``-b`` is clamped with a warning.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from ..errors import ConfigError, MissingDependencyError
from ..options import SessionOptions
from ..server.config import ModelEntry, load_config
from .flags import (
    SAMPLING_DESTS,
    clamp_ubatch,
    model_argument,
    pick_model,
    sampling_flags,
    session_flags,
    session_items,
)
from .main import main

if TYPE_CHECKING:
    from ..server.protocol import Defaults
    from ..server.settings import ServerSettings

CHATML = "chatml"  # the one built-in template name (llama.cpp's fallback too)
MAX_TEMPLATE_BYTES = 1 << 20


@main.command()
@model_argument
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; the default is loopback only).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("-a", "--alias", "aliases", multiple=True, help="Another name the model answers to (repeatable).")
@click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(0, 86400),
              callback=lambda ctx, param, v: _finite(v, "--drain-timeout"),
              help="Seconds in-flight requests get to finish after SIGTERM (0..86400).")
@click.option("--api-key", "api_keys", multiple=True, metavar="KEY",
              help="A key clients must send (Authorization: Bearer KEY) on every endpoint but /health (repeatable; "
                   "visible to other users in the process list: prefer --api-key-file).")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
              help="A file of API keys, one a line ('#' starts a comment line).")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]), help="uvicorn's log level.")
@click.option("--cors-origins", metavar="ORIGINS", help=(
    "Web pages whose scripts may call the API from a browser: comma-separated origins (http://host:port), '*' (any, "
    "llama-server's default) or 'localhost' (pages from this machine). Default: none."))
@click.option("--chat-template", "chat_template", metavar="chatml|JINJA", help=(
    "The chat template instead of the model's: 'chatml' (the one built in) or a Jinja template's text."))
@click.option("--chat-template-file", type=click.Path(dir_okay=False), help="The chat template from a Jinja file.")
@click.option("--jinja/--no-jinja", "jinja", default=True, help=(
    "--no-jinja: do not run the model's Jinja template; needs --chat-template chatml, and requests with tools are "
    "refused (as llama-server's)."))
@click.option("--metrics", is_flag=True, help="Accepted: GET /metrics is always served (llama-server needs this flag).")
@click.option("--slots/--no-slots", "slots", default=True, help="Serve GET /slots (default: on).")
@sampling_flags(defaults=False)
@session_flags
def serve(model: str | None, model_flag: str | None, hf_repo: str | None, hf_file: str | None, host: str, port: int,
          aliases: tuple[str, ...], drain_timeout: float, api_keys: tuple[str, ...], api_key_file: str | None,
          log_level: str, cors_origins: str | None, chat_template: str | None, chat_template_file: str | None,
          jinja: bool, metrics: bool, slots: bool, **flags: Any) -> None:
    """Serve MODEL (a GGUF file), or every model of --config, over OpenAI's HTTP API."""
    from ..server.settings import ServerSettings, parse_origins

    keys = _api_keys(api_keys, api_key_file)
    settings = ServerSettings(_defaults(flags), parse_origins(cors_origins), slots)
    template = _chat_template(chat_template, chat_template_file, jinja)
    batch = {k: flags.get(k) for k in ("batch_size", "ubatch_size")}
    config, items = session_items(flags)
    if config is not None:
        if model is not None or model_flag is not None or hf_repo is not None:
            raise click.UsageError("give MODEL (or -m, -hf) or --config, not both (--config serves every model of "
                                   "the file)")
        if aliases:
            raise click.UsageError("--alias names the model of MODEL; with --config, give 'aliases' in the file")
        if template is not None or not jinja:
            raise click.UsageError("--chat-template, --chat-template-file and --no-jinja apply to the model of MODEL, "
                                   "not to every model of --config")
        entries = []
        for e in load_config(config).values():
            try:
                opts = SessionOptions.parse(items, role=e.role, base=e.options)
            except ValueError as exc:
                raise ConfigError(f"{config}: [models.{e.name}]: {exc}") from None
            entries.append(ModelEntry(e.name, e.path, e.role, clamp_ubatch(opts, batch), e.aliases))
    elif model is None and model_flag is None and hf_repo is None:
        raise click.UsageError("give MODEL (a GGUF file), -hf REPO[:QUANT] or --config FILE")
    else:
        opts = clamp_ubatch(SessionOptions.parse(items), batch)
        model = pick_model(model, model_flag, hf_repo, hf_file)
        name = os.path.splitext(os.path.basename(model))[0]
        entries = [ModelEntry(name, model, None, opts, tuple(a for a in aliases if a != name), template, jinja)]
    for e in entries:
        _precheck(e)
    _run_server(entries, host, port, drain_timeout, log_level, keys, settings)


def _defaults(flags: dict[str, Any]) -> Defaults:
    """The request defaults the sampling flags, ``--ignore-eos``, ``--seed`` and ``-n`` set (popped from
    ``flags``)."""
    from ..errors import GgmlHybridError
    from ..runtime.sampling import Sampler
    from ..server.protocol import DEFAULTS, Defaults

    given = {dest: flags.pop(dest) for dest in SAMPLING_DESTS}
    sampling: dict[str, Any] = dict(DEFAULTS)
    sampling.update({("temperature" if k == "temp" else k): v for k, v in given.items() if v is not None})
    try:
        Sampler(**sampling)
    except GgmlHybridError as exc:
        raise click.UsageError(f"the sampling flags: {exc}") from None
    seed, n, ignore_eos = flags.pop("seed"), flags.pop("n_predict"), flags.pop("ignore_eos")
    if n == 0:
        raise click.UsageError("-n 0 (generate nothing) is not a default a server can use: give -1 (until the end) or "
                               "a number >= 1")
    return Defaults(sampling, None if seed is None or seed < 0 else seed, n, bool(ignore_eos))


def _chat_template(name: str | None, path: str | None, jinja: bool) -> str | None:
    """The template ``--chat-template``/``--chat-template-file`` give (None: the model's), as Jinja source."""
    from ..server.config import read_bounded
    from ..text.chat import DEFAULT_TEMPLATE

    if name is not None and path is not None:
        raise click.UsageError("give --chat-template or --chat-template-file, not both")
    source: str | None = None
    if path is not None:
        try:
            source = read_bounded(path, "chat template file", MAX_TEMPLATE_BYTES).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"chat template file {path!r} is not UTF-8 text") from None
    elif name is not None:
        if name.strip().lower() == CHATML:
            source = DEFAULT_TEMPLATE
        elif "{{" in name or "{%" in name:
            source = name
        else:
            raise click.UsageError(f"--chat-template {name!r}: give 'chatml' (the one template built in here; "
                                   "llama.cpp's other built-in names are not) or a Jinja template's text "
                                   "(--chat-template-file FILE reads one from a file)")
    if not jinja and source != DEFAULT_TEMPLATE:
        raise click.UsageError("--no-jinja needs --chat-template chatml: llama.cpp then formats chats with a built-in "
                               "C++ template it recognises in the model's; ggml-hybrid has only ChatML built in (leave "
                               "--no-jinja out to use the model's template, rendered in a sandbox)")
    return source


def _api_keys(given: tuple[str, ...], path: str | None) -> list[str]:
    from ..server.auth import check_keys, read_key_file

    keys = check_keys(given, "--api-key")
    if path is not None:
        keys += read_key_file(path)
    return keys


def _precheck(e: ModelEntry) -> None:
    """What can be known without loading: the file is a GGUF model we run, the options suit it, a chat template
    given on the command line compiles."""
    from ..errors import ChatTemplateError, GgmlHybridError
    from ..gguf.store import GGUFStore
    from ..model.families import read_hparams
    from ..model.mtp import check_head
    from ..runtime.moe_model import check_options
    from ..text.chat import ChatTemplate

    if e.chat_template is not None:
        try:
            ChatTemplate(e.chat_template)
        except ChatTemplateError as exc:
            raise ConfigError(f"--chat-template: {' '.join(str(exc).split())}") from None

    if e.options.spec_type == "replay":
        raise ConfigError(f"model {e.name!r}: spec_type=replay: replayed drafts are for benchmarks and tests (their "
                          "output is staged); serve drafts with the model's own head (--spec-type draft-mtp)")
    try:
        store = GGUFStore(e.path)
        try:
            hp = read_hparams(store)
            check_options(e.options, hp)
            if e.options.spec_type == "draft-mtp":
                check_head(store, hp)
        finally:
            store.close()
    except (GgmlHybridError, OSError) as exc:
        raise ConfigError(f"model {e.name!r} ({e.path}): {' '.join(str(exc).split())}") from None


def _run_server(entries: list[ModelEntry], host: str, port: int, drain_timeout: float, log_level: str,
                api_keys: list[str], settings: ServerSettings | None = None) -> None:
    try:
        import uvicorn

        from ..server.app import create_app
        from ..server.models import ModelSet
    except ImportError as exc:
        raise MissingDependencyError(f"serve needs the server extra ({exc.name} is missing): pip install -e "
                                     "'.[server]' in the ggml-hybrid checkout (it is not on PyPI)") from None
    import contextlib

    from ..server import guard, logs

    if not _loopback(host) and not api_keys:
        click.echo(f"ggml-hybrid serve: warning: listening on {host}, reachable from other machines, with no "
                   "authentication: anyone who can reach this port can use the models (give --api-key or "
                   "--api-key-file)",
                   err=True)
    sockets = _listen(host, port)  # before the banner and the load: a busy port is one error line
    models = ModelSet(entries)
    signals: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # SIGTERM/SIGINT: stop taking work but keep listening (/health answers 503 "draining") until every
            # generation has answered or --drain-timeout has passed; a second signal ends the drain at once
            # (what runs is cancelled and answers with its error): on_tick then lets uvicorn shut down
            self._captured_signals.append(sig)
            if models.draining:
                models.expire_drain()
            else:
                models.drain()

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            return models.drained(drain_timeout)

    server: Server

    def failed(message: str) -> None:
        server.should_exit = True

    def loaded(name: str, seconds: float) -> None:
        click.echo(f"ggml-hybrid serve: {name} ready ({seconds:.1f} s)", err=True)

    @contextlib.asynccontextmanager
    async def lifespan(app: object) -> AsyncIterator[None]:
        # and a line when a model's RPC worker is lost, or the model reloaded
        models.start_loading(failed, loaded, lambda line: click.echo(f"ggml-hybrid serve: {line}", err=True))
        names = ", ".join(models.models)
        click.echo(f"ggml-hybrid serve: http://{host}:{port} ({names}; loading)", err=True)
        try:
            yield
        finally:
            models.close()

    app = create_app(models, drain_timeout, lifespan=lifespan, api_keys=api_keys, settings=settings)
    logs.install()
    max_connections = guard.connection_limit(guard.raise_fd_limit())
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                   http=guard.protocol_class(max_connections), timeout_keep_alive=5,
                                   h11_max_incomplete_event_size=64 << 10, timeout_graceful_shutdown=5))
    # uvicorn re-raises the signal that stopped it once it is done; these take it instead, so a drained
    # SIGTERM exits 0 and a Ctrl-C exits 130
    old = {s: signal.signal(s, lambda sig, frame: signals.append(sig)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
        for s, h in old.items():
            signal.signal(s, h)
        if not models.close():
            # the loader is still inside one tensor's load: ending the interpreter normally would free the
            # buffers it writes into (a crash); end without finalizers instead
            sys.stderr.flush()
            os._exit(130 if signal.SIGINT in signals else 0)
    if models.failed:
        raise ConfigError(f"model {models.failed}")
    if signal.SIGINT in signals:
        sys.exit(130)


def _listen(host: str, port: int) -> list[socket.socket]:
    """Bound sockets for every address of ``host`` (as uvicorn would bind them), or one error naming the flag."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise click.BadParameter(f"{host!r} is not an address of this machine ({exc.strerror})",
                                 param_hint="--host") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys((i[0], i[1], i[2], "", i[4]) for i in infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server does
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise click.BadParameter(f"{port} is in use on {host} (another server listens there; give a free "
                                     "port)", param_hint="--port") from None
        raise click.BadParameter(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                                 param_hint="--host") from None
    return sockets


def _finite(v: float, flag: str) -> float:
    import math

    if not math.isfinite(v):  # click's FloatRange lets NaN through (every comparison with it is false)
        raise click.BadParameter(f"{v!r} is not a finite number of seconds", param_hint=flag)
    return v


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


__all__ = ["serve"]
