"""Unit tests for rota.base.specs: TOML loading, the canonical checksum and argument checks."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import Live
from helpers import free_port, rota

from rota.base.specs import (
    JobSpec,
    SpecError,
    canonical_bytes,
    checksum,
    load_dir,
    load_spec,
    parse_spec,
    spec_from_builtins,
    validate_args,
)

SHIPPED_SPECS = Path(__file__).resolve().parents[2] / "specs"

BASE = """\
name = "resize"
version = "1.0.0"
description = "Resize an image."
queue = "media"
visibility_timeout = 300

[retry]
max_attempts = 5
backoff_base = 2.0

[args.url]
type = "string"

[args.width]
type = "integer"
required = false
"""


def write(folder: Path, filename: str, text: str) -> Path:
    path = folder / filename
    path.write_text(text)
    return path


def sum_of(folder: Path, text: str, filename: str = "spec.toml") -> str:
    """Checksum of ``text`` after it went through a real file on disk."""
    return checksum(load_spec(write(folder, filename, text)))


# -- checksum: format and stability --------------------------------------------------
def test_checksum_format(tmp_path: Path) -> None:
    value = sum_of(tmp_path, BASE)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", value)


def test_checksum_ignores_key_order_whitespace_and_comments(tmp_path: Path) -> None:
    reordered = """\
# The same spec, written differently.

[args.width]
required   =   false   # optional
type = "integer"

[args.url]
type="string"

[retry]
backoff_base = 2.0
max_attempts = 5
"""
    # TOML puts top-level keys before tables, so they go in a separate block up front.
    head = """\
   visibility_timeout = 300
queue = "media"

description = "Resize an image."
version = "1.0.0"   # semver
name = "resize"

"""
    assert sum_of(tmp_path, head + reordered, "b.toml") == sum_of(tmp_path, BASE, "a.toml")


def test_checksum_ignores_explicit_defaults(tmp_path: Path) -> None:
    minimal = 'name = "echo"\nversion = "1"\n\n[args.message]\ntype = "string"\n'
    explicit = """\
name = "echo"
version = "1"
description = ""
queue = "default"
priority = 0

[retry]
max_attempts = 25
backoff_base = 1.0
backoff_max = 3600.0

