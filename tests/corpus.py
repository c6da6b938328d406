"""The hostile corpus, as data: JSON values, whole bodies, path segments, query values
and header values that have broken JSON services before. tests/server/test_hostile.py sends
each to every place Rota reads input; tests/unit/test_fuzz.py draws from the same extremes.

A value is (name, raw JSON bytes, refused): ``refused`` says that no field anywhere may
take it (it is not JSON Rota accepts at all); the others are JSON, and each field decides
for itself, within its documented type and range.
"""

from __future__ import annotations

Value = tuple[str, bytes, bool]

FORGED = "FORGED-LOG-LINE"  # must never start a line of the server's log

VALUES: list[Value] = [
    # depth: past the limit, far past it (msgspec would recurse), and just inside it
    ("depth 65", b"[" * 65 + b"]" * 65, True),
    ("depth 40,000 arrays", b"[" * 40_000 + b"]" * 40_000, True),
    ("depth 20,000 objects", b'{"a":' * 20_000 + b"1" + b"}" * 20_000, True),
    ("depth 10", b"[" * 10 + b"]" * 10, False),
    # numbers at the edges of 64 bits, of doubles, and past them
    ("2^63", b"9223372036854775808", False),
    ("-2^63-1", b"-9223372036854775809", False),
    ("2^63-1", b"9223372036854775807", False),
    ("2^64", b"18446744073709551616", False),
    ("2^31", b"2147483648", False),
    ("10^400", b"1" + b"0" * 400, False),
    ("1e309", b"1e309", True),
    ("-1e309", b"-1e309", True),
    ("1e308", b"1e308", False),
    ("5e-324", b"5e-324", False),
    ("-0", b"-0", False),
    ("-0.0", b"-0.0", False),
    ("NaN token", b"NaN", True),
    ("Infinity token", b"Infinity", True),
    ("-Infinity token", b"-Infinity", True),
    ("leading zeros", b"007", True),
    ("hex", b"0x10", True),
    ("plus sign", b"+1", True),
    # Unicode
    ("lone high surrogate", b'"\\ud800"', True),
    ("lone low surrogate", b'"x\\udc00y"', True),
    ("surrogate pair", b'"\\ud83d\\ude00"', False),
    ("NUL escaped", b'"a\\u0000b"', False),
    ("right-to-left override", '"\u202egnp.exe"'.encode(), False),
    ("BOM in a string", '"\ufeffx"'.encode(), False),
    ("overlong UTF-8", b'"\xc0\xaf"', True),
    ("invalid UTF-8", b'"\xff\xfe"', True),
    ("UTF-8 encoded surrogate", b'"\xed\xa0\x80"', True),
    ("log forging", f'"x\\nERROR {FORGED} \\r\\n{FORGED}"'.encode(), False),
    ("ANSI escape", b'"\\u001b[31mred\\u001b[0m"', False),
    ("long string", b'"' + b"x" * 100_000 + b'"', False),
    # structure
    ("duplicate keys", b'{"a": 1, "a": 2}', False),
    ("empty object", b"{}", False),
    ("empty array", b"[]", False),
    ("long array", b"[" + b"1," * 50_000 + b"1]", False),
    ("null", b"null", False),
    ("true", b"true", False),
    ("empty string", b'""', False),
    ("a number", b"1.5", False),
    ("trailing garbage", b"1 x", True),
    ("unterminated", b'"abc', True),
    ("single quotes", b"'a'", True),
]

# Whole request bodies (or frames), in place of the JSON a route expects.
BODIES: list[tuple[str, bytes]] = [
    ("empty body", b""),
    ("whitespace", b" \r\n\t"),
    ("byte order mark", b'\xef\xbb\xbf{}'),
    ("trailing garbage", b"{} x"),
    ("two documents", b"{}{}"),
    ("top-level array", b"[]"),
    ("top-level string", b'"hello"'),
    ("top-level number", b"17"),
    ("top-level null", b"null"),
    ("invalid UTF-8", b'{"a": "\xff"}'),
    ("NUL byte raw", b'{"a": "\x00"}'),
    ("control character raw", b'{"a": "\x07"}'),
    ("deep", b"[" * 100_000 + b"]" * 100_000),
    ("not JSON", b"<html>"),
]

