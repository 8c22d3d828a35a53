"""The web console against a secured cluster (docs/console.md, "Access"), in headless Chromium and by
plain HTTP: without a login nothing of the cluster is shown (the login page included); a request naming a
foreign Host (DNS rebinding) gets nothing, logged in or not; each person logs in as a SASL user of the
cluster and sees what that user's ACLs allow; cookies are HttpOnly and SameSite=Strict (and Secure over
HTTPS); logging in and out needs the page's token and refuses other sites' forms. Real ZooKeeper, a
SASL_SSL broker with ACLs, `metaq console` as a child process."""
import http.client
import json
import re
import ssl
import subprocess
import sys
import time
from urllib.parse import urlencode, urlsplit

import pytest
from conftest import wait_until
from selenium.webdriver.common.by import By
from webconsole import chromium, texts

from metaq_broker.client import Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.security.settings import ZkSecurity
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.session import new_client
from metaq_broker.zk.users import delete_user, put_user

ZK_AUTH = "digest:metaq:cluster-pw"
PASSWORDS = {"alice": "alice-pw-1", "admin": "admin-pw-2", "carol": "carol-pw-3"}
SECRETS = ("payroll", "salary", "payroll-audit")  # what alice may not see, nor anyone without a login
EVIL = "rebind.attacker.example"
pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, zookeeper, pki):
    work = tmp_path_factory.mktemp("console-sec")
    root = f"/console-sec-{time.time_ns()}"
    zk = new_client(zookeeper.connect_string, security=ZkSecurity.from_properties({"zk.auth": ZK_AUTH}))
    zk.start(15)
    for user, password in PASSWORDS.items():
        put_user(zk, root, user, Credential.make(password))
    add_acls(zk, root, [Acl(u, "Allow", op, rtype, name) for u in ("User:alice", "User:carol")
                        for op, rtype, name in (("Read", "topic", "orders-eu"), ("Describe", "group", "billing"))])
    broker = BrokerProcess(work / "b", 1, zookeeper.connect_string, settings={
        "zk.root": root, "zk.sessionTimeout": 4000, "zk.auth": ZK_AUTH, "security.protocol": "SASL_SSL",
        "ssl.certificate.location": pki.broker.cert, "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca,
        "authorizer": "acl", "super.users": "User:admin"},
        topics={"orders-eu": {"numPartitions": 1}, "payroll": {"numPartitions": 1}}).start()
    admin = {"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca, "sasl.username": "admin",
             "sasl.password": PASSWORDS["admin"]}
    with Producer(zk_connect=zookeeper.connect_string, zk_root=root, security=admin) as p:
        wait_until(lambda: p.cluster.topic_partitions("payroll"), what="topic payroll")
        p.send_batch("orders-eu", [b"order 1", b"order 2"], partition="1-0")
        p.send_batch("payroll", [b"salary: 100000"], partition="1-0")
    store = GroupStore(zk, root)
    store.commit("billing", "orders-eu", {"1-0": 1})
    store.commit("payroll-audit", "payroll", {"1-0": 0})
    config = work / "console.properties"
    config.write_text(f"security.protocol=SASL_SSL\nssl.ca.location={pki.ca}\n")
    yield {"zk": zookeeper.connect_string, "zkc": zk, "root": root, "pki": pki, "config": config, "broker": broker}
    broker.kill()
    zk.stop()
    zk.close()