[args.message]
type = "string"
description = ""
required = true
"""
    assert sum_of(tmp_path, explicit, "b.toml") == sum_of(tmp_path, minimal, "a.toml")


def test_checksum_ignores_empty_tables(tmp_path: Path) -> None:
    minimal = 'name = "echo"\nversion = "1"\n'
    with_tables = 'name = "echo"\nversion = "1"\n[retry]\n[args]\n'
    assert sum_of(tmp_path, with_tables, "b.toml") == sum_of(tmp_path, minimal, "a.toml")


def test_checksum_treats_int_and_float_alike(tmp_path: Path) -> None:
    as_int = BASE
    as_float = BASE.replace("visibility_timeout = 300", "visibility_timeout = 300.0")
    as_float = as_float.replace("backoff_base = 2.0", "backoff_base = 2")
    assert as_float != as_int
    assert sum_of(tmp_path, as_float, "b.toml") == sum_of(tmp_path, as_int, "a.toml")


@pytest.mark.parametrize(("old", "new"), [
    ('version = "1.0.0"', 'version = "1.0.1"'),
    ('description = "Resize an image."', 'description = "Resize a picture."'),
    ('queue = "media"', 'queue = "images"'),
    ('[args.width]\ntype = "integer"', '[args.width]\ntype = "number"'),
    ("max_attempts = 5", "max_attempts = 6"),
    ("backoff_base = 2.0", "backoff_base = 3.0"),
    ("max_attempts = 5", "max_attempts = 5\nmax_fails = 2"),
    ("visibility_timeout = 300", "visibility_timeout = 301"),
    ("required = false", "required = true"),
])
def test_checksum_changes_with_content(tmp_path: Path, old: str, new: str) -> None:
    assert old in BASE
    changed = BASE.replace(old, new)
    assert sum_of(tmp_path, changed, "b.toml") != sum_of(tmp_path, BASE, "a.toml")


def test_checksum_changes_when_an_arg_is_added(tmp_path: Path) -> None:
    more = BASE + '\n[args.height]\ntype = "integer"\n'
    assert sum_of(tmp_path, more, "b.toml") != sum_of(tmp_path, BASE, "a.toml")


def test_checksum_survives_json_transport(tmp_path: Path) -> None:
    # The CLI pushes msgspec.to_builtins(spec) as JSON; the server rebuilds the spec.
    for path in [write(tmp_path, "resize.toml", BASE), *sorted(SHIPPED_SPECS.glob("*.toml"))]:
        spec = load_spec(path)
        wire = msgspec.json.decode(msgspec.json.encode(msgspec.to_builtins(spec)))
        rebuilt = spec_from_builtins(wire)
        assert rebuilt == spec
        assert checksum(rebuilt) == checksum(spec), path.name


def test_spec_from_builtins_rejects_bad_data() -> None:
    with pytest.raises(SpecError):
        spec_from_builtins({"name": "x", "version": "1", "colour": "red"})
    with pytest.raises(SpecError):
        spec_from_builtins({"name": "bad name", "version": "1"})
    with pytest.raises(SpecError):
        spec_from_builtins({"name": "x"})


def test_canonical_bytes_are_sorted_and_compact() -> None:
    spec = parse_spec('version = "2"\nname = "tiny"\npriority = 3\n'
                      '[args.n]\ntype = "integer"\ndescription = "How many."\n')
    assert canonical_bytes(spec) == (
        b'{"args":{"n":{"description":"How many.","type":"integer"}},'
        b'"name":"tiny","priority":3,"version":"2"}'
    )


def test_canonical_bytes_sort_arg_names() -> None:
    spec = parse_spec('name = "t"\nversion = "1"\n[args.zeta]\n[args.alpha]\n[args.mid]\n')
    assert canonical_bytes(spec) == (
        b'{"args":{"alpha":{},"mid":{},"zeta":{}},"name":"t","version":"1"}'
    )


def test_canonical_bytes_keep_non_default_retry_fields_only() -> None:
    spec = parse_spec('name = "t"\nversion = "1"\n[retry]\nmax_attempts = 3\nbackoff_max = 3600\n')
    assert canonical_bytes(spec) == b'{"name":"t","retry":{"max_attempts":3},"version":"1"}'


# -- load_dir --------------------------------------------------------------------------
def test_load_dir_sorted_by_spec_name(tmp_path: Path) -> None:
    # File names sort the other way round from spec names.
    write(tmp_path, "a.toml", 'name = "zulu"\nversion = "1"\n')
    write(tmp_path, "b.toml", 'name = "alpha"\nversion = "1"\n')
    write(tmp_path, "c.toml", 'name = "mike"\nversion = "1"\n')
    write(tmp_path, "notes.txt", "not a spec")
    assert [s.name for s in load_dir(tmp_path)] == ["alpha", "mike", "zulu"]
    assert [s.name for s in load_dir(str(tmp_path))] == ["alpha", "mike", "zulu"]


def test_load_dir_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SpecError, match="nope"):
        load_dir(missing)


def test_load_dir_given_a_file(tmp_path: Path) -> None:
    path = write(tmp_path, "one.toml", 'name = "one"\nversion = "1"\n')
    with pytest.raises(SpecError):
        load_dir(path)


def test_load_dir_empty_directory(tmp_path: Path) -> None:
    write(tmp_path, "README.md", "# no specs here")
    with pytest.raises(SpecError, match="no"):
        load_dir(tmp_path)


def test_load_dir_duplicate_spec_name(tmp_path: Path) -> None:
    write(tmp_path, "first.toml", 'name = "same"\nversion = "1"\n')
    write(tmp_path, "second.toml", 'name = "same"\nversion = "2"\n')
    with pytest.raises(SpecError) as info:
        load_dir(tmp_path)
    assert "second.toml" in str(info.value)
    assert "same" in str(info.value)


@pytest.mark.parametrize(("text", "fragment"), [
    ('name = "x"\nversion = "1"\ncolour = "red"\n', "colour"),
    ('name = "x"\nversion = "1"\n[retry]\nmax_tries = 3\n', "max_tries"),
    ('name = "x"\nversion = "1"\n[args.a]\ntype = "string"\ndefault = "hi"\n', "default"),
])
def test_load_dir_unknown_fields(tmp_path: Path, text: str, fragment: str) -> None:
    write(tmp_path, "ok.toml", 'name = "ok"\nversion = "1"\n')
    write(tmp_path, "broken.toml", text)
    with pytest.raises(SpecError) as info:
        load_dir(tmp_path)
    assert "broken.toml" in str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize("name", ["", "has space", "-leading-dash", "_under", "é", "x" * 129])
def test_load_dir_invalid_name(tmp_path: Path, name: str) -> None:
    write(tmp_path, "bad.toml", f'name = "{name}"\nversion = "1"\n')
    with pytest.raises(SpecError, match="bad.toml"):
        load_dir(tmp_path)


@pytest.mark.parametrize("name", ["a", "Send.Email", "v2:resize-image_x", "x" * 128])
def test_valid_names(tmp_path: Path, name: str) -> None:
    write(tmp_path, "ok.toml", f'name = "{name}"\nversion = "1"\n')
    assert [s.name for s in load_dir(tmp_path)] == [name]


@pytest.mark.parametrize("text", [
    'name = "x"\nversion = \n',
    'name = "x"\nversion = "1"\n[retry\n',
    'name = "x"\nname = "y"\nversion = "1"\n',
])
def test_load_dir_malformed_toml(tmp_path: Path, text: str) -> None:
    write(tmp_path, "garbled.toml", text)
    with pytest.raises(SpecError, match="garbled.toml"):
        load_dir(tmp_path)


@pytest.mark.parametrize("text", [
    'name = "x"\n',  # no version
    'name = "x"\nversion = "1"\nvisibility_timeout = 0\n',
    'name = "x"\nversion = "1"\n[retry]\nmax_attempts = 0\n',
    'name = "x"\nversion = "1"\n[args.a]\ntype = "str"\n',
    'name = "x"\nversion = "1"\npriority = "high"\n',
])
def test_invalid_values_rejected(tmp_path: Path, text: str) -> None:
    write(tmp_path, "invalid.toml", text)
    with pytest.raises(SpecError, match="invalid.toml"):
        load_dir(tmp_path)


def test_shipped_example_specs_load() -> None:
    specs = load_dir(SHIPPED_SPECS)
    names = [s.name for s in specs]
    assert names == sorted(names)
    assert len(names) == len(list(SHIPPED_SPECS.glob("*.toml"))) >= 1
    for spec in specs:
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", checksum(spec))


# -- validate_args ---------------------------------------------------------------------
def spec_with(args: str) -> JobSpec:
    return parse_spec('name = "t"\nversion = "1"\n' + args)


TYPED = spec_with("""
[args.s]
type = "string"
[args.i]
type = "integer"
[args.n]
type = "number"
[args.b]
type = "boolean"
[args.o]
type = "object"
[args.a]
type = "array"
[args.x]
type = "any"
[args.maybe]
type = "string"
required = false
""")

GOOD: dict[str, Any] = {"s": "text", "i": 3, "n": 2.5, "b": False, "o": {"k": 1}, "a": [1],
                        "x": None, "maybe": "here"}


def test_spec_without_args_accepts_anything() -> None:
    spec = spec_with("")
    validate_args(spec, {})
    validate_args(spec, {"whatever": [1, {"deep": True}], "n": None})


def test_valid_args_pass() -> None:
    validate_args(TYPED, GOOD)


def test_optional_arg_may_be_absent() -> None:
    args = dict(GOOD)
    del args["maybe"]
    validate_args(TYPED, args)


def test_missing_required_arg() -> None:
    args = dict(GOOD)
    del args["i"]
    with pytest.raises(SpecError, match="'i'"):
        validate_args(TYPED, args)


def test_unknown_arg() -> None:
    with pytest.raises(SpecError, match="surprise"):
        validate_args(TYPED, {**GOOD, "surprise": 1})


def test_int_is_accepted_for_number() -> None:
    validate_args(TYPED, {**GOOD, "n": 7})


@pytest.mark.parametrize("value", [None, "anything", 1, 1.5, True, [], {}])
def test_any_accepts_every_json_value(value: Any) -> None:
    validate_args(TYPED, {**GOOD, "x": value})


@pytest.mark.parametrize(("name", "value"), [
    ("s", 5),
    ("s", None),
    ("i", "5"),
    ("i", True),  # bool is not an integer in JSON
    ("i", 2.0),
    ("n", "2.5"),
    ("n", False),  # nor a number
    ("b", 1),
    ("b", "true"),
    ("o", [1, 2]),
    ("o", "{}"),
    ("a", {"0": 1}),
    ("a", "[]"),
    ("maybe", 3),  # an optional arg, when present, is still type-checked
])
def test_type_mismatch(name: str, value: Any) -> None:
    with pytest.raises(SpecError, match=rf"^args\.{name} must be (a|an|true) .*, got (a|an|null)"):
        validate_args(TYPED, {**GOOD, name: value})


def test_the_repositorys_specs_are_real_files_the_same_as_the_packages():
    """Users copy specs/ (README); links there were left dangling by the copy. The
    package's rota/demo_specs (what `rota demo` runs) is the same set of files."""
    shipped = Path(__file__).resolve().parents[2] / "rota" / "demo_specs"
    names = sorted(p.name for p in SHIPPED_SPECS.glob("*.toml"))
    assert names == sorted(p.name for p in shipped.glob("*.toml")) and names
    for name in names:
        assert not (SHIPPED_SPECS / name).is_symlink(), name
        assert (SHIPPED_SPECS / name).read_bytes() == (shipped / name).read_bytes(), name


