"""``kivi-xpu serve``: transformers' own OpenAI-compatible server (``transformers serve``) with the KIVI cache.

Usage: ``kivi-xpu serve [KIVI options] [transformers serve options] [FORCE_MODEL]``. Everything but the KIVI cache
options is ``transformers serve``'s own command line (its ``Serve`` command, parsed by its own typer/click
definition, so every option and default is the installed transformers'), and requests mean what they mean there: a
request's ``model`` names a hub id or a local model directory, loaded on first use (unless FORCE_MODEL pins one).

The KIVI options (``--bits``, ``--group-size``, ``--residual-length``, ``--meta-dtype``, ``--backend``,
``--sycl-device``, ``--kivi-option NAME=VALUE`` for any other ``KiviCache`` argument) are the other tools' (from
:func:`kivi_xpu.tools.cli.add_kivi_arguments`); one not given keeps ``KiviCache``'s default. They become the
``cache_config`` of ``generate(cache_implementation="kivi")`` (:mod:`kivi_xpu.integration`).

Devices: ``--device`` and ``--dtype`` are transformers serve's own (default ``auto`` for both): its
``ModelManager._load_model`` passes them to ``from_pretrained`` as ``device_map`` and ``dtype``, and the KIVI model
manager below loads every model through it, so the model runs where ``--device`` says, as in the other tools.
``--sycl-device`` is only the SYCL device filter of the KIVI kernels (``KiviCache``'s ``device``).

How the cache gets in: for the lifetime of the server, transformers' ``ModelManager`` class (looked up by ``Serve``
when it starts) is replaced by a subclass (:func:`kivi_model_manager`) whose ``_load_model`` sets, on every model it
loads, ``generation_config.cache_implementation = "kivi"`` and ``generation_config.cache_config``. The server
deep-copies the model's generation config for each request (``BaseHandler._build_generation_config``), so every
request generates with a fresh ``KiviCache``, and a model unloaded after ``--model-timeout`` and loaded again goes
through the same ``_load_model``. A request that sends its own ``generation_config`` JSON replaces the model's, as in
``transformers serve``: it gets the KIVI cache only if it names it.

Attention: without ``--attn-implementation`` the models are loaded with ``attn_implementation="kivi"`` (the fused
attention reading the packed history in place, kivi-xpu's fast path; prefill runs SDPA); ``--attn-implementation
sdpa`` (or ``eager``, ...) gives the dense path (the history dequantized for the attention). Under
``--continuous-batching`` the pages are always read by their own attention (``kivi_paged``), so an
``--attn-implementation`` given there is ignored, with a warning (:data:`IGNORED_ATTENTION_WARNING`).

Without ``--continuous-batching`` generation is sequential (one ``generate`` at a time per model, requests queued),
as in ``transformers serve``. With it, transformers' continuous batching runs on KIVI pages (:mod:`kivi_xpu.paged`):
each loaded model's ``init_continuous_batching`` is replaced (:func:`kivi_xpu.paged.install`) so that the server's
batching manager stores 2-bit pages within ``--kv-memory`` MiB (``--max-requests`` at most); requests
beyond it wait in transformers' queue. ``--compile`` is refused (:data:`COMPILE_ERROR`): there it only selects a
``StaticCache`` for requests.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from ..attention import ATTENTION_NAME
from ..cache import KiviCache
from ..conversations import Conversations, remember_conversations
from ..integration import CACHE_IMPLEMENTATION, build_cache, cache_kwargs
from ..overrides import settings_json
from .cli import KIVI_FLAGS, add_kivi_arguments, nonnegative_int, positive_int
from .options import ToolError

logger = logging.getLogger("kivi_xpu")

EXTRA_INSTALL = 'pip install "transformers[serving]"  (in a clone: pip install -e ".[serve]")'

DEFAULT_KV_MEMORY_MIB = 1024  # --kv-memory of --continuous-batching
DEFAULT_REUSE_MEMORY_MIB = 256  # --reuse-memory of the sequential server

IGNORED_ATTENTION_WARNING = (
    "--attn-implementation %s is ignored with --continuous-batching: the KIVI pages are always read by their own "
    "attention (kivi_paged: the fused 2-bit decode, exact prompt chunks through SDPA)"
)

COMPILE_ERROR = (
    "--compile is not supported by kivi-xpu serve: in transformers serve it only switches requests to a StaticCache "
    "(which generate then compiles), and every request here uses the KIVI cache; leave out --compile."
)

# KiviCache arguments that have their own flag here: what --kivi-option says instead.
SERVE_OWN_FLAGS = KIVI_FLAGS | {
    "attention": "use --attn-implementation (kivi: fused, the default; sdpa or eager: dense)",
    "config": "the server passes each model's config",
}

# The KIVI options' argparse destinations -> the KiviCache arguments they set (--sycl-device is KiviCache's `device`;
# transformers' --device, the model's, is not a KIVI option).
_CACHE_ARGUMENTS = {
    "bits": "bits",
    "group_size": "group_size",
    "residual_length": "residual_length",
    "meta_dtype": "meta_dtype",
    "backend": "backend",
    "sycl_device": "device",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The KIVI cache options of ``kivi-xpu serve`` (transformers' own options are parsed by transformers)."""
    p.add_argument(
        "--bits",
        type=positive_int,
        default=argparse.SUPPRESS,
        help="KIVI bit width of keys and values: 2, 4 or 8 (default: KiviCache's, 2)",
    )
    add_kivi_arguments(p, own_flags=SERVE_OWN_FLAGS, defaults=False)
    p.add_argument(
        "--kv-memory",
        type=positive_int,
        default=DEFAULT_KV_MEMORY_MIB,
        metavar="MIB",
        help="with --continuous-batching: MiB of KV storage (2-bit pages and exact windows) per loaded model; "
        f"requests beyond it wait (default: {DEFAULT_KV_MEMORY_MIB})",
    )
    p.add_argument(
        "--reuse-memory",
        type=nonnegative_int,
        default=DEFAULT_REUSE_MEMORY_MIB,
        metavar="MIB",
        help="without --continuous-batching: MiB of recent conversations' caches kept, so that a request continuing "
        "one prefills only its new tokens (0: none; default: %(default)s)",
    )
    p.add_argument(
        "--no-prefix-reuse",
        dest="prefix_reuse",
        action="store_false",
        help="with --continuous-batching: keep no prompt's exact states for later requests (default: a request whose "
        "prompt begins with a cached prompt's units, a continued chat or a shared document, starts after them)",
    )
    p.add_argument(
        "--max-requests",
        type=positive_int,
        default=None,
        help="with --continuous-batching: the most requests in flight (default: as many as --kv-memory holds)",
    )


