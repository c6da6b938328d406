"""The OJS conformance runner itself (no Rota server): its judge on the cases the reference
runner's own tests pin down, its templates and JSONPath, its loader on the real suites, and
its driver on a stub app that is not an OJS server at all."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

import ojs_report
import run
from ojs_driver import Spread, run_case, run_cases
from ojs_judge import (PathError, Reply, go_text, json_type, match, render, resolve_path,
                       split_path, substitute, value_of)
from ojs_suites import Case, SuiteError, check_step, load, load_file, parse_levels, suites_dir
from ojs_verdict import judge, judge_status

UUID7 = "019539a4-b68c-7def-8000-1a2b3c4d5e6f"
UUID4 = "550e8400-e29b-41d4-a716-446655440000"

# (matcher, value, holds): the reference's assertions_test.go cases, and a few of ours
MATCHES = [
    (None, None, True), (None, "x", False),
    *[("any", value, True) for value in ("x", 42.0, True, None)],
    ("absent", None, True), ("absent", "x", False),
    ("exists", "x", True), ("exists", None, False),
    ("string:nonempty", "x", True), ("string:nonempty", "", False),
    ("string:nonempty", 42.0, False), ("string:non_empty", "x", True),
    ("string:non_empty", "", False),
    ("string:uuid", UUID7, True), ("string:uuid", "not-a-uuid", False),
    ("string:uuid", 42.0, False), ("string:uuidv7", UUID7, True),
    ("string:uuidv7", UUID4, False), ("string:uuidv7", UUID7.upper(), False),
    ("string:datetime", "2024-01-15T10:30:00Z", True),
    ("string:datetime", "2024-01-15T10:30:00.123Z", True),
    ("string:datetime", "2024-01-15T10:30:00+05:30", True),
    ("string:datetime", "2024-01-15T10:30:00.999999-08:00", True),
    ("string:datetime", "not-a-date", False), ("string:datetime", "2024-01-15", False),
    ("string:datetime", "2024-01-15T10:30:00Z\n", False),
    ("number:positive", 5.0, True), ("number:positive", 0, False),
    ("number:positive", -1, False), ("number:positive", True, False),
    ("number:non_negative", 0, True), ("number:non_negative", 5, True),
    ("number:non_negative", -1, False),
    ("array:nonempty", [1, 2], True), ("array:nonempty", [], False),
    ("array:nonempty", "no", False), ("array:empty", [], True), ("array:empty", [1], False),
    ("array:min_length:2", [1, 2, 3], True), ("array:min_length:5", [1, 2, 3], False),
    ("array:min:1", [1, 2], True), ("array:min:3", [1, 2], False),
    ("array:length:2", [1, 2], True), ("array:length:3", [1, 2], False),
    ("array:length(3)", [1, 2, 3], True), ("array:length(3)", [1], False),
    ("contains:beta", ["alpha", "beta"], True), ("contains:delta", ["alpha"], False),
    ("contains:2", [1.0, 2.0], True), ("contains:beta", "beta", False),
    ("not_contains:gamma", ["alpha", "beta"], True), ("not_contains:alpha", ["alpha"], False),
    ("string:contains:world", "hello world", True), ("string:contains:xyz", "hello", False),
    ("number:range(1, 10)", 5, True), ("number:range(1, 10)", 15, False),
    ("number:range(1, 10)", 0.5, False),
    ("~100", 120, True), ("~100", 200, False), ("~100", "100", False),
    ("string:pattern(^[a-z]+$)", "hello", True), ("string:pattern(^[a-z]+$)", "Hello1", False),
    ("string:pattern(^[a-z]+$)", 42, False),
    ("active", "active", True), ("active", "pending", False), ("active", 42, False),
    (42, 42.0, True), (42, 43, False), (3.14, 3.14, True), (42, "42", False),
    (1, True, False),  # a bool is not a number in JSON
    (True, True, True), (True, False, False), (False, False, True), (True, "x", False),
    (True, 1, False),
    (["hello", 42], ["hello", 42.0], True), (["a", "b"], ["a"], False),
    (["a", "b"], ["a", "c"], False), (["a"], "a", False),
    ({"name": "alice", "age": 30}, {"name": "alice", "age": 30.0, "extra": True}, True),
    ({"name": "alice"}, {"name": "bob"}, False), ({"name": "alice"}, {"age": 30}, False),
    ({"deleted_at": "absent"}, {"name": "alice"}, True),
    ({"deleted_at": "absent"}, {"deleted_at": "2024-01-01"}, False),
    ({"deleted_at": "absent"}, {"deleted_at": None}, False),  # the key itself is present
    ({"name": "alice"}, None, False),
    ({"$exists": True}, "x", True), ({"$exists": True}, None, False),
    ({"$exists": False}, None, True), ({"$exists": False}, "x", False),
    ({"$exists": True, "$type": "string"}, "x", True),
    ({"$exists": True, "$type": "string"}, 42, False),
    ({"$exists": True, "$type": "number"}, True, False),
    ({"$match": r"^email\."}, "email.send", True), ({"$match": r"^email\."}, "sms.send", False),
    ({"$match": r"^email\."}, 42, False),
    ({"$in": ["active", "completed"]}, "active", True), ({"$in": ["active"]}, "pending", False),
    ({"$size": 3}, [1, 2, 3], True), ({"$size": 3}, [1], False), ({"$size": 1}, "x", False),
    ({"$size": {"$gte": 2}}, [1, 2, 3], True), ({"$size": {"$gte": 2}}, [1], False),
    ({"$or": ["active", "completed"]}, "completed", True), ({"$or": ["active"]}, "pending", False),
    ({"range": {"min": 1, "max": 10}}, 5, True), ({"range": {"min": 1, "max": 10}}, 0.5, False),
    ({"range": {"min": 1, "max": 10}}, 11, False), ({"range": {"min": 5}}, 10, True),
    ({"range": {"min": 5}}, 3, False),
]


@pytest.mark.parametrize(("matcher", "value", "holds"), MATCHES,
                         ids=[f"{m!r}~{v!r}" for m, v, _ in MATCHES])
def test_a_matcher_judges_as_the_reference_does(matcher: Any, value: Any, holds: bool) -> None:
    why = match(matcher, value)
    assert (why is None) == holds, why
    if not holds:
        assert isinstance(why, str) and why  # a failure says why


DOC = {"name": "alice", "job": {"type": "email.send", "error": None},
       "items": ["a", "b", "c"],
       "jobs": [{"id": "1", "state": "active", "args": [{"action": "x"}]},
                {"id": "2", "state": "completed"}],
       "crons": [{"name": "a"}, {"other": 1}, {"name": "c"}]}


@pytest.mark.parametrize(("path", "value"), [
    ("$.name", "alice"), ("name", "alice"), ("$.job.type", "email.send"),
    ("$.items[1]", "b"), ("$.jobs[0].state", "active"),
    ("$.jobs[0].args[0].action", "x"),
    ("$.crons[*].name", ["a", "c"]),  # elements where the rest finds nothing are left out
    ("$.items[*]", ["a", "b", "c"]),
    ("$.jobs[?(@.state=='completed')].id", "2"), ("$.jobs[?(@.id==\"1\")].state", "active"),
    ("$.jobs[?(@.state=='gone')]", None),
    ("$.missing", None), ("$.missing.deeper", None),  # a missing field ends the walk
    ("$.job.error", None),
])
def test_a_jsonpath_finds_what_the_reference_finds(path: str, value: Any) -> None:
    assert resolve_path(path, DOC) == value


@pytest.mark.parametrize("path", ["$.items[5]", "$.name[0]", "$.job.error.code",
                                  "$.items.x", "$.jobs[?(@.state=='gone')].id.x",
                                  "$.jobs[x]", "$.jobs[0"])
def test_a_jsonpath_the_document_cannot_follow_is_an_error(path: str) -> None:
    with pytest.raises(PathError):
        resolve_path(path, DOC)


def test_the_helpers_under_the_judge() -> None:
    assert split_path("a.b.c") == ["a", "b", "c"]
    assert split_path("a[0][1].b") == ["a[0][1]", "b"]
    assert split_path("jobs[?(@.state=='active')].id") == ["jobs[?(@.state=='active')]", "id"]
    assert [json_type(v) for v in ("x", 4.2, True, None, [], {})] == [
        "string", "number", "boolean", "null", "array", "object"]
    assert [go_text(v) for v in (2.0, 2.5, True, None, "s", 7)] == ["2", "2.5", "true", "<nil>",
                                                                    "s", "7"]


def reply(body: Any, status: int = 200, headers: dict[str, str] | None = None,
          elapsed_ms: int = 5) -> Reply:
    text = "" if body is None else json.dumps(body)
    return Reply(status, {k.lower(): v for k, v in (headers or {}).items()}, text, body,
                 elapsed_ms)


def test_templates_name_an_earlier_steps_reply() -> None:
    replies = {"step-1": reply({"job": {"id": UUID7, "attempt": 2, "tags": ["a"]}}),
               "step-2": reply({"jobs": [{"id": "j2"}]})}
    assert render("/ojs/v1/jobs/{{steps.step-1.response.body.job.id}}", replies) == \
        f"/ojs/v1/jobs/{UUID7}"
    assert render("{{steps.step-2.response.body.jobs[0].id}}", replies) == "j2"
    assert render("n={{steps.step-1.response.body.job.attempt}}", replies) == "n=2"
    # no such step, no such field: left as written (a server then sees it and fails)
    assert render("{{steps.step-9.response.body.job.id}}", replies) == \
        "{{steps.step-9.response.body.job.id}}"
    assert render("{{steps.step-1.response.body.job.nope}}", replies) == \
        "{{steps.step-1.response.body.job.nope}}"
    body = {"job_id": "{{steps.step-1.response.body.job.id}}", "n": 3,
            "{{steps.step-2.response.body.jobs[0].id}}":
                ["{{steps.step-1.response.body.job.tags}}"]}
    assert substitute(body, replies) == {"job_id": UUID7, "n": 3, "j2": ['["a"]']}
    assert value_of("{{steps.step-2.response.body.jobs}}", replies) == [{"id": "j2"}]
    assert value_of("{{steps.step-2.response.body}}", replies) == {"jobs": [{"id": "j2"}]}


def test_a_step_is_judged_on_status_headers_body_and_timing() -> None:
    replies = {"step-1": reply({"job": {"id": UUID7}})}
    step = {"id": "step-2", "action": "GET", "path": "/x", "assertions": {
        "status": 200, "headers": {"Content-Type": {"$match": "application/(openjobspec\\+)?json"}},
        "body": {"$.job.id": "{{steps.step-1.response.body.job.id}}", "$.job.state": "active",
                 "$.jobs[?(@.id=='{{steps.step-1.response.body.job.id}}')]": "absent",
                 "$.job.error.code": "absent"},
        "body_absent": ["$.job.result"], "body_contains": ["active"],
        "timing_ms": {"less_than": 1000}}}
    good = reply({"job": {"id": UUID7, "state": "active", "error": None}},
                 headers={"Content-Type": "application/openjobspec+json"})
    assert judge(step, good, replies) == []
    bad = reply({"job": {"id": "other", "state": "active", "result": 1}}, status=201,
                headers={"Content-Type": "text/plain"}, elapsed_ms=1500)
    fields = sorted(f.field for f in judge(step, bad, replies))
    assert fields == ["$.job.id", "$.job.result", "header:Content-Type", "status", "timing"]


@pytest.mark.parametrize(("matcher", "status", "holds"), [
    (201, 201, True), (201, 200, False), ("one_of:200,204", 204, True),
    ("one_of:200,204", 404, False), ("number:range(400, 422)", 409, True),
    ("number:range(400, 422)", 500, False), ({"$in": [200, 204]}, 204, True),
    ({"$in": [200, 204]}, 500, False), ({"$nin": [200]}, 500, False)])
def test_a_status_matcher(matcher: Any, status: int, holds: bool) -> None:
    assert (judge_status(matcher, status) is None) == holds


def test_or_empty_and_the_cross_step_checks() -> None:
    step = {"id": "s", "action": "POST", "path": "/f", "assertions": {"body": {"$or": [
        {"$.jobs": {"$size": 0}}, {"$empty": True}]}}}
    assert judge(step, reply({"jobs": []}), {}) == []
    assert judge(step, reply(None, status=204), {}) == []
    assert len(judge(step, reply({"jobs": [{"id": "j"}]}), {})) == 1
    claim = {"id": "s4", "action": "ASSERT", "assertions": {"exclusive_claim": {
        "job_id": "{{steps.s1.response.body.job.id}}",
        "fetches": ["{{steps.s2.response.body.jobs}}", "{{steps.s3.response.body.jobs}}"],
        "exactly_one_has_job": True, "exactly_one_empty": True}}}
    one = {"s1": reply({"job": {"id": "j"}}), "s2": reply({"jobs": [{"id": "j"}]}),
           "s3": reply({"jobs": []})}
    assert judge(claim, None, one) == []
    both = {**one, "s3": reply({"jobs": [{"id": "j"}]})}
    assert len(judge(claim, None, both)) == 2
    same = {"id": "s5", "action": "ASSERT", "assertions": {"equality": {
        "$.steps.s2.response.body": "{{steps.s3.response.body}}"}}}
    assert judge(same, None, {**one, "s3": reply({"jobs": [{"id": "j"}]})}) == []
    assert len(judge(same, None, one)) == 1
    unknown = {"id": "s6", "action": "GET", "path": "/", "assertions": {"body_raw": "x"}}
    assert [f.field for f in judge(unknown, reply({}), {})] == ["body_raw"]  # never a pass


def test_levels_and_step_checks() -> None:
    assert parse_levels("0-4") == [0, 1, 2, 3, 4]
    assert parse_levels("3,0-1") == [0, 1, 3]
    for wrong in ("5", "4-2", "x", ""):
        with pytest.raises(ValueError):
            parse_levels(wrong)
    assert check_step({"id": "a", "action": "GET", "path": "/"}) == []
    assert check_step({"id": "a", "action": "GET"}) == ["step a: GET with no path"]
    assert check_step({"id": "a", "action": "WAIT", "loop": 1,
                       "assertions": {"poll": {}}}) == [
        "step a: unknown field 'loop'", "step a: unknown assertion kind 'poll'"]


def test_a_file_the_runner_cannot_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / "level-0-core").mkdir()
    bad = tmp_path / "level-0-core" / "t.json"
    bad.write_text(json.dumps({"test_id": "T", "level": 1, "steps": []}))
    with pytest.raises(SuiteError, match="level 1 in a level-0 folder"):
        load([0], tmp_path)
    bad.write_text(json.dumps({"test_id": "T", "level": 0, "steps": [
        {"id": "a", "action": "FETCH", "path": "/"}]}))
    with pytest.raises(SuiteError, match="unknown action 'FETCH'"):
        load_file(bad)
    with pytest.raises(SuiteError, match="no level-2"):
        load([2], tmp_path)


def real_suites() -> Path:
    root = suites_dir()
    if not root.is_dir():
        pytest.skip(f"no OJS conformance suites at {root} (clone them beside the repo as"
                    " ../shared, or set ROTA_OJS_SUITES)")
    return root


def test_the_loader_reads_every_file_of_levels_0_to_4() -> None:
    root = real_suites()
    cases = load([0, 1, 2, 3, 4], root)
    on_disk = sorted(p for p in root.glob("level-[0-4]-*/**/*.json"))
    assert sorted(case.file for case in cases) == on_disk
    by_level = {level: [c for c in cases if c.level == level] for level in range(5)}
    files = {level: len(found) for level, found in by_level.items()}
    steps = {level: sum(len(c.all_steps()) for c in found) for level, found in by_level.items()}
    # the suites as kept beside the project (issue 25): 133 files, 519 steps
    assert files == {0: 65, 1: 25, 2: 13, 3: 14, 4: 16}, files
    assert steps == {0: 183, 1: 131, 2: 42, 3: 93, 4: 70}, steps
    # six ids name two files each (level 0's operations): a result names its file too
    ids = [c.test_id for c in cases]
    assert len(set(ids)) == len(ids) - 6


def stub(request: httpx.Request) -> httpx.Response:
    """A two-route app, nothing like an OJS server: POST /things makes one, GET reads it."""
    if request.method == "POST" and request.url.path == "/things":
        name = json.loads(request.content)["name"]
        return httpx.Response(201, json={"thing": {"id": f"id-{name}", "state": "new"}})
    if request.method == "GET" and request.url.path.startswith("/things/id-"):
        return httpx.Response(200, json={"thing": {"id": request.url.path[8:], "state": "new"}})
    return httpx.Response(404, json={"error": {"code": "not_found"}})


def stub_case(level: int, state: str) -> Case:
    steps = [{"id": "make", "action": "POST", "path": "/things", "body": {"name": "a"},
              "assertions": {"status": 201, "body": {"$.thing.id": "string:nonempty"}}},
             {"id": "read", "action": "GET", "delay_ms": 10,
              "path": "/things/{{steps.make.response.body.thing.id}}",
              "assertions": {"status": 200, "body": {"$.thing.state": state,
                                                     "$.thing.id": "id-a"}}}]
    return Case(f"T-{level}-{state}", level, "stub", state, "", Path("stub.json"), steps)


async def test_the_driver_reports_a_pass_and_a_fail() -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async with httpx.AsyncClient(base_url="http://stub",
                                 transport=httpx.MockTransport(stub)) as client:
        passed = await run_case(client, stub_case(0, "new"), sleep)
        failed = await run_case(client, stub_case(1, "done"), sleep)
    assert passed.status == "pass" and [v.status for v in passed.steps] == [201, 200]
    assert slept == [0.01, 0.01]
    assert failed.status == "fail"
    assert [(f.step, f.field) for f in failed.failures] == [("read", "$.thing.state")]
    assert "expected 'done', got 'new'" in failed.failures[0].message
    report = ojs_report.build([passed, failed], "http://stub", [0, 1], "now", 1)
    assert (report["conformant"], report["conformant_level"]) == (False, 0)
    assert report["results"]["by_level"]["1"] == {"total": 1, "passed": 0, "failed": 1,
                                                  "skipped": 0, "errored": 0, "all_pass": False}
    assert "PARTIAL CONFORMANCE (Level 0 - Core)" in ojs_report.table(report, [passed, failed])
    # a level not run ends the climb: level 1 alone passing reaches no level
    alone = ojs_report.build([dataclasses.replace(passed, level=1)], "http://stub", [1], "now", 1)
    assert (alone["conformant"], alone["conformant_level"]) == (True, -1)


async def test_the_command_prints_the_report_and_exits_by_it(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]):
    suites = tmp_path / "level-0-core"
    suites.mkdir()
    case = stub_case(0, "new")
    (suites / "t.json").write_text(json.dumps({"test_id": case.test_id, "level": 0,
                                               "name": "stub", "steps": case.steps}))
    argv = ["--url", "http://stub", "--levels", "0", "--suites", str(tmp_path), "--json"]
    assert await run.main(argv, httpx.MockTransport(stub)) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["conformant"], report["conformant_level"]) == (True, 0)
    assert await run.main(["--url", "http://stub", "--suites", str(tmp_path / "no")]) == 2
    assert "no OJS conformance suites at" in capsys.readouterr().err


async def test_a_reset_path_is_posted_before_each_test() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return stub(request)

    async with httpx.AsyncClient(base_url="http://stub",
                                 transport=httpx.MockTransport(handler)) as client:
        await run_cases(client, [stub_case(0, "new")], reset="/reset", sleep=_no_sleep)
    assert seen == ["POST /reset", "POST /things", "GET /things/id-a"]


async def _no_sleep(seconds: float) -> None:
    return None


async def test_several_servers_share_the_steps_round_robin_and_each_is_reset() -> None:
    seen: list[str] = []

    def server(name: str) -> httpx.MockTransport:
        def handler(request: httpx.Request) -> httpx.Response:
            seen.append(f"{name} {request.method} {request.url.path}")
            return stub(request)
        return httpx.MockTransport(handler)

    clients = [httpx.AsyncClient(base_url=f"http://{name}", transport=server(name))
               for name in ("a", "b")]
    results = await run_cases(Spread(clients), [stub_case(0, "new"), stub_case(0, "new")],
                              reset="/reset", sleep=_no_sleep)
    assert [result.status for result in results] == ["pass", "pass"]
    assert seen == ["a POST /reset", "b POST /reset", "a POST /things", "b GET /things/id-a",
                    "a POST /reset", "b POST /reset", "a POST /things", "b GET /things/id-a"]


def _write_suite(root: Path, *cases: Case) -> None:
    for case in cases:
        folder = root / f"level-{case.level}-x"
        folder.mkdir(exist_ok=True)
        (folder / f"{case.test_id}.json").write_text(json.dumps(
            {"test_id": case.test_id, "level": case.level, "name": case.name,
             "steps": case.steps}))


async def test_an_excused_test_gives_the_level_beside_the_strict_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_suite(tmp_path, stub_case(0, "new"), stub_case(1, "done"), stub_case(2, "new"))
    excused = tmp_path / "excused.toml"
    excused.write_text('[[excused]]\ntest_id = "T-1-done"\nreason = """\nit cannot pass:'
                       '\nthe stub never finishes things."""\n')
    argv = ["--url", "http://stub", "--levels", "0-2", "--suites", str(tmp_path)]
    transport = httpx.MockTransport(stub)
    # strict: level 0; with the excuse, level 2; the exit by the level asked for
    assert await run.main([*argv, "--excused", str(excused), "--min-level", "2"],
                          transport) == 0
    text = capsys.readouterr().out
    assert "Result: PARTIAL CONFORMANCE (Level 0 - Core)" in text
    assert "With excused tests: CONFORMANT (Level 2 - Scheduled)" in text
    assert ("excused T-1-done (fail): it cannot pass: the stub never finishes things."
            in text)
    assert await run.main([*argv, "--min-level", "1"], transport) == 1  # no excuse: level 0
    assert "level 0 (with excused tests) is below --min-level 1" in capsys.readouterr().err
    assert await run.main([*argv, "--excused", str(excused), "--json"], transport) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["conformant_level"], report["conformant_level_excused"]) == (0, 2)
    assert [e["test_id"] for e in report["excused"]] == ["T-1-done"]
    excused.write_text('[[excused]]\ntest_id = "T-1-done"\n')
    assert await run.main([*argv, "--excused", str(excused)], transport) == 2
    assert "needs test_id and a reason" in capsys.readouterr().err


async def test_urls_come_from_the_environment_and_a_token_is_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_suite(tmp_path, stub_case(0, "new"))
    hosts: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hosts.append((request.url.host, request.headers.get("authorization")))
        return stub(request)

    monkeypatch.setenv("OJS_TEST_URL", "http://one:1, http://two:2/")
    argv = ["--levels", "0", "--suites", str(tmp_path), "--token", "sekrit"]
    assert await run.main(argv, httpx.MockTransport(handler)) == 0
    assert hosts == [("one", "Bearer sekrit"), ("two", "Bearer sekrit")]
    assert run.urls_of(["http://a,http://b", "http://c"]) == ["http://a", "http://b", "http://c"]


def test_the_excused_file_names_l1_rtr_014_with_its_reason() -> None:
    excused = run.read_excused(str(Path(run.__file__).with_name("excused.toml")))
    assert list(excused) == ["L1-RTR-014"]
    assert "error_class" in excused["L1-RTR-014"]