def start_console(c, *args):
    """``metaq --command-config console.properties console``; returns (process, URL it printed)."""
    proc = subprocess.Popen([sys.executable, "-m", "metaq_broker.tools.cli", "--zk", c["zk"], "--zk-root", c["root"],
                             "--command-config", str(c["config"]), "console", "--port", "0", "--interval", "0.5",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("metaq console: http") and "each person logs in" in line, line + proc.stderr.read()
    return proc, line.split()[2]


def stop_console(proc):
    proc.terminate()
    rc = proc.wait(timeout=30)
    err = proc.stderr.read()
    assert rc == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def console(cluster):
    proc, url = start_console(cluster)
    try:
        yield url
    finally:
        stop_console(proc)


class Web:
    """Plain HTTP(S) to the console with a cookie jar, no redirects followed: what an attacker's script
    (or curl) sees."""

    def __init__(self, url, ca=None):
        parts = urlsplit(url)
        self.https, self.host, self.port = parts.scheme == "https", parts.hostname, parts.port
        self.ctx = ssl.create_default_context(cafile=ca) if self.https else None
        self.cookies = {}

    def request(self, method, path, body=None, headers=None):
        """(status, headers as a list, body text)."""
        conn = (http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=30) if self.https
                else http.client.HTTPConnection(self.host, self.port, timeout=30))
        try:
            sent = {"Host": f"{self.host}:{self.port}", **(headers or {})}
            if self.cookies and "Cookie" not in sent:
                sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
            conn.request(method, path, body=body, headers=sent)
            r = conn.getresponse()
            got = r.getheaders()
            text = r.read().decode(errors="replace")
        finally:
            conn.close()
        for key, value in got:
            if key.lower() == "set-cookie":
                name, _, rest = value.partition("=")
                val = rest.split(";", 1)[0]
                if "Max-Age=0" in value:
                    self.cookies.pop(name, None)
                else:
                    self.cookies[name] = val
        return r.status, got, text

    def login(self, user, password, headers=None):
        status, _, page = self.request("GET", "/login")
        assert status == 200, page
        csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
        form = urlencode({"user": user, "password": password, "csrf": csrf})
        return self.request("POST", "/login", form, {"Content-Type": "application/x-www-form-urlencoded",
                                                     **(headers or {})})


def set_cookies(headers) -> list:
    return [v for k, v in headers if k.lower() == "set-cookie"]


def no_secret(text: str) -> bool:
    return not any(s in text for s in SECRETS)


def log_in(driver, url, user):
    driver.get(url)
    wait_until(lambda: driver.find_elements(By.ID, "password"), what="the login form")
    driver.find_element(By.ID, "user").send_keys(user)
    driver.find_element(By.ID, "password").send_keys(PASSWORDS[user])
    driver.find_element(By.ID, "submit").click()
    wait_until(lambda: driver.execute_script("return document.body ? document.body.dataset.updated : ''"), timeout=30,
               what=f"a page drawn for {user}")  # one call: the page is changing under it


# -- without a login ----------------------------------------------------------------------------------------
def test_without_a_login_nothing_of_the_cluster_is_shown(cluster, console, browser):
    for page in ("", "topics.html", "messages.html?topic=payroll&partition=1-0", "groups.html"):
        browser.get(console + page)
        wait_until(lambda: browser.find_elements(By.ID, "password"), what=f"/{page} sent to the login page")
        assert urlsplit(browser.current_url).path == "/login"
        assert no_secret(browser.page_source) and "orders-eu" not in browser.page_source
        assert cluster["zk"] not in browser.page_source and "billing" not in browser.page_source
    answer = browser.execute_async_script(
        "const done = arguments[0]; fetch('/api/messages?topic=payroll&partition=1-0')"
        ".then(r => r.text().then(t => done([r.status, t])))")
    assert answer[0] == 401 and no_secret(answer[1])
    web = Web(console)
    for path in ("/api/snapshot", "/api/history", "/api/messages?topic=payroll&partition=1-0", "/api/whoami"):
        status, _, body = web.request("GET", path)
        assert status == 401 and no_secret(body) and json.loads(body)["error"] == "log in first", (path, body)
    status, headers, body = web.request("GET", "/static/app.js")
    assert status in (302, 303) and no_secret(body)


def test_the_operators_credentials_in_the_console_config_serve_nobody(cluster, tmp_path):
    """The review's attack: the console started with the operator's super-user --command-config answered
    /api/messages?topic=payroll to anyone, with Host: rebind.attacker.example too. Now each person logs
    in: the file's SASL user is not used (and the console says so)."""
    config = tmp_path / "operator.properties"
    config.write_text(cluster["config"].read_text() + f"sasl.username=admin\nsasl.password={PASSWORDS['admin']}\n")
    proc, url = start_console({**cluster, "config": config})
    try:
        web = Web(url)
        for host in (None, EVIL):
            status, _, body = web.request("GET", "/api/messages?topic=payroll&partition=1-0&from=0",
                                          headers={"Host": host} if host else None)
            assert status in (401, 421) and no_secret(body), (host, status, body)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "each person logs in as themselves" in proc.stderr.read()


def test_a_foreign_host_header_gets_nothing_logged_in_or_not(cluster, console):
    web = Web(console)
    assert web.login("admin", PASSWORDS["admin"])[0] == 303
    wait_until(lambda: "payroll" in web.request("GET", "/api/snapshot")[2],  # with the console's own host name
               what="payroll in admin's snapshot")
    for host in (EVIL, f"{EVIL}:{web.port}", "127.0.0.1.attacker.example", "", "localhost:80@evil"):
        for method, path in (("GET", "/"), ("GET", "/api/snapshot"), ("GET", "/api/messages?topic=payroll&"
                             "partition=1-0"), ("GET", "/login"), ("HEAD", "/"), ("POST", "/login")):
            status, _, body = web.request(method, path, headers={"Host": host})
            assert status == 421 and no_secret(body), (host, method, path, status, body)
    for host in ("localhost", f"LOCALHOST:{web.port}", f"[::1]:{web.port}"):  # loopback names are served
        assert web.request("GET", "/api/whoami", headers={"Host": host})[0] == 200, host


@pytest.mark.browser
def test_dns_rebinding_in_chromium_gets_nothing(console):
    """A page of rebind.attacker.example whose name now points at this machine: Chromium sends Host:
    rebind.attacker.example, and the console answers nothing of the cluster."""
    port = urlsplit(console).port
    with chromium(f"--host-resolver-rules=MAP {EVIL} 127.0.0.1") as driver:
        for page in ("", "topics.html", "api/messages?topic=payroll&partition=1-0", "login"):
            driver.get(f"http://{EVIL}:{port}/{page}")
            text = driver.find_element(By.TAG_NAME, "body").text
            assert "does not serve the host" in text and no_secret(driver.page_source), (page, text)
            assert not driver.find_elements(By.ID, "password")


# -- logged in ----------------------------------------------------------------------------------------------
@pytest.mark.browser
def test_each_person_sees_what_their_acls_allow(cluster, console):
    with chromium() as driver:
        log_in(driver, console, "alice")
        assert texts(driver, "#user") == ["alice"]
        driver.get(console + "topics.html")
        wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, 'tr[data-topic="orders-eu"]'), what="alice's topic")
        assert not driver.find_elements(By.CSS_SELECTOR, 'tr[data-topic="payroll"]') and no_secret(driver.page_source)
        driver.get(console + "groups.html")
        wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, 'tr[data-group="billing"]'), what="alice's group")
        assert no_secret(driver.page_source)
        driver.get(console + "messages.html?topic=orders-eu&partition=1-0&from=0")
        wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "tr[data-offset]"), what="alice's messages")
        assert "order 1" in driver.page_source and texts(driver, "#topic option") == ["topic…", "orders-eu"]
        driver.get(console + "messages.html?topic=payroll&partition=1-0&from=0")
        wait_until(lambda: driver.find_elements(By.ID, "browse-error"), what="the refusal of payroll")
        assert "User:alice is not allowed" in texts(driver, "#browse-error")[0] and "salary" not in driver.page_source

        cookies = {c["name"]: c for c in driver.get_cookies()}
        assert cookies["metaq_session"]["httpOnly"] and cookies["metaq_session"]["sameSite"] == "Strict"
        assert driver.execute_script("return document.cookie") == ""  # no script reads the session
        old = cookies["metaq_session"]["value"]
        driver.find_element(By.CSS_SELECTOR, "#logout button").click()
        wait_until(lambda: driver.find_elements(By.ID, "password"), what="the login page after logging out")
        web = Web(console)
        web.cookies["metaq_session"] = old
        assert web.request("GET", "/api/snapshot")[0] == 401  # the session ended with the logout

        log_in(driver, console, "admin")  # a super user, in the same browser: everything
        driver.get(console + "topics.html")
        wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, 'tr[data-topic="payroll"]'), what="payroll for admin")