def paged_options(options: argparse.Namespace, config: dict) -> dict:
    """``kivi_xpu.paged.install`` keyword arguments of the parsed options: the budget and the KIVI settings of
    ``config`` (the cache options that are not settings are for the sequential path)."""
    kwargs = cache_kwargs(config)
    kwargs.pop("device", None)
    kwargs.pop("attention", None)
    return dict(kwargs, kv_memory=options.kv_memory * 2**20, max_requests=options.max_requests,
                prefix_reuse=options.prefix_reuse)  # fmt: skip


def cache_config(options: argparse.Namespace) -> dict:
    """The ``cache_config`` (JSON-serialisable: dtypes by name) of the parsed KIVI options, checked by building a
    ``KiviCache`` from it; :class:`ToolError` naming the bad option otherwise."""
    config = {name: getattr(options, dest) for dest, name in _CACHE_ARGUMENTS.items() if hasattr(options, dest)}
    config.update(options.kivi_options)
    config = settings_json(config)
    try:
        KiviCache(**cache_kwargs(config))
    except (ValueError, TypeError, RuntimeError) as err:
        raise ToolError(f"KIVI cache options {config}: {err}") from None
    return config


def use_kivi_cache(model, config: dict) -> None:
    """Makes every later ``model.generate`` without its own cache settings use ``KiviCache(**config)``: sets
    ``model.generation_config.cache_implementation`` and ``cache_config`` (a copy). ``ValueError`` for a model the
    KIVI cache cannot serve (encoder-decoder, a model-specific cache), raised when the model is loaded."""
    build_cache(model, config)  # the model's own checks, before the first request
    model.generation_config.cache_implementation = CACHE_IMPLEMENTATION
    model.generation_config.cache_config = dict(config)


def kivi_model_manager(base: type, config: dict, paged: dict | None = None, reuse_bytes: int = 0) -> type:
    """A subclass of transformers' serving ``ModelManager`` (``base``) whose every loaded model generates with the
    KIVI cache (:func:`use_kivi_cache`), and which accepts ``attn_implementation="kivi"``; with ``paged``
    (:func:`paged_options`), its continuous batching runs on KIVI pages; without, its sequential ``generate``
    continues the recent conversations within ``reuse_bytes`` (:mod:`kivi_xpu.conversations`; 0: never)."""

    class KiviModelManager(base):
        """transformers' ModelManager; each model it loads (again after an idle unload too) gets the KIVI cache."""

        def _validate_args(self):
            if self.attn_implementation != ATTENTION_NAME:
                return super()._validate_args()
            # transformers' check knows only its own attention names and hub kernels; "kivi" is registered with
            # transformers' AttentionInterface by `import kivi_xpu`, which from_pretrained consults.
            self.attn_implementation = None
            try:
                return super()._validate_args()
            finally:
                self.attn_implementation = ATTENTION_NAME

        def _load_model(self, *args, **kwargs):
            model = super()._load_model(*args, **kwargs)
            use_kivi_cache(model, config)
            if paged is not None:
                from ..paged import install

                budget = install(model, **paged)
                print(budget.summary(model.generation_config.max_new_tokens or 0), file=sys.stderr)
            elif reuse_bytes:
                remember_conversations(model, Conversations(reuse_bytes))
            return model

    return KiviModelManager