def _unreadable(folder: Path, kind: str) -> None:
    if kind == "dangling symlink":
        (folder / "x.toml").symlink_to("../rota/demo_specs/x.toml")
    elif kind == "directory":
        (folder / "x.toml").mkdir()
    elif kind == "not UTF-8":
        (folder / "x.toml").write_bytes(b'name = "caf\xe9"\nversion = "1"\n')
    else:
        (folder / "x.toml").write_text('name = "x"\nversion = "1"\n')
        (folder / "x.toml").chmod(0)


UNREADABLE = {"dangling symlink": "cannot be read: it is a symlink to ../rota/demo_specs/x.toml,"
              " which does not exist (copy the files, not the links: cp -L)",
              "directory": "cannot be read: Is a directory",
              "not UTF-8": "not UTF-8 text (byte 11 is 0xe9): save it as UTF-8",
              "no permission": "cannot be read: Permission denied"}


@pytest.mark.parametrize("kind", list(UNREADABLE))
def test_an_unreadable_spec_file_is_one_spec_error(tmp_path: Path, kind: str):
    if kind == "no permission" and os.geteuid() == 0:
        pytest.skip("root reads any file")
    _unreadable(tmp_path, kind)
    with pytest.raises(SpecError) as refused:
        load_dir(tmp_path)
    assert str(refused.value) == f"{tmp_path / 'x.toml'}: {UNREADABLE[kind]}"