# Path segments, already percent-encoded as a client would put them in a URL.
SEGMENTS: list[tuple[str, str]] = [
    ("NUL", "a%00b"),
    ("invalid UTF-8", "%FF%FE"),
    ("UTF-8 encoded surrogate", "%ED%A0%80"),
    ("overlong", "%C0%AF"),
    ("right-to-left override", "%E2%80%AEgnp"),
    ("newline", f"x%0A{FORGED}"),
    ("ANSI escape", "%1B%5B31m"),
    ("dot segments", "..%2F..%2Fetc%2Fpasswd"),
    # a stored job's id and an encoded slash: decoded before routing, it would name that
    # job (its result, or a redirect of DELETE to it)
    ("encoded slash", "keep-available%2Fresult"),
    ("encoded trailing slash", "keep-available%2F"),
    ("encoded dot segment", "x%2F..%2Fkeep-available"),
    ("space", "a%20b"),
    ("very long", "a" * 8_000),
    ("percent alone", "%"),
    ("bad escape", "%zz"),
]

# Job ids a producer may give, each with the characters that break URLs, logs or
# terminals: (name, id, why) where ``why`` is None for an id Rota accepts (it must then be
# reachable through every route: the API, both SDK clients, the CLI and the dashboard),
# else what the refusal (422 invalid_id) must name: the character, or the length.
JOB_IDS: list[tuple[str, str, str | None]] = [
    ("every punctuation allowed", "a_b.c:d@e+f=g-h", None),
    ("dots inside", "a..b", None),
    ("trailing dot", "a.", None),
    ("plus and equals", "1+1=2", None),
    ("an e-mail address", "user@example.com", None),
    ("a URN", "urn:order:17", None),
    ("named like a bulk route", "retry", None),
    ("named like a route", "cancel", None),
    ("named like the batch route", "batch", None),
    ("128 characters", "a" * 128, None),
    ("slash", "tenant-7/order-17", "U+002F '/' at character 9"),
    ("dot segments", "a/../victim", "U+002F '/' at character 2"),
    ("backslash", "a\\..\\victim", "U+005C '\\\\' at character 2"),
    ("dot", ".", "starts with U+002E '.'"),
    ("dot dot", "..", "starts with U+002E '.'"),
    ("leading dash", "-a", "starts with U+002D '-'"),
    ("space", "a b", "U+0020 at character 2"),
    ("tab", "a\tb", "U+0009 at character 2"),
    ("newline", f"a\nERROR {FORGED}", "U+000A at character 2"),
    ("NUL", "a\x00b", "U+0000 at character 2"),
    ("ANSI escape", "a\x1b[31m", "U+001B at character 2"),
    ("DEL", "a\x7f", "U+007F at character 2"),
    ("question mark", "a?b", "U+003F '?' at character 2"),
    ("hash", "a#b", "U+0023 '#' at character 2"),
    ("percent", "a%2Fb", "U+0025 '%' at character 2"),
    ("a letter outside ASCII", "café", "U+00E9 'é' at character 4"),
    ("right-to-left override", "a\u202eb", "U+202E at character 2"),
    ("129 characters", "a" * 129, "129 characters long"),
    ("empty", "", "is empty"),
]

# Query values for numbers (``wait``), raw in the URL.
NUMBERS_IN_QUERY: list[tuple[str, str]] = [
    ("negative", "-1"), ("nan", "nan"), ("inf", "inf"), ("-inf", "-inf"), ("1e309", "1e309"),
    ("huge", "9" * 400), ("empty", ""), ("word", "abc"), ("hex", "0x10"),
    ("underscore", "1_0"), ("NUL", "%00"), ("invalid UTF-8", "%FF"), ("spaces", "%201%20"),
    ("tiny", "1e-320"), ("two values", "1&wait=2"),
]

# Names in a job filter (GET /jobs, POST /jobs/retry|cancel, GET /events) that are well
# formed but name nothing the server knows, against a server with specs echo, parked and
# hostile in queue default: (name, field, value, code). Each would match no job, so a bulk
# action would look done (or a stream follow nothing); each is refused instead (issue 22).
FILTER_NAMES: list[tuple[str, str, str, str]] = [
    ("misspelt spec", "spec", "ecoh", "unknown_spec"),
    ("a spec's name cut short", "spec", "park", "unknown_spec"),
    ("a spec in the wrong case", "spec", "Echo", "unknown_spec"),
    ("misspelt queue", "queue", "defualt", "unknown_queue"),
    ("a queue nobody named", "queue", "nowhere", "unknown_queue"),
]

# Queue names a pause, a resume or an enqueue gives that are slips for the known queue
# default: each would make a queue anew while the one meant runs on, or leave a job
# waiting forever; each is refused (422 unknown_queue, issue 22).
QUEUE_SLIPS: list[tuple[str, str]] = [
    ("misspelt", "defualt"), ("wrong case", "Default"), ("a letter short", "defaul"),
]

