"""The web console (``metaq console``) as a child process, and headless Chromium to look at it: shared by
tests/test_console.py, test_console_security.py and test_replication_observe.py. Without Debian's chromium
and chromium-driver, ``chromium()`` (and the ``browser`` fixture of tests/conftest.py) skips the test,
saying how to get them."""
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
from conftest import wait_until
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

MISSING = ("needs Debian's chromium and chromium-driver: apt-get install chromium chromium-driver "
           "(.ci/run installs them), or leave these tests out with -m 'not browser'")


def start_console(zk_connect, zk_root, *args):
    """``metaq console --port 0`` as a child process; returns (process, URL it printed)."""
    proc = subprocess.Popen([sys.executable, "-m", "metaq_broker.tools.cli", "--zk", zk_connect, "--zk-root", zk_root,
                             "console", "--port", "0", "--interval", "0.5", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("metaq console: http://127.0.0.1:"), line + proc.stderr.read()
    return proc, line.split()[2]


def stop_console(proc):
    """SIGTERM, as a service manager stops it: the console must exit 0 on its own."""
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    err = proc.stderr.read()
    assert rc == 0 and "Traceback" not in err, err


@contextlib.contextmanager
def chromium(*flags):
    """Headless Chromium driven by chromedriver, with a profile of its own and extra command-line ``flags``."""
    binary, driver_binary = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver_binary):
        pytest.skip(MISSING)
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    profile = tempfile.mkdtemp(prefix="metaq-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900", f"--user-data-dir={profile}", *flags):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_binary), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def open_page(driver, url, page, query=""):
    driver.get(f"{url}{page}.html{query}")
    wait_until(lambda: driver.find_element(By.TAG_NAME, "body").get_attribute("data-updated"), timeout=60,
               what=f"{page} page drawn from a snapshot")  # a minute: the first snapshot of a busy cluster


def cell(driver, selector, col):
    """Text of column ``col`` in the row ``selector``; '' while that row is not drawn."""
    found = driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : ''",
                                  f'{selector} td[data-col="{col}"]')  # one call: the page redraws meanwhile
    return found.strip()


def texts(driver, selector):
    """Texts of every element matching ``selector``, read in one call."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText.trim())", selector)
