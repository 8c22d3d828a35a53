"""What docs/architecture.md says of imports, checked in the code (the layers themselves: ``lint-imports``):
imports stand at the top of each module, and each of the few inside a function says why beside it (a
``lazy:`` comment on its line, or above the run of imports it starts)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("metaq_broker", "metaq_spark")
GENERATED = ROOT / "metaq_broker" / "proto"  # protoc's output, not edited by hand


def lazy_imports():
    """(path, line number, source line) of every import that is not a statement of its module's body."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if GENERATED in path.parents:
                continue
            tree = ast.parse(path.read_text(), str(path))
            top = {id(node) for node in tree.body}
            lines = path.read_text().splitlines()
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                    yield path.relative_to(ROOT), node.lineno, lines


def reason(lines, lineno):
    """The ``lazy:`` comment that explains the import at ``lineno``, or None."""
    if "# " in lines[lineno - 1] and "lazy" in lines[lineno - 1].split("# ", 1)[1]:
        return lines[lineno - 1]
    above = [line.strip() for line in reversed(lines[:lineno - 1])]
    while above and (not above[0] or above[0].startswith(("import ", "from "))):
        above.pop(0)  # the run of imports the comment stands above
    comment = []
    while above and above[0].startswith("#"):
        comment.append(above.pop(0))
    return next((line for line in comment if "lazy" in line), None)


def test_every_import_inside_a_function_says_why_it_is_lazy():
    found = list(lazy_imports())
    assert found, "no lazy import found: the walk is broken"
    missing = [f"{path}:{n}: {lines[n - 1].strip()}" for path, n, lines in found if reason(lines, n) is None]
    assert not missing, "imports inside functions without a 'lazy:' reason beside them:\n" + "\n".join(missing)


def test_the_reason_finder_is_not_fooled():
    lines = ["def f():",
             "    x = 1",
             "    import json",
             "    # lazy: heavy",
             "    import numba",
             "",
             "    import pyspark",
             "    import grpc  # lazy: only here",
             "    # a comment that gives no reason",
             "    import os",
             "    # lazy: a reason over",
             "    # two lines",
             "    import time"]
    assert reason(lines, 3) is None  # code above it, no comment
    assert reason(lines, 5) and reason(lines, 7)  # the comment above their run of imports
    assert reason(lines, 8)
    assert reason(lines, 10) is None
    assert reason(lines, 13)


@pytest.mark.parametrize("module", ["metaq_spark", "metaq_broker.client", "metaq_broker.tools.cli"])
def test_client_processes_import_no_x509_parser(module):
    """Every Spark task's Python worker imports the connector, every ``metaq`` command the CLI: ~300 processes
    a test run, each of which paid ~60 ms for ``cryptography.x509`` while only a broker reads a certificate's
    subject (``security/certificates.py``)."""
    loaded = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(sorted(m for m in sys.modules "
                             "if m.startswith('cryptography')))"], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", f"importing {module} loads {loaded.stdout.strip()}"
