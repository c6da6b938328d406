"""Unique jobs, decided on a fake clock: keys, coverage, and each kind of conflict."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from rota.base.errors import Invalid
from rota.base.specs import JobSpec, checksum
from rota.base.unique import UniqueOptions, unique_option
from rota.core.auth import Principal
from rota.core.effects import Finished
from rota.core.engine import Engine
from rota.core.jobs import EnqueueRequest
from rota.core.model import Instant, JobRecord
from rota.core.settings import ServerSettings
from rota.core.unique import claim, decide, holds, unique_key

NOW = 1_000.0


def opts(**fields) -> UniqueOptions:
    return msgspec.convert(fields, type=UniqueOptions)


def make(now: float = NOW, args=None, queue="default", **fields):
    return claim(opts(**fields), spec="send", queue=queue, args=args or {"user": 7, "x": 1},
                 now=now)


def test_the_key_is_sha256_of_canonical_json_with_the_spec_always_in():
    key = unique_key(opts(keys=["args"], args_keys=["user"]), spec="send", queue="q",
                     args={"user": 7, "x": 1})
    assert key == hashlib.sha256(b'{"args":{"user":7},"spec":"send"}').hexdigest()
    # keys sorted at every level; strings NFC; another spec is another key
    a = unique_key(opts(keys=["args"]), spec="s", queue="q", args={"b": {"y": 1, "x": "\u00e9"}, "a": 0})
    b = unique_key(opts(keys=["args"]), spec="s", queue="q", args={"a": 0, "b": {"x": "e\u0301", "y": 1}})
    assert a == b
    assert unique_key(opts(), spec="s", queue="q", args={}) != unique_key(opts(), spec="t",
                                                                           queue="q", args={})
    # an explicit key with the spec; a producer token's keys are its own
    mine = unique_key(opts(key="k"), spec="s", queue="q", args={}, token="tok-a")
    assert mine != unique_key(opts(key="k"), spec="s", queue="q", args={}, token="tok-b")
    # the queue counts only when named
    assert (unique_key(opts(keys=["queue"]), spec="s", queue="a", args={})
            != unique_key(opts(keys=["queue"]), spec="s", queue="b", args={}))
    assert (unique_key(opts(), spec="s", queue="a", args={"z": 1})
            == unique_key(opts(), spec="s", queue="b", args={"z": 2}))


@pytest.mark.parametrize(("fields", "words"), [
    ({"key": "k", "keys": ["args"]}, "not both"),
    ({"keys": ["spec"], "args_keys": ["user"]}, 'needs "args" in unique.keys'),
    ({"on_conflict": "replace", "states": "finished", "period": 60}, "cannot be replaced"),
    ({"states": "finished"}, "needs a period"),
    ({"keys": ["args", "args"]}, "twice"),
    ({"keys": ["args"], "args_keys": ["nope"]}, "'nope', which the job's args do not have"),
])
def test_contradicting_options_are_refused_with_a_sentence(fields, words):
    with pytest.raises(Invalid) as refused:
        make(**fields)
    assert refused.value.code == "invalid_unique" and words in refused.value.message


def test_unknown_fields_and_values_are_refused_by_the_decoder():
    for bad in ({"keyz": ["spec"]}, {"states": "running"}, {"on_conflict": "ignore"},
                {"period": 0}, {"keys": ["meta"]}):
        with pytest.raises(msgspec.ValidationError):
            opts(**bad)


def test_coverage_by_state_and_period():
    assert holds("available", "waiting", None, NOW)
    assert not holds("active", "waiting", None, NOW)
    assert holds("active", "active", None, NOW)
    assert not holds("completed", "active", None, NOW)
    assert holds("completed", "finished", NOW + 60, NOW)
    assert not holds("completed", "finished", NOW + 60, NOW + 60)  # after the period
    assert not holds("available", "active", NOW + 60, NOW + 61)  # the period bounds all
    assert not holds(None, "finished", None, NOW)  # the holder's row is gone
    # A workflow's held step (pending) waits: it keeps its key, and is not replaced.
    assert holds("pending", "waiting", None, NOW) and holds("pending", "active", None, NOW)
    assert decide(make(on_conflict="replace"), "pending", "active", None, NOW) == "running"


def test_each_kind_of_conflict():
    held = make()  # the first job took the key: available, default "active" coverage
    assert make().key == held.key
    assert decide(make(), "available", held.covers, held.until, NOW) == "existing"
    assert decide(make(on_conflict="reject"), "active", held.covers, held.until, NOW) == "reject"
    assert decide(make(on_conflict="replace"), "scheduled", "active", None, NOW) == "replace"
    assert decide(make(on_conflict="replace"), "active", "active", None, NOW) == "running"
    # the holder finished: under "active" the key is free, under "finished" within period
    assert decide(make(on_conflict="reject"), "completed", "active", None, NOW) == "take"
    first = make(states="finished", period=3600)
    assert first.until == NOW + 3600
    later = make(now=NOW + 10, states="finished", period=3600, on_conflict="reject")
    assert decide(later, "completed", first.covers, first.until, NOW + 10) == "reject"
    assert decide(later, "completed", first.covers, first.until, NOW + 3600) == "take"


def test_a_client_may_give_the_options_as_a_struct_or_a_key_alone():
    assert unique_option({"unique_key": "k"}) == {"unique": {"key": "k"}}
    assert unique_option({"unique": UniqueOptions(on_conflict="reject")}) == {
        "unique": {"on_conflict": "reject"}}
    assert unique_option({"queue": "q"}) == {"queue": "q"}


# -- the engine: what a unique enqueue builds, and a replaced job let go ----------------
def test_the_engine_builds_a_claim_and_lets_a_replaced_job_go_whole_or_as_a_key():
    clock = Instant(1000.0, 1_800_000_000.0)
    engine = Engine(ServerSettings(), rand=lambda: 0.0)
    spec = JobSpec(name="mail", version="1", unique=opts(on_conflict="replace"))
    engine.load({"mail": spec}, {"mail": checksum(spec)}, [], clock)
    producer = Principal(token_id="tok", name="p", scope="producer")
    built = [engine.build(EnqueueRequest(spec="mail", args={"n": n}, **extra), producer, clock)
             for n, extra in enumerate([{}, {"delay": 60.0}, {"unique": opts(key="k")}])]
    compact, later, own = built
    assert isinstance(compact, JobRecord) and isinstance(later, JobRecord)
    assert compact.unique == later.unique  # the spec's [unique]: keys ["spec"], scoped
    assert compact.unique.key == unique_key(opts(), spec="mail", queue="default", args={},
                                            token="tok")
    assert compact.unique.on_conflict == "replace" and own.unique.key != compact.unique.key
    refused = engine.build(EnqueueRequest(spec="mail", unique=opts(keys=["args"],
                                          args_keys=["x"])), producer, clock)
    assert isinstance(refused, Invalid) and refused.code == "invalid_unique"
    for seq, job in enumerate(built, 1):
        engine.enqueued(job, seq, clock)
    assert engine.scheduler.ready_counts() == {("default", "mail"): 2}  # one is scheduled
    assert compact.id not in engine.scheduler.jobs  # kept as a key only
    rows = [{"id": job.id, "queue": "default", "spec": "mail", "priority": 0, "rowid": seq,
             "attempt": 0} for seq, job in ((1, compact), (2, later))]
    effects = engine.replaced(rows, own.id, clock)
    assert [e.job_ids for e in effects if isinstance(e, Finished)] == [[compact.id], [later.id]]
    assert engine.scheduler.ready_counts() == {("default", "mail"): 1}
    assert later.id not in engine.scheduler.jobs and later.state == "cancelled"
    # A key not held here (another server's job it has not heard of) changes no count.
    engine.replaced([{**rows[0], "id": "elsewhere", "rowid": 99}], own.id, clock)
    assert engine.scheduler.ready_counts() == {("default", "mail"): 1}