# Flow control (README, Flow control) that no server can hold a job to, against the same
# server (spec parked): (name, method, path, body, code). Each is refused with a 4xx
# naming the field, and nothing is stored.
FLOW_SLIPS: list[tuple[str, str, str, object, str]] = [
    ("concurrency 0", "PUT", "/limits/spec/parked", {"concurrency": 0}, "invalid_limit"),
    ("negative key concurrency", "PUT", "/limits/spec/parked", {"key_concurrency": -1},
     "invalid_limit"),
    ("unknown field", "PUT", "/limits/spec/parked", {"concurency": 3}, "invalid_limit"),
    ("unknown scope kind", "PUT", "/limits/tenant/parked", {"concurrency": 3}, "invalid_limit"),
    ("burst over the limit", "PUT", "/limits/spec/parked",
     {"rate": {"limit": 5, "period": 1, "burst": 9}}, "invalid_limit"),
    ("period over a day", "PUT", "/limits/spec/parked", {"rate": "5/2d"}, "invalid_limit"),
    ("a rate of nothing", "PUT", "/limits/spec/parked", {"key_rate": "0/min"}, "invalid_limit"),
    ("an empty rule", "PUT", "/limits/spec/parked", {}, "invalid_limit"),
    ("a misspelt spec", "PUT", "/limits/spec/prked", {"concurrency": 3}, "unknown_spec"),
    ("a label too long", "POST", "/jobs", {"spec": "parked", "labels": ["x" * 129]},
     "invalid_request"),
    ("17 labels", "POST", "/jobs", {"spec": "parked", "labels": [f"l{n}" for n in range(17)]},
     "invalid_request"),
    ("a key that is no name", "POST", "/jobs", {"spec": "parked", "concurrency_key": "a b"},
     "invalid_request"),
]

# Cron schedules (README, Cron schedules) that no server may keep, put at
# /schedules/hostile-sched against the same server (spec parked): (name, body, code). Each
# is refused with a 422 naming what is wrong, and nothing is stored.
SCHEDULE_SLIPS: list[tuple[str, dict[str, object], str]] = [
    ("faster than once a second", {"spec": "parked", "cron": "@every 500ms"}, "invalid_cron"),
    ("a tiny interval", {"spec": "parked", "cron": "@every 1ms"}, "invalid_cron"),
    ("minute 61", {"spec": "parked", "cron": "61 * * * *"}, "invalid_cron"),
    ("seven fields", {"spec": "parked", "cron": "0 0 0 * * * *"}, "invalid_cron"),
    ("an empty expression", {"spec": "parked", "cron": " "}, "invalid_cron"),
    ("a fixed offset", {"spec": "parked", "cron": "@daily", "timezone": "UTC+5"},
     "invalid_timezone"),
    ("an abbreviation", {"spec": "parked", "cron": "@daily", "timezone": "PST"},
     "invalid_timezone"),
    ("no such zone", {"spec": "parked", "cron": "@daily", "timezone": "Mars/Olympus_Mons"},
     "invalid_timezone"),
    ("a zone path", {"spec": "parked", "cron": "@daily", "timezone": "../../etc/passwd"},
     "invalid_timezone"),
    ("catch_up 0", {"spec": "parked", "cron": "@daily", "catch_up": 0}, "invalid_schedule"),
    ("catch_up 1001", {"spec": "parked", "cron": "@daily", "catch_up": 1001},
     "invalid_schedule"),
    ("jitter over an hour", {"spec": "parked", "cron": "@daily", "jitter": 3601},
     "invalid_schedule"),
    ("an unknown policy", {"spec": "parked", "cron": "@daily", "overlap": "queue"},
     "invalid_schedule"),
    ("an unknown field", {"spec": "parked", "cron": "@daily", "every": 5}, "invalid_schedule"),
    ("args not an object", {"spec": "parked", "cron": "@daily", "args": [1]},
     "invalid_schedule"),
    ("no expression", {"spec": "parked"}, "invalid_schedule"),
    ("fractional seconds", {"spec": "parked", "cron": "@every 1.5s"}, "invalid_cron"),
    ("a billion hours", {"spec": "parked", "cron": "@every 1000000000h"}, "invalid_cron"),
    ("400 nines of seconds", {"spec": "parked", "cron": "@every " + "9" * 400 + "s"},
     "invalid_cron"),
    ("Arabic-Indic digits", {"spec": "parked", "cron": "@every \u0661\u0660s"}, "invalid_cron"),
    ("no unit", {"spec": "parked", "cron": "@every 90"}, "invalid_cron"),
    ("a newline inside", {"spec": "parked", "cron": "0 0\n* * *"}, "invalid_cron"),
]

