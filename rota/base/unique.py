"""Unique jobs' options, as a producer, a spec file and the server read them: the
``unique`` of an enqueue and a spec's ``[unique]`` table, and the mistakes in them that need
no job to be seen (rota/core/unique.py computes keys and judges conflicts)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Dimension = Literal["spec", "queue", "args"]
Covers = Literal["waiting", "active", "finished"]
OnConflict = Literal["existing", "reject", "replace"]
# An explicit key: printable, no control characters, short enough for a log line.
KEY_PATTERN = r"^[^\x00-\x1f\x7f]{1,256}$"
MAX_PERIOD = 366 * 24 * 3600.0  # the longest wait Rota keeps (rota/core/jobs.py MAX_AHEAD)
ArgName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class UniqueOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True,
                    omit_defaults=True):
    """What makes two jobs the same, which of the first's states keep a second out, for
    how long, and what a second enqueue gets (docs/protocol.md, Unique jobs)."""

    key: Annotated[str, msgspec.Meta(pattern=KEY_PATTERN)] | None = None  # given, or
    keys: Annotated[list[Dimension], msgspec.Meta(min_length=1, max_length=3)] | None = None
    args_keys: Annotated[list[ArgName], msgspec.Meta(min_length=1, max_length=64)] | None = None
    states: Covers = "active"  # waiting; waiting and running; or finished too
    period: Annotated[float, msgspec.Meta(gt=0, le=MAX_PERIOD)] | None = None  # seconds
    on_conflict: OnConflict = "existing"


def options_problem(options: UniqueOptions) -> str | None:
    """Why these options contradict themselves (a sentence naming the fields), or None."""
    if options.key is not None and (options.keys is not None or options.args_keys is not None):
        return ("unique.key is the whole key: give unique.key or unique.keys"
                " (and args_keys), not both")
    keys = options.keys or []
    if len(set(keys)) != len(keys):
        return f"unique.keys names a dimension twice: {keys}"
    if options.args_keys is not None and "args" not in keys:
        return 'unique.args_keys picks arguments for the key: it needs "args" in unique.keys'
    if options.args_keys is not None and len(set(options.args_keys)) != len(options.args_keys):
        return f"unique.args_keys names an argument twice: {options.args_keys}"
    if options.on_conflict == "replace" and options.states == "finished":
        return ('unique.on_conflict "replace" cancels a waiting job; a finished one cannot be'
                ' replaced: use states "waiting" or "active" with it')
    if options.states == "finished" and options.period is None:
        return ('unique.states "finished" keeps finished jobs in the way: it needs a period'
                " (seconds from the first job's enqueue) to say for how long")
    return None


def unique_option(options: dict[str, Any]) -> dict[str, Any]:
    """A client's enqueue options with ``unique`` as JSON: a UniqueOptions becomes its
    dict, and ``unique_key="K"`` is short for ``unique={"key": "K"}`` (with another
    ``unique`` dict, its key)."""
    short = options.pop("unique_key", None)
    unique = options.get("unique")
    if isinstance(unique, UniqueOptions):
        unique = msgspec.to_builtins(unique)
    if short is not None:
        unique = {**(unique or {}), "key": short}
    if unique is not None:
        options["unique"] = unique
    return options
