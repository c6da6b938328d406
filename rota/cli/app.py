"""The ``rota`` command: serve, run workers, push specs during deploys, enqueue, inspect.

The environment is read by the commands and nowhere else: every ``rota serve`` option has
a ``ROTA_<OPTION>`` variable, and commands that talk to a server read ``ROTA_URL``. This
module builds the group; each group of commands is a module of its own:

    serve    serve (its options made from rota/core/settings.py's ServerSettings)
    worker   worker, demo
    specs    specs push|list|history|retire|checksum
    jobs     enqueue, run, jobs show
    ops      jobs list|retry|cancel, queues, workers
    live     watch, tail
    tokens   tokens create|list|revoke
    limits   limits, limits set|clear
    workflows  workflows, workflows show|cancel|retry|create
    schedules  schedules, schedules show|add|pause|resume|delete
    webhooks   webhooks, webhooks add|show|deliveries|test|rotate-secret|delete
    secrets  secrets set|list|delete
"""

from __future__ import annotations

import sys
from typing import Any

import click

from rota.cli import (jobs, limits, live, ops, schedules, secrets, serve, specs, tokens,
                      webhooks, worker, workflows)
from rota.cli.base import error as _error
from rota.cli.base import need_server
from rota.cli.base import out as _out
from rota.cli.base import out_lines as _out_lines

# Commands that run the server's code (or open its database): a worker's or producer's
# install ('pip install rota') lacks the packages they need, and says so in one line.
# (`rota tokens` needs them only on the file: over the API, with --url, it is a client.)
SERVER_COMMANDS = frozenset({"serve", "demo"})


class OneLineErrors(click.Group):
    """click, but a mistake on the command line is one line, like every other expected
    failure of ``rota``: "error: <what is wrong> (see 'rota x --help')", exit 2."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:  # bare `rota`, `rota specs`: help
            _out_lines(exc.ctx.get_help() if exc.ctx else exc.format_message())
            sys.exit(0)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            _error(f"{exc.format_message()}{hint}")
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            _error(exc.format_message())
            sys.exit(exc.exit_code)
        except click.Abort:
            _out("aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rota")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Rota: a job coordinator. Workers hold one WebSocket; the server pushes them jobs."""
    if ctx.invoked_subcommand in SERVER_COMMANDS:
        need_server(ctx.invoked_subcommand)


for _command in (serve.serve, worker.worker, worker.demo, specs.specs,
                 jobs.enqueue, jobs.run, jobs.jobs, ops.queues, ops.workers,
                 live.watch, live.tail, tokens.tokens, limits.limits,
                 workflows.workflows, schedules.schedules, secrets.secrets,
                 webhooks.webhooks):
    main.add_command(_command)
