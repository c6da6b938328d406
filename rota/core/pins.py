"""Deploy pinning of push-executed specs: a job of a spec with ``[execute]`` runs on the
endpoint of the version that was the status quo when it was enqueued, not of whatever
version rules when it runs. Pure.

A push stores the first job row (``seq``) that comes after it (``spec_pushes.first_seq``):
so the version a job was enqueued under follows from its ``seq`` alone, which the ready
index keeps even for a job held as a key (rota/core/ready.py). ``Pins`` keeps, per spec,
those windows; a window whose version has no ``[execute]`` pins nothing (its jobs follow
the status quo, as every worker-run job does).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from rota.base.specs import JobSpec


@dataclass(slots=True)
class Window:
    first_seq: int  # the first job row enqueued under this version
    checksum: str
    spec: JobSpec


@dataclass(slots=True)
class Pins:
    windows: dict[str, list[Window]] = field(default_factory=dict)  # by first_seq

    def load(self, windows: Mapping[str, list[Window]]) -> None:
        """The windows the store holds, each spec's in push order (at a start, or after
        another server's push): replayed as the pushes were, so that memory after a
        restart is what it was before."""
        self.windows = {}
        for found in windows.values():
            for window in found:
                self.pushed(window.spec, window.checksum, window.first_seq)

    def pushed(self, spec: JobSpec, checksum: str, first_seq: int | None) -> None:
        """A push took effect: jobs from ``first_seq`` on belong to this version."""
        found = self.windows.get(spec.name)
        if found is None and spec.execute is None:
            return  # no version of it was ever pushed to an endpoint: nothing to pin
        found = self.windows.setdefault(spec.name, [])
        start = first_seq if first_seq is not None else (found[-1].first_seq if found else 0)
        found[:] = [w for w in found if w.first_seq < start]
        found.append(Window(start, checksum, spec))

    def pin(self, spec: str, seq: int) -> str | None:
        """The checksum a job of ``spec`` enqueued as row ``seq`` must run under, or None:
        none (it follows the status quo)."""
        found = self.windows.get(spec)
        if not found:
            return None
        at = bisect.bisect_right(found, seq, key=lambda w: w.first_seq) - 1
        if at < 0 or found[at].spec.execute is None:
            return None
        return found[at].checksum

    def executed(self) -> list[Window]:
        """Every version with an endpoint, oldest first: each has an endpoint worker."""
        return [w for found in self.windows.values() for w in found
                if w.spec.execute is not None]