async def test_an_unreadable_spec_file_is_one_line_from_push_and_worker(
        live: Live, tmp_path: Path):
    """`rota specs push` once ended in a traceback for a copied folder of dangling links
    (then for a file not in UTF-8); `rota worker` loads its folder the same way."""
    folder = tmp_path / "specs"
    folder.mkdir()
    (tmp_path / "w.py").write_text("from rota import Worker\nworker = Worker(specs_dir='specs')"
                                   "\nworker.handler('x')(lambda ctx: None)\n")
    for kind in ("dangling symlink", "not UTF-8"):
        for old in folder.iterdir():
            old.unlink()
        _unreadable(folder, kind)
        code, out, err = await rota("specs", "push", str(folder), "--url", live.base)
        assert (code, out, err) == (1, "", f"error: {folder / 'x.toml'}: {UNREADABLE[kind]}\n")
        code, out, err = await rota("worker", "w:worker", "--url", live.base, cwd=tmp_path)
        errors = [line for line in err.splitlines() if "error" in line or "Traceback" in line]
        assert code == 1 and errors == [f"error: specs/x.toml: {UNREADABLE[kind]}"], err
    code, _, err = await rota("demo", "--specs", str(folder), "--port", str(free_port()),
                              "--db", str(tmp_path / "demo.db"))
    assert (code, err) == (1, f"error: {folder / 'x.toml'}: {UNREADABLE['not UTF-8']}\n")


