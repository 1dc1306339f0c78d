"""The root command, the global options every command takes (before or after
its name), and ``main``: errors to exit codes."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from ..config import Config, load_config
from ..errors import (
    ConnectionFailedError,
    RenQueueError,
    RequestFailedError,
    StoreFullError,
    TenantBacklogFullError,
)
from ..logs import configure_logging, get_logger
from ._common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PIPE_CLOSED,
    EXIT_UNREACHABLE,
    EXIT_UNSUCCESSFUL,
    EXIT_WAIT_TIMEOUT,
    Interrupted,
    NoSuchRequest,
    WaitTimeout,
    with_nats,
)

_F = TypeVar("_F", bound=Callable[..., Any])

#: Every command's help: -h too, and each option's default shown.
CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True, "max_content_width": 100}


class Globals:
    """The global options, wherever on the line they were given."""

    def __init__(self) -> None:
        self.config: str | None = None
        self.nats: str | None = None
        self.log_level: str | None = None
        self.log_json: bool | None = None
        self.json = False
        self.verbose = 0
        #: A client command (not a service): NATS unreachable exits 4, not 2.
        self.client = False


def globals_of(ctx: click.Context) -> Globals:
    root = ctx.find_root()
    if not isinstance(root.obj, Globals):
        root.obj = Globals()
    return root.obj


def _keep(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A global option's callback: keep what was given (the later wins)."""
    if value is None or value is False or value == 0:
        return value
    assert param.name is not None
    setattr(globals_of(ctx), param.name, value)
    return value


_GLOBAL_OPTIONS = (
    click.option(
        "-c",
        "--config",
        metavar="FILE",
        callback=_keep,
        expose_value=False,
        help="TOML config file (else $RENQUEUE_CONFIG, else ./renqueue.toml if present).",
    ),
    click.option(
        "--nats",
        metavar="URL",
        callback=_keep,
        expose_value=False,
        help="NATS URL (else [nats] url, $RENQUEUE_NATS_URL, or the one `up` started).",
    ),
    click.option(
        "--log-level",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        callback=_keep,
        expose_value=False,
        help="Log level (services: INFO; client commands log nothing unless -v).",
    ),
    click.option(
        "--log-json",
        is_flag=True,
        default=False,
        callback=_keep,
        expose_value=False,
        help="Log lines as JSON (default: JSON unless stderr is a terminal).",
    ),
    click.option(
        "--json",
        is_flag=True,
        default=False,
        callback=_keep,
        expose_value=False,
        help="Print only JSON: one document, or one per line for a stream.",
    ),
    click.option(
        "-v",
        "--verbose",
        count=True,
        callback=_keep,
        expose_value=False,
        help="Client commands: log to stderr (-v INFO, -vv DEBUG).",
    ),
)


def global_options(f: _F) -> _F:
    """Give a command the global options, so they work after its name too."""
    for option in reversed(_GLOBAL_OPTIONS):
        f = option(f)
    return f


def command(group: click.Group, name: str, **kwargs: Any) -> Callable[[_F], click.Command]:
    """A command of ``group`` with the global options and the shared help settings."""

    def decorate(f: _F) -> click.Command:
        return group.command(name, context_settings=CONTEXT, **kwargs)(global_options(f))

    return decorate


def subgroup(group: click.Group, name: str, **kwargs: Any) -> Callable[[_F], click.Group]:
    def decorate(f: _F) -> click.Group:
        made = group.group(name, context_settings=CONTEXT, **kwargs)(global_options(f))
        assert isinstance(made, click.Group)
        return made

    return decorate


#: Commands that warn when they run with no config file.
SERVICE_COMMANDS = frozenset({"up", "router", "worker"})