def test_a_removed_users_console_session_ends(cluster, console):
    web = Web(console)
    assert web.login("carol", PASSWORDS["carol"])[0] == 303
    wait_until(lambda: "orders-eu" in web.request("GET", "/api/snapshot")[2], what="carol's snapshot")
    delete_user(cluster["zkc"], cluster["root"], "carol")
    wait_until(lambda: web.request("GET", "/api/snapshot")[0] == 401, timeout=30, what="carol's session ended")
    assert web.login("carol", PASSWORDS["carol"])[0] == 401


def test_logins_need_the_form_token_and_refuse_other_sites(cluster, console):
    """Last of the module's tests on its console: it leaves 127.0.0.1 blocked from logging in for a minute."""
    web = Web(console)
    status, headers, page = web.login("alice", "not-her-password")
    assert status == 401 and "unknown user or wrong password" in page
    assert not any(c.startswith("metaq_session=") for c in set_cookies(headers))
    login_cookie = [c for c in set_cookies(web.request("GET", "/login")[1]) if c.startswith("metaq_login_csrf=")][0]
    assert "HttpOnly" in login_cookie and "SameSite=Strict" in login_cookie and "Secure" not in login_cookie

    form = {"Content-Type": "application/x-www-form-urlencoded"}
    stranger = Web(console)  # a form another site posts: no token cookie, or a forged one
    body = urlencode({"user": "alice", "password": PASSWORDS["alice"], "csrf": "forged"})
    assert stranger.request("POST", "/login", body, form)[0] == 403
    stranger.cookies["metaq_login_csrf"] = "forged"
    status, headers, _ = stranger.request("POST", "/login", body, form)
    assert status == 403 and not any(c.startswith("metaq_session=") for c in set_cookies(headers))
    assert web.login("alice", PASSWORDS["alice"], {"Origin": f"http://{EVIL}"})[0] == 403

    status, headers, _ = web.login("alice", PASSWORDS["alice"], {"Origin": console.rstrip("/")})
    session = [c for c in set_cookies(headers) if c.startswith("metaq_session=")][0]
    assert status == 303 and "HttpOnly" in session and "SameSite=Strict" in session
    assert web.request("POST", "/logout", "csrf=guess", form)[0] == 403  # the session's token is needed
    csrf = json.loads(web.request("GET", "/api/whoami")[2])["csrf"]
    assert web.request("POST", "/logout", urlencode({"csrf": csrf}), {**form, "Origin": f"http://{EVIL}"})[0] == 403
    assert web.request("GET", "/api/whoami")[0] == 200  # still logged in
    assert web.request("POST", "/logout", urlencode({"csrf": csrf}), form)[0] == 303
    assert web.request("GET", "/api/whoami")[0] == 401

    guesser = Web(console)  # at most 10 failures a minute from one address (this test's earlier ones count)
    codes = [guesser.login("alice", f"guess-{i}")[0] for i in range(12)]
    first = codes.index(429)
    assert 0 < first <= 10 and set(codes[:first]) == {401} and set(codes[first:]) == {429}, codes
    assert guesser.login("alice", PASSWORDS["alice"])[0] == 429  # the right password waits as well


def test_https_console_with_secure_cookies(cluster):
    pki = cluster["pki"]
    proc, url = start_console(cluster, "--ssl-certfile", pki.broker.cert, "--ssl-keyfile", pki.broker.key,
                              "--allowed-hosts", "console.example")
    try:
        assert url.startswith("https://127.0.0.1:")
        web = Web(url, pki.ca)
        status, headers, _ = web.login("alice", PASSWORDS["alice"])
        assert status == 303 and all("Secure" in c and "HttpOnly" in c for c in set_cookies(headers))
        status, headers, body = web.request("GET", "/api/snapshot")
        assert status == 200 and dict(headers).get("Strict-Transport-Security")
        assert web.request("GET", "/api/whoami", headers={"Host": "console.example"})[0] == 200
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            Web(url.replace("https:", "http:")).request("GET", "/login")  # no plaintext
    finally:
        stop_console(proc)