def test_a_spec_files_mistake_is_said_in_plain_words() -> None:
    """msgspec's own wording (Expected `int` >= 1 - at `$.retry.max_attempts`) is not
    shown: the field is named, and what it takes is said."""
    for text, says in (
            ('[retry]\nmax_attempts = 0\n', "retry.max_attempts must be an integer >= 1"),
            ('queu = "x"\n', "queu is not a field Rota knows (known: name, version,"
             " description, queue, priority, visibility_timeout, retry, args, unique, labels,"
             " limits, execute)"),
            ('[args.w]\ntype = "int"\n', "args.w.type must be one of any, array, boolean,"
             " integer, number, object, string, not 'int'"),
            # The argument is named: it said "args[...].type", whichever it was.
            ('[args.a]\n[args.b]\ntype = "strin"\n[args.c]\n', "args.b.type must be one of"
             " any, array, boolean, integer, number, object, string, not 'strin'"),
            ('[args.a]\n[args.b]\nkind = "string"\n', "args.b.kind is not a field Rota knows"
             " (known: type, description, required)"),
            ('[args]\nok = {}\n"two words" = {}\n', "args: the key 'two words' must be a name"
             " of 1 to 128 letters, digits and '_.:-', starting with a letter or digit")):
        with pytest.raises(SpecError) as refused:
            parse_spec('name = "a"\nversion = "1"\n' + text, source="a.toml")
        assert str(refused.value) == f"a.toml: {says}"


def test_a_unique_table_is_checked_and_todays_spec_files_keep_their_checksums():
    # The specs shipped in specs/, checksummed before [unique] existed: unchanged.
    before = {"echo": "8d74b4c61a8c29f5719093394d7d363cfc79a739206f001b9db9a7f74f2c8935",
              "resize_image": "2c5982f67bf9df49371dc27d68594d3fdbdff5d4cc1e9ea4a737ee37bc9e33d6",
              "send_email": "ba095175d2753c37e7b2f98f4c07d9b3fc12722c93b90b9d02c71af38cce30cf"}
    for spec in load_dir(Path(__file__).parents[2] / "specs"):
        assert checksum(spec) == "sha256:" + before[spec.name], spec.name
    base = 'name = "a"\nversion = "1"\n'
    assert checksum(parse_spec(base)) != checksum(parse_spec(base + '[unique]\nkey = "k"\n'))
    with pytest.raises(SpecError, match="needs a period"):
        parse_spec(base + '[unique]\nstates = "finished"\n', source="a.toml")
    with pytest.raises(SpecError, match="does not declare in"):
        parse_spec(base + '[args.user]\ntype = "integer"\n[unique]\nkeys = ["args"]\n'
                   'args_keys = ["usr"]\n', source="a.toml")