def setup(
    ctx: click.Context, *, service: bool = False, quiet: bool = False, config: bool = True
) -> Config:
    """Logging as the command wants it, and the config (with ``--nats``).

    A service logs at INFO and warns when it runs without a config file; a
    client command logs nothing unless ``-v`` or ``--log-level``; ``quiet``
    (the demo, whose display is its output) logs errors only.
    """
    opts = globals_of(ctx)
    opts.client = not service
    if opts.log_level:
        level = opts.log_level
    elif opts.verbose:
        level = "DEBUG" if opts.verbose > 1 else "INFO"
    elif quiet:
        level = "ERROR"
    else:
        level = "INFO" if service else "CRITICAL"
    configure_logging(level=level, json=opts.log_json)
    if not config:
        return Config()
    loaded = with_nats(load_config(opts.config), opts.nats)
    if service and ctx.info_name in SERVICE_COMMANDS and not _has_config_file(opts.config):
        get_logger(__name__).warning(
            "no config file (./renqueue.toml not found, no -c or $RENQUEUE_CONFIG): "
            "running with the defaults, which have no backends and no routes"
        )
    return loaded


def _has_config_file(path: str | None) -> bool:
    """Whether ``load_config`` read a file (it falls back to the defaults silently)."""
    return bool(path or os.environ.get("RENQUEUE_CONFIG")) or os.path.exists("renqueue.toml")


class _Root(click.Group):
    """The root group: a closed stdout ends a command quietly (see :func:`_pipe_closed`)
    before Click's own handling of it (exit 1) can."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            raise click.exceptions.Exit(_pipe_closed()) from None


@click.group(
    cls=_Root,
    context_settings=CONTEXT,
    epilog="Exit codes: 0 done; 2 usage or config error; 3 the request failed or was "
    "rejected, or is unknown; 4 NATS unreachable, or --wait ran out; 141 stdout closed. "
    "docs/cli.md has each command's.",
)
@click.version_option(package_name="renqueue", prog_name="renqueue", message="%(prog)s %(version)s")
@global_options
def cli() -> None:
    """Ren-Queue: a priority queue and router for LLM requests on NATS JetStream.

    Start with `renqueue init`, `renqueue up --mocks`, then
    `renqueue submit "hello" --wait 30` and `renqueue status`.
    """


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); the exit code."""
    from . import _commands  # noqa: F401 - registers every command on ``cli``

    args = list(sys.argv[1:] if argv is None else argv)
    opts = Globals()
    try:
        result = cli.main(args=args, prog_name="renqueue", standalone_mode=False, obj=opts)
        sys.stdout.flush()  # a closed pipe shows here, not as a warning at exit
    except BrokenPipeError:
        return _pipe_closed()
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return EXIT_ERROR
    except (click.Abort, KeyboardInterrupt):
        print("renqueue: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RenQueueError as exc:
        return _report(exc, client=opts.client)
    return result if isinstance(result, int) else EXIT_OK


def _pipe_closed() -> int:
    """The reader of stdout went away (``renqueue status --json | head -c 100``):
    say nothing, as ``cat`` and ``git`` do, and exit as a process ended by
    SIGPIPE reports (128 + 13), with stdout pointed at /dev/null so that
    Python's own flush at exit does not complain (the Python docs' recipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE_CLOSED


def _report(exc: RenQueueError, *, client: bool) -> int:
    """One line on stderr for ``exc``; its exit code (a service's error is 2,
    whatever it is: it could not start or go on)."""
    if isinstance(exc, RequestFailedError):
        print(f"renqueue: {exc} [{exc.error_type}]", file=sys.stderr)
        return EXIT_UNSUCCESSFUL
    print(f"renqueue: {exc}", file=sys.stderr)
    if isinstance(exc, NoSuchRequest | StoreFullError | TenantBacklogFullError):
        return EXIT_UNSUCCESSFUL  # refused, nothing stored: the request did not succeed
    if isinstance(exc, Interrupted):
        return EXIT_INTERRUPTED
    if isinstance(exc, WaitTimeout):
        return EXIT_WAIT_TIMEOUT
    if client and isinstance(exc, ConnectionFailedError):
        return EXIT_UNREACHABLE
    return EXIT_ERROR