# Values for the Authorization header, as bytes on the wire.
AUTHORIZATIONS: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("scheme only", b"Bearer"),
    ("empty token", b"Bearer "),
    ("other scheme", b"Basic dXNlcjpwYXNz"),
    ("long token", b"Bearer rota_" + b"A" * 6_000),
    ("not a Rota token", b"Bearer abc.def.ghi"),
    ("latin-1 bytes", b"Bearer rota_\xe9\xff"),
    ("control character", b"Bearer rota_\x07\x1b[31m"),
    ("two spaces", b"Bearer  rota_x_y"),
    ("well formed, of no server", b"Bearer rota_0123456789ab_" + b"x" * 43),
    ("lower-case scheme", b"bearer rota_0123456789ab_" + b"x" * 43),
]

# Values for the Origin header of a /work handshake.
ORIGINS: list[tuple[str, bytes]] = [
    ("null", b"null"),
    ("another site", b"https://evil.example"),
    ("ANSI escape", b"\x1b[31mred"),
    ("latin-1 bytes", b"https://\xe9\xff"),
    ("very long", b"https://" + b"a" * 6_000),
]

# Values for the Content-Length header, with a body of 2 bytes ("{}").
CONTENT_LENGTHS: list[tuple[str, bytes]] = [
    ("word", b"abc"),
    ("negative", b"-1"),
    ("huge", b"9" * 40),
    ("shorter than the body", b"1"),
    ("plus sign", b"+2"),
    ("spaces", b" 2 "),
]

# Unique options that contradict themselves or the job (docs/protocol.md, Unique jobs): each
# is refused with 422 invalid_unique, with these words, and nothing is stored. Sent with
# args {"user": 1}.
UNIQUE_OPTIONS: list[tuple[str, dict[str, object], str]] = [
    ("key with keys", {"key": "k", "keys": ["args"]}, "not both"),
    ("args_keys without args", {"keys": ["spec"], "args_keys": ["user"]}, 'needs "args"'),
    ("args_keys naming a missing arg", {"keys": ["args"], "args_keys": ["nobody"]},
     "'nobody', which the job's args do not have"),
    ("replace of finished jobs", {"states": "finished", "on_conflict": "replace",
                                  "period": 5}, "cannot be replaced"),
    ("finished with no period", {"states": "finished"}, "needs a period"),
    ("a dimension twice", {"keys": ["args", "args"]}, "twice"),
    ("an argument twice", {"keys": ["args"], "args_keys": ["user", "user"]}, "twice"),
]


# Workflows (POST /workflows) no server can run, against the same server (spec parked):
# (name, body, status, code). Each is refused with a 4xx naming the step, and nothing of
# it is stored (no workflow, no job).
_JOB = {"spec": "parked"}
WORKFLOW_SLIPS: list[tuple[str, object, int, str]] = [
    ("an empty chain", {"type": "chain", "steps": []}, 422, "empty_workflow"),
    ("a batch without callbacks", {"type": "batch", "jobs": [_JOB], "callbacks": {}}, 422,
     "invalid_workflow"),
    ("a group with callbacks (never run)", {"type": "group", "jobs": [_JOB],
                                            "callbacks": {"on_complete": _JOB}}, 422,
     "invalid_workflow"),
    ("an unknown primitive", {"type": "dag", "nodes": [_JOB]}, 422, "invalid_workflow"),
    ("a step that is no object", {"type": "chain", "steps": [_JOB, 7]}, 422,
     "invalid_workflow"),
    ("a misspelt spec deep inside", {"type": "chain", "steps": [_JOB, {
        "type": "group", "jobs": [_JOB, {"spec": "prked"}]}]}, 422, "unknown_spec"),
    ("a cycle, by a repeated id", {"type": "chain", "id": "loop", "steps": [
        {"type": "chain", "id": "loop", "steps": [_JOB]}]}, 422, "invalid_workflow"),
    ("five deep", {"type": "chain", "steps": [{"type": "group", "jobs": [{"type": "chain",
     "steps": [{"type": "group", "jobs": [{"type": "batch", "jobs": [_JOB],
                                           "callbacks": {"on_complete": _JOB}}]}]}]}]},
     422, "workflow_too_deep"),
    ("a step's own id", {"type": "group", "jobs": [{"spec": "parked", "id": "mine"}]}, 422,
     "invalid_workflow"),
    ("a step's run_at", {"type": "group", "jobs": [{"spec": "parked",
                                                   "run_at": "2030-01-01T00:00:00Z"}]},
     422, "invalid_workflow"),
    ("a workflow id with a slash", {"type": "group", "id": "a/b", "jobs": [_JOB]}, 422,
     "invalid_id"),
    ("a name with a newline", {"type": "group", "name": f"x\nERROR {FORGED}", "jobs": [_JOB]},
     422, "invalid_workflow"),
    ("10,001 jobs", {"type": "group", "jobs": [_JOB] * 10_001}, 422, "workflow_too_large"),
    ("a misspelt queue in a step", {"type": "chain", "steps": [
        _JOB, {"spec": "parked", "queue": "defualt"}]}, 422, "unknown_queue"),
]