# -- flow control: labels and [limits] ----------------------------------------------------
def test_todays_spec_files_keep_their_checksums():
    """labels and [limits] at their defaults add nothing: the checksums Rota gave these
    files before flow control existed."""
    folder = Path(__file__).resolve().parents[2] / "rota" / "demo_specs"
    assert {spec.name: checksum(spec) for spec in load_dir(folder)} == {
        "echo": "sha256:8d74b4c61a8c29f5719093394d7d363cfc79a739206f001b9db9a7f74f2c8935",
        "resize_image": "sha256:2c5982f67bf9df49371dc27d68594d3fdbdff5d4cc1e9ea4a737ee37bc9e33d6",
        "send_email": "sha256:ba095175d2753c37e7b2f98f4c07d9b3fc12722c93b90b9d02c71af38cce30cf"}
    plain = parse_spec('name = "a"\nversion = "1"\n')
    assert checksum(plain) == checksum(parse_spec(
        'name = "a"\nversion = "1"\nlabels = []\n[limits]\n'))


def test_a_spec_files_limits_and_labels():
    from rota.core.limits import LimitRule, Rate
    from rota.core.rulebook import rule_of, spec_rules

    spec = parse_spec('name = "send"\nversion = "1"\nlabels = ["smtp", "region:eu"]\n'
                      '[limits]\nconcurrency = 40\nkey_concurrency = 3\nrate = "5/s"\n'
                      'key_rate = {limit = 100, period = 60, burst = 10}\n')
    assert spec.labels == ["smtp", "region:eu"]
    assert spec.limits is not None and rule_of(spec.limits) == LimitRule(
        concurrency=40, key_concurrency=3, rate=Rate(5, 1.0),
        key_rate=Rate(100, 60.0, burst=10))
    assert spec_rules({"send": spec}) == {("spec", "send"): rule_of(spec.limits)}
    assert checksum(spec) != checksum(parse_spec('name = "send"\nversion = "1"\n'))
    for text, rate in (("100/min", Rate(100, 60.0)), ("1000/h", Rate(1000, 3600.0)),
                       ("10/30s", Rate(10, 30.0)), ("2 / 1 day", Rate(2, 86400.0))):
        assert rule_of(parse_spec(f'name = "a"\nversion = "1"\n[limits]\nrate = "{text}"\n'
                                  ).limits).rate == rate, text


@pytest.mark.parametrize(("text", "says"), [
    ('[limits]\nconcurrency = 0', "limits.concurrency must be an integer >= 1"),
    ('[limits]\nkey_concurrency = -1', "limits.key_concurrency must be an integer >= 1"),
    ('[limits]\nrate = "5/fortnight"', "limits.rate must be a rate such as 100/min, 5/s,"
     " 1000/h or 10/30s (units: s, sec, second, m, min, minute, h, hour, d, day), not"
     " '5/fortnight'"),
    ('[limits]\nkey_rate = "0/s"', "limits.key_rate must allow 1 to 2147483647 starts, not 0"),
    ('[limits]\nrate = "5/2d"', "limits.rate must have a period over 0 and at most a day"
     " (86400 s), not 172800 s"),
    ('[limits]\nrate = {limit = 5, period = 1, burst = 9}',
     "limits.rate must have a burst of at most its limit 5, not 9"),
    ('[limits]\nrate = {limit = 5, every = 1}', "limits.rate.every is not a field Rota knows"),
    ('[limits]\nconcurency = 3', "limits.concurency is not a field Rota knows (known:"
     " concurrency, rate, key_concurrency, key_rate)"),
    (f'labels = ["{"x" * 129}"]', "labels[0] must be a name of 1 to 128 letters, digits and"
     " '_.:-', starting with a letter or digit"),
    (f'labels = [{", ".join(f"{chr(34)}l{n}{chr(34)}" for n in range(17))}]',
     "labels must be an array of at most 16 items"),
])
def test_a_spec_files_flow_control_mistake_is_said_precisely(text: str, says: str):
    with pytest.raises(SpecError) as refused:
        parse_spec('name = "a"\nversion = "1"\n' + text, source="a.toml")
    assert str(refused.value) == f"a.toml: {says}"
