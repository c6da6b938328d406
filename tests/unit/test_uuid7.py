"""UUIDv7 ids (rota/base/ids.py): their shape, their order in time, and that no two are
alike, from many threads at once and from a process forked mid-block."""

from __future__ import annotations

import os
import re
import threading
import uuid

from rota.base.ids import uuid7

SHAPE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def test_an_id_is_a_version_7_uuid_that_sorts_by_its_millisecond():
    ids = [uuid7() for _ in range(1_000)]
    for value in ids:
        assert SHAPE.match(value) and uuid.UUID(value).version == 7
    stamps = [value[:13] for value in ids]
    assert stamps == sorted(stamps)
    assert len(set(ids)) == len(ids)


def test_threads_drawing_at_once_never_make_the_same_id():
    made: list[list[str]] = [[] for _ in range(8)]
    start = threading.Barrier(8)

    def draw(into: list[str]) -> None:
        start.wait()
        into.extend(uuid7() for _ in range(5_000))

    threads = [threading.Thread(target=draw, args=(into,)) for into in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [value for into in made for value in into]
    assert len(set(every)) == len(every) == 40_000


def test_a_forked_child_draws_other_bytes_than_its_parent():
    uuid7()  # (an implementation that keeps random bytes must not hand them to both)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, ",".join(uuid7() for _ in range(50)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = pipe.read().split(",")
    os.waitpid(pid, 0)
    mine = [uuid7() for _ in range(50)]
    # Same milliseconds, most likely: the random part is what must differ.
    assert not {value[14:] for value in child} & {value[14:] for value in mine}