@contextlib.contextmanager
def _kivi_model_manager_installed(config: dict, paged: dict | None, reuse_bytes: int = 0):
    """transformers' serving ``ModelManager`` replaced by :func:`kivi_model_manager`'s, and its ``build_server`` by
    :func:`_with_request_errors`, while the server runs."""
    from transformers.cli.serving import model_manager, server

    original, build_server = model_manager.ModelManager, server.build_server
    model_manager.ModelManager = kivi_model_manager(original, config, paged, reuse_bytes)
    server.build_server = _with_request_errors(build_server)
    try:
        yield
    finally:
        model_manager.ModelManager, server.build_server = original, build_server


def _with_request_errors(build_server):
    """transformers' ``build_server``, whose app answers a request the KIVI pages cannot serve (longer than the
    ``--kv-memory`` budget serves even alone: :class:`~kivi_xpu.paged.budget.RequestTooLong`) with HTTP 400 and the
    message naming the longest prompt served, as vLLM answers a prompt over ``max_model_len``, instead of a 500; and
    whose completions report the prompt tokens found cached (:mod:`.cached_usage`)."""
    from fastapi.responses import JSONResponse

    from ..paged.budget import RequestTooLong
    from .cached_usage import report_cached_tokens

    def build(*args, **kwargs):
        app = build_server(*args, **kwargs)
        report_cached_tokens(app)

        @app.exception_handler(RequestTooLong)
        async def request_too_long(_request, error: RequestTooLong):
            body = {"message": str(error), "type": "invalid_request_error", "code": "context_length_exceeded"}
            return JSONResponse({"error": body}, status_code=400)

        return app

    return build


def _check_serving_dependencies() -> None:
    from transformers.utils import import_utils

    if not import_utils.is_serve_available():
        raise ToolError(
            "kivi-xpu serve needs transformers' serving dependencies (fastapi, uvicorn, pydantic, openai), which are "
            f"not installed: {EXTRA_INSTALL}"
        )


def _transformers_serve_command(config: dict, paged: dict, reuse_bytes: int = 0):
    """transformers' ``serve`` click command, its callback wrapped: --compile refused, the attention defaulting to
    "kivi", and the KIVI model manager (with ``paged``, the :func:`paged_options`, under --continuous-batching)
    installed around ``Serve`` (which runs the server)."""
    import typer
    from transformers.cli.serve import Serve

    app = typer.Typer(add_completion=False)
    app.command(name="serve")(Serve)
    command = typer.main.get_command(app)
    serve = command.callback

    def callback(**params):
        if params.get("compile"):
            raise ToolError(COMPILE_ERROR)
        batching = bool(params.get("continuous_batching"))
        if batching:
            from ..paged import check_transformers_version

            try:
                check_transformers_version()
            except RuntimeError as err:
                raise ToolError(str(err)) from None
        if batching and params.get("attn_implementation") is not None:
            logger.warning(IGNORED_ATTENTION_WARNING, params["attn_implementation"])
        if params.get("attn_implementation") is None:
            params["attn_implementation"] = ATTENTION_NAME
        with _kivi_model_manager_installed(config, paged if batching else None, reuse_bytes):
            return serve(**params)

    command.callback = callback
    return command


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kivi-xpu serve",
        description="transformers serve with the KIVI cache. The KIVI cache options are these; the other options, "
        "below, are transformers serve's (--device and --dtype among them: the model's device and dtype; --sycl-device "
        "is the KIVI kernels' SYCL device filter). Without --attn-implementation, models are loaded with the fused "
        "attention (attn_implementation=kivi); with --continuous-batching, transformers' continuous batching runs on "
        "KIVI pages within --kv-memory MiB; --compile is not supported.",
        add_help=False,
        allow_abbrev=False,  # an abbreviation must not capture one of transformers' options
    )
    add_arguments(p)
    return p


def _log_to_stderr() -> None:
    """kivi_xpu's log (logger ``kivi_xpu``: the attention path, continued conversations) in the server's output."""
    log = logging.getLogger("kivi_xpu")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def serve(argv: list[str]) -> int:
    """``kivi-xpu serve ARGV``: runs the server until it is stopped (SIGINT/SIGTERM); returns the exit code.
    :class:`ToolError` for a missing serving dependency, bad KIVI options or --compile."""
    kivi_parser = parser()
    try:
        options, rest = kivi_parser.parse_known_args(argv)
    except SystemExit as done:  # argparse has printed the usage and the bad KIVI option
        return done.code if isinstance(done.code, int) else 2
    wants_help = "-h" in rest or "--help" in rest
    if wants_help:
        print(kivi_parser.format_help())
        rest = ["--help" if arg == "-h" else arg for arg in rest]
    _check_serving_dependencies()
    _log_to_stderr()
    config = cache_config(options)
    paged = paged_options(options, config)
    try:
        _transformers_serve_command(config, paged, options.reuse_memory * 2**20).main(
            args=rest, prog_name="kivi-xpu serve"
        )
    except SystemExit as done:  # click ends with sys.exit; a usage error has printed its message
        return done.code if isinstance(done.code, int) else 0
    return 0


def main(argv=None) -> int:
    """``kivi-xpu serve``; a :class:`ToolError` is one ``error:`` line and exit code 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return serve(argv)
    except ToolError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
