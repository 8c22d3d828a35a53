"""The suite's lanes (tests/conftest.py): a test without one fails the collection, fixtures put a test into
theirs even in a module marked unit, a test's own unit mark may not hide a fixture's needs, and ``-m unit``
selects only what needs nothing else. Run on small suites in a temporary directory with this conftest."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import LANES, _group
from xdist.scheduler.loadgroup import LoadGroupScheduling

pytestmark = pytest.mark.unit
CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
INI = (Path(__file__).parent.parent / "pytest.ini").read_text()


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CONFTEST + '''
@pytest.fixture
def zookeeper():  # stands for the real one: only its name puts a test into a lane
    return None
''')
    pytester.makeini(INI)
    return pytester


def test_a_test_without_a_lane_fails_the_collection_naming_it(suite):
    suite.makepyfile(test_a="def test_forgotten():\n    pass\n\ndef test_also():\n    pass\n")
    r = suite.runpytest("-q")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*every test needs a lane*", "*test_a.py: test_forgotten has no lane; test_also has no lane*"])


def test_a_misspelt_lane_is_an_error_too(suite):
    suite.makepyfile(test_a="import pytest\npytestmark = pytest.mark.unti\n\ndef test_x():\n    pass\n")
    r = suite.runpytest("-q")
    assert r.ret != pytest.ExitCode.OK
    r.stdout.fnmatch_lines(["*'unti' not found in `markers` configuration option*"])


def test_fixtures_put_a_test_into_their_lane_even_in_a_unit_module(suite):
    suite.makepyfile(test_a='''
import pytest
pytestmark = pytest.mark.unit

def test_plain():
    pass

def test_with_zookeeper(zookeeper):
    pass

@pytest.mark.process
def test_starts_a_broker():
    pass

@pytest.mark.spark
def test_spark_job():
    pass
''', test_b='''
import pytest
pytestmark = pytest.mark.process

@pytest.mark.unit
def test_needs_nothing():
    pass

@pytest.mark.spark
def test_spark_with_brokers():
    pass
''')
    items, _ = suite.inline_genitems()
    lanes = {item.name: {m.name for m in item.iter_markers() if m.name in LANES} for item in items}
    assert lanes == {"test_plain": {"unit"}, "test_with_zookeeper": {"process"}, "test_starts_a_broker": {"process"},
                     "test_spark_job": {"spark"}, "test_needs_nothing": {"unit"},
                     "test_spark_with_brokers": {"process", "spark"}}
    r = suite.runpytest("-q", "-m", "unit")
    r.assert_outcomes(passed=2, deselected=4)


def test_a_test_marked_unit_may_not_use_a_process_fixture(suite):
    suite.makepyfile(test_a="import pytest\n\n@pytest.mark.unit\ndef test_liar(zookeeper):\n    pass\n")
    r = suite.runpytest("-q")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*test_a.py: test_liar is marked unit but uses process fixtures*"])


def test_a_skip_fails_where_every_test_must_run(suite, monkeypatch):
    """CI sets METAQ_TESTS_NO_SKIPS (.ci/run): a test or module that would skip (a tool missing) fails there,
    naming why; elsewhere it skips; with the tool there, it runs. An expected failure (xfail) stays what it is.
    The tool is a program (``metaq-lanes-tool`` on PATH) and a module (``metaq_lanes_module``) this test
    installs for the last run."""
    suite.makepyfile(test_a='''import shutil
import pytest
pytestmark = pytest.mark.unit
MISSING = shutil.which("metaq-lanes-tool") is None

def test_needs_a_tool():
    if MISSING:
        pytest.skip("metaq-lanes-tool is not installed")

@pytest.mark.skipif(MISSING, reason="metaq-lanes-tool is not installed (skipif)")
def test_marked():
    pass

@pytest.mark.xfail(reason="known")
def test_expected():
    assert False
''')
    suite.makepyfile(test_b='''import pytest
pytestmark = pytest.mark.unit
pytest.importorskip("metaq_lanes_module", reason="metaq_lanes_module is not installed")

def test_collected_with_the_module():
    pass
''')
    monkeypatch.delenv("METAQ_TESTS_NO_SKIPS", raising=False)
    suite.runpytest("-q").assert_outcomes(skipped=3, xfailed=1)
    monkeypatch.setenv("METAQ_TESTS_NO_SKIPS", "1")
    r = suite.runpytest("-q", "test_a.py")
    r.assert_outcomes(failed=1, errors=1, xfailed=1)  # skipif skips in the setup: an error there
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    for why in ("metaq-lanes-tool is not installed", "metaq-lanes-tool is not installed (skipif)"):
        r.stdout.fnmatch_lines([f"*skipped where every test must run*{why}*"])
    r = suite.runpytest("-q", "test_b.py")  # a module skipped as it is collected: a collection error
    r.assert_outcomes(errors=1)
    assert r.ret == pytest.ExitCode.INTERRUPTED
    r.stdout.fnmatch_lines(["*skipped where every test must run*metaq_lanes_module is not installed*"])

    tool = suite.path / "bin" / "metaq-lanes-tool"  # the tools installed: every test runs
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    suite.makepyfile(metaq_lanes_module="")
    r = suite.runpytest("-q")
    r.assert_outcomes(passed=3, xfailed=1)
    assert r.ret == pytest.ExitCode.OK


@pytest.mark.process
def test_a_run_started_in_the_background_starts_commands_that_ctrl_c_stops(suite):
    """A script's ``pytest ... &`` runs with SIGINT and SIGQUIT ignored, which the commands its tests start
    inherit: a test's Ctrl-C then never stopped them (stop 38's runs). The conftest puts both back."""
    suite.makepyfile(test_a='''
import signal, subprocess, sys
import pytest
pytestmark = pytest.mark.process

def test_a_command_started_here_has_sigint_and_sigquit_at_their_defaults():
    status = subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"],
                            capture_output=True, text=True, check=True).stdout
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert not ignored & (1 << signal.SIGINT - 1 | 1 << signal.SIGQUIT - 1), hex(ignored)
''')
    r = subprocess.run(["bash", "-c", f"{sys.executable} -m pytest -q -p no:cacheprovider test_a.py & wait $!"],
                       cwd=suite.path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent)))  # the conftest's imports
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("master", [None, "local[2]", "local[2,4]", "local-cluster[2,1,1024]"])
def test_a_modules_group_is_one_xdist_hands_to_one_worker(master):
    """``--dist loadgroup`` sends the tests of a group, ``<node id>@<group>``, to one worker; the group name
    must survive xdist's parsing of node ids, parametrized ones too."""
    module = SimpleNamespace(__name__="test_sink", **({"SPARK_MASTER": master} if master else {}))
    name = _group(module)
    for nodeid in (f"tests/test_sink.py::test_write@{name}", f"tests/test_sink.py::test_write[a-1]@{name}"):
        assert LoadGroupScheduling._split_scope(None, nodeid) == name, nodeid
