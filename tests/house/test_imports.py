"""What importing costs and exposes: the pure core loads no I/O library, ``import rota``
loads nothing of rota until a name is used, and every exception a user can catch is a
``RotaError`` on rota/base/errors.py's map."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rota"
IO_LIBRARIES = {"websockets", "psutil", "asyncio", "ssl", "socket", "selectors", "subprocess",
                "concurrent", "httpx", "http", "starlette", "uvicorn", "sqlite3", "sqlite_utils",
                "psycopg", "jinja2", "prometheus_client", "threading"}
# Exceptions no user sees: the demo's is its example of a failing handler; DryRun unwinds
# a spec push's savepoint in the store, Unstored an all-or-nothing enqueue's.
OUTSIDE_THE_TREE = {"cli.demo.TemporaryFailure", "store.writes.DryRun", "store.writes.Unstored"}


def dotted(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def test_importing_the_core_loads_no_io_library():
    # One interpreter per module, started together: each must load only what it needs.
    core = sorted(dotted(p) for p in (PACKAGE / "core").glob("*.py"))
    runs = {module: subprocess.Popen(
        [sys.executable, "-c", f"import sys, rota.{module}\n"
         "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"],
        stdout=subprocess.PIPE, text=True) for module in core}
    for module, run in runs.items():
        out, _ = run.communicate(timeout=60)
        assert run.returncode == 0, module
        loaded = set(out.split())
        # The core logs through the standard `logging`, which itself imports threading
        # (for its locks); no core module imports threading itself (test_layout.py).
        excused = {"threading"} if "logging" in loaded else set()
        assert not (loaded & IO_LIBRARIES) - excused, \
            f"import rota.{module} loads {sorted((loaded & IO_LIBRARIES) - excused)}"


def test_import_rota_alone_loads_nothing_of_rota_yet():
    # `rota` exports lazily (PEP 562): `import rota` runs only rota/__init__.py.
    code = ("import sys, rota\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('rota.'))))")
    packages, submodules = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                          text=True, check=True).stdout.split("\n")[:2]
    assert not set(packages.split()) & (IO_LIBRARIES | {"msgspec", "logging"})
    assert submodules == "", f"import rota loads {submodules}"


def test_every_public_name_is_exported_and_found_on_first_use():
    import rota

    for name in rota.__all__:
        assert getattr(rota, name) is not None, name
    assert set(rota.__all__) <= set(dir(rota))
    with pytest.raises(AttributeError):
        rota.Nothing  # noqa: B018


def test_every_exception_a_user_can_catch_is_a_rota_error_mapped_in_errors_py():
    from rota.base import errors

    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem in ("__main__", "__init__"):  # (__main__ runs the command line)
            continue
        module = importlib.import_module(f"rota.{dotted(path)}")
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, BaseException)
                    and value.__module__ == module.__name__ and not name.startswith("_")):
                found.add(f"{dotted(path)}.{name}")
                if f"{dotted(path)}.{name}" not in OUTSIDE_THE_TREE:
                    assert issubclass(value, errors.RotaError), f"{dotted(path)}.{name}"
                    assert re.search(rf"\b{name}\b", errors.__doc__ or ""), \
                        f"{name} is not in rota/base/errors.py's map"
    assert OUTSIDE_THE_TREE <= found  # (an exception that left needs no excuse)