# [execute] tables (push execution) a spec push must refuse with a 422 naming what is
# wrong, at PUT /specs and in one line of `rota specs push`: (name, the table, a fragment
# of the message). Each is in a spec that is otherwise valid, pushed dry-run.
_EXEC = {"url": "https://example.com/hook", "secret": "hostile-exec"}
EXECUTE_SLIPS: list[tuple[str, object, str]] = [
    ("an ftp URL", {**_EXEC, "url": "ftp://example.com/x"}, "url"),
    ("a file URL", {**_EXEC, "url": "file:///etc/passwd"}, "url"),
    ("a javascript URL", {**_EXEC, "url": "javascript:alert(1)"}, "url"),
    ("a URL with no host", {**_EXEC, "url": "http:///x"}, "url"),
    ("a URL with userinfo", {**_EXEC, "url": "https://user:pw@example.com/"}, "url"),
    ("a URL with a fragment", {**_EXEC, "url": "https://example.com/#x"}, "url"),
    ("an empty URL", {**_EXEC, "url": ""}, "url"),
    ("a URL with a newline", {**_EXEC, "url": f"https://example.com/\nERROR {FORGED}"}, "url"),
    ("a URL with a space", {**_EXEC, "url": "https://exa mple.com/"}, "url"),
    ("a URL of 3,000 characters", {**_EXEC, "url": "https://example.com/" + "a" * 3000},
     "url"),
    ("a URL of a bad port", {**_EXEC, "url": "https://example.com:99999/"}, "url"),
    ("timeout 0", {**_EXEC, "timeout": 0}, "timeout"),
    ("a negative timeout", {**_EXEC, "timeout": -1}, "timeout"),
    ("timeout past 900 s", {**_EXEC, "timeout": 901}, "timeout"),
    ("timeout a string", {**_EXEC, "timeout": "30"}, "timeout"),
    ("max_in_flight 0", {**_EXEC, "max_in_flight": 0}, "max_in_flight"),
    ("max_in_flight huge", {**_EXEC, "max_in_flight": 10**12}, "max_in_flight"),
    ("max_in_flight 1.5", {**_EXEC, "max_in_flight": 1.5}, "max_in_flight"),
    ("a reserved header", {**_EXEC, "headers": {"Content-Type": "text/plain"}}, "Content-Type"),
    ("a signature header", {**_EXEC, "headers": {"X-Rota-Signature": "sha256=0"}},
     "X-Rota-Signature"),
    ("a Host header", {**_EXEC, "headers": {"Host": "internal"}}, "Host"),
    ("a header name with a colon", {**_EXEC, "headers": {"X-A:b": "c"}}, "headers"),
    ("a header name with a space", {**_EXEC, "headers": {"X A": "c"}}, "headers"),
    ("an empty header name", {**_EXEC, "headers": {"": "c"}}, "headers"),
    ("a header value with a newline", {**_EXEC, "headers": {"X-A": f"b\r\nX-Evil: {FORGED}"}},
     "headers"),
    ("a header value with NUL", {**_EXEC, "headers": {"X-A": "b\x00c"}}, "headers"),
    ("33 headers", {**_EXEC, "headers": {f"X-H{i}": "v" for i in range(33)}}, "headers"),
    ("headers a list", {**_EXEC, "headers": ["X-A: b"]}, "headers"),
    ("a secret name with a slash", {**_EXEC, "secret": "a/b"}, "secret"),
    ("a secret set nowhere", {**_EXEC, "secret": "nowhere-set"}, "nowhere-set"),
    ("no secret", {"url": "https://example.com/hook"}, "secret"),
    ("no URL", {"secret": "hostile-exec"}, "url"),
    ("an unknown key", {**_EXEC, "retries": 3}, "retries"),
    ("execute a string", "https://example.com/hook", "execute"),
]
