"""zero-plan serve in headless Chromium: the page, driven by a URL that holds its inputs, must
show the numbers zero-plan's JSON gives for the same inputs (the estimate's totals and every bar,
the fit table's rows), draw the bars in a screenshot as tall as their bytes, and show the CLI's
error and hint for bad input; driven over the DevTools protocol (python3-websocket) as a user
drives it, it must follow a changed field and an uploaded config.json. ZP_BIN: the folder
holding zero-plan; ZP_CHROMIUM: the browser."""
import base64
import html
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import websocket
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZERO_PLAN = os.path.join(os.environ.get("ZP_BIN", os.path.join(ROOT, "build", "bin")), "zero-plan")
MISTRAL = os.path.join(ROOT, "models", "configs", "mistral-7b.json")
COLORS = {"params": "#4e79a7", "grads": "#f28e2b", "master": "#e15759", "optimizer": "#76b7b2",
          "activations": "#59a14f", "buffers": "#edc948", "workspace": "#b07aa1", "overhead": "#9c755f"}
# What the page sends for its untouched fields (the form's defaults).
PAGE_DEFAULTS = ["--dp", "8", "--micro-batch", "1", "--checkpointing", "none",
                 "--offload-optimizer", "none", "--offload-param", "none", "--profile", "zeroplan"]


def browser():
    b = os.environ.get("ZP_CHROMIUM") or next(
        (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    assert b, "no Chromium found: tools/test.sh installs it (Debian package 'chromium'), or set ZP_CHROMIUM"
    return b


@pytest.fixture(scope="module")
def server():
    p = subprocess.Popen([ZERO_PLAN, "serve", "--port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    try:
        line = p.stdout.readline()
        m = re.match(r"zero-plan serve: (http://127\.0\.0\.1:\d+/) ", line)
        assert m, line  # bound to the loopback address unless told otherwise
        yield m.group(1)
    finally:
        p.terminate()
        p.wait(timeout=10)


def reap(proc):
    """Ends a browser started with start_new_session and every process it left in its group
    (Chromium's helpers can outlive the main process and still write to its profile, which made
    the profile's removal fail once in CI)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for _ in range(100):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)


def profile_dir():
    return tempfile.TemporaryDirectory(ignore_cleanup_errors=True)


def chromium(url, *mode):
    with profile_dir() as profile:
        proc = subprocess.Popen([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 "--disable-dev-shm-usage", "--no-proxy-server", "--user-data-dir=" + profile,
                                 "--virtual-time-budget=20000", "--window-size=1280,2400", *mode, url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            reap(proc)
    assert proc.returncode == 0, err[-2000:]
    return out


def cli(*args, code=0):
    r = subprocess.run([ZERO_PLAN, *args, "--format", "json"], capture_output=True, text=True)
    assert r.returncode == code, r.stderr
    return json.loads(r.stdout)


def attrs(dom, tag, required):
    """The attribute dicts of every <tag ...> in the DOM that has the attribute `required`."""
    out = []
    for m in re.finditer(r"<%s\b([^>]*)>" % tag, dom):
        a = {k: html.unescape(v) for k, v in re.findall(r'([\w-]+)="([^"]*)"', m.group(1))}
        if required in a:
            out.append(a)
    return out


def body_state(dom):
    return re.search(r'<body[^>]*data-zp-serve="(\w+)"', dom).group(1)


def test_estimate_bars_and_fit_equal_the_cli(server, tmp_path):
    query = "model=gpt2-xl&stage=2&dp=8&hardware=v100-32g&gpus=8"
    dom = chromium(server + "?" + query, "--dump-dom")
    assert body_state(dom) == "ready"
    est = cli("estimate", "--model", "gpt2-xl", "--stage", "2", *PAGE_DEFAULTS, "--hardware", "v100-32g")
    gpu = est["per_device"]["gpu"]
    (total,) = [a for a in attrs(dom, "span", "data-tier") if a["data-tier"] == "gpu"]
    assert int(total["data-bytes"]) == gpu["total"]
    assert attrs(dom, "span", "data-fits")[0]["data-fits"] == "true" and est["fits"] is True
    # Every bar of the memory chart is the estimate's category, byte for byte.
    bars = {a["data-category"]: int(a["data-bytes"]) for a in attrs(dom, "rect", "data-category")}
    assert bars == {c: b for c, b in gpu["breakdown"].items() if b > 0}
    # The fit table: the search for the model, sequence, precision, profile and GPUs.
    fit = cli("fit", "--model", "gpt2-xl", "--hardware", "v100-32g", "--gpus", "8", "--profile", "zeroplan")
    rows = attrs(dom, "tr", "data-fit-rank")
    assert [int(r["data-gpu-bytes"]) for r in rows] == [c["per_device"]["gpu"]["total"] for c in fit["candidates"]]
    assert len(rows) == 5

    # The screenshot: each category's bar, found by its colour in the column where the bar is
    # drawn, is as many pixels tall as its bytes on the chart's scale.
    shot = tmp_path / "page.png"
    chromium(server + "?" + query, "--screenshot=" + str(shot))
    img = Image.open(shot).convert("RGB")
    w, h = img.size
    px = img.load()
    rgb = {c: tuple(int(v[i:i + 2], 16) for i in (1, 3, 5)) for c, v in COLORS.items()}
    (svg,) = [a for a in attrs(dom, "svg", "data-chart") if a["data-chart"] == "memory"]
    scale = float(svg["data-plot-height"]) / float(svg["data-max-bytes"])
    def run(x, colour):
        """The height of the tallest stretch of `colour` down column x, bridging gaps of up to
        3 px (the peak's 2-px black tick can cross the top bar)."""
        ys = [y for y in range(h) if px[x, y] == colour]
        best, start = 0, 0
        for i in range(1, len(ys) + 1):
            if i == len(ys) or ys[i] - ys[i - 1] > 4:
                best = max(best, ys[i - 1] - ys[start] + 1)
                start = i
        return best

    act = rgb["activations"]
    column = max(range(w), key=lambda x: run(x, act))
    assert run(column, act) > 100  # the tallest bar, drawn
    for cat, b in bars.items():
        assert abs(run(column, rgb[cat]) - b * scale) <= 2.5, (cat, run(column, rgb[cat]), b * scale)


def test_pasted_config_in_the_url(server):
    with open(MISTRAL) as f:
        text = f.read()
    config = base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")
    dom = chromium(server + "?" + urllib.parse.urlencode({"config": config, "stage": "3"}), "--dump-dom")
    assert body_state(dom) == "ready"
    est = cli("estimate", "--model", MISTRAL, "--stage", "3", *PAGE_DEFAULTS)
    (total,) = [a for a in attrs(dom, "span", "data-tier") if a["data-tier"] == "gpu"]
    assert int(total["data-bytes"]) == est["per_device"]["gpu"]["total"]
    assert "mistral" in dom and "7.24 B params" in dom


def test_bad_input_shows_the_clis_error_and_hint(server):
    dom = chromium(server + "?model=gpt2-xl&stage=2&offload_param=cpu", "--dump-dom")
    assert body_state(dom) == "error"
    r = subprocess.run([ZERO_PLAN, "estimate", "--model", "gpt2-xl", "--stage", "2",
                        *PAGE_DEFAULTS[:-6], "--offload-optimizer", "none", "--offload-param", "cpu",
                        "--profile", "zeroplan"], capture_output=True, text=True)
    assert r.returncode == 2
    shown = html.unescape(re.search(r'<pre id="zp-serve-error">(.*?)</pre>', dom, re.S).group(1))
    assert shown == r.stderr.rstrip("\n")
    assert shown.startswith("error: --offload-param") and "\nhint: " in shown


def test_bad_port_is_a_clear_error():
    r = subprocess.run([ZERO_PLAN, "serve", "--port", "70000"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("error: --port: 70000 is not a TCP port")


def test_requests_write_no_files_and_must_be_json(server, tmp_path):
    target = tmp_path / "written.json"
    body = {"model": "gpt2-xl", "keywords": {"stage": "2", "output": str(target)}}

    def post(content_type):
        req = urllib.request.Request(server + "api/estimate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": content_type}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    status, answer = post("application/json")
    assert status == 400 and answer["error"] == "output: the page writes no files"
    status, answer = post("text/plain")  # what another site's form or fetch could send
    assert status == 400 and "Content-Type" in answer["error"]
    assert not target.exists()
    body["keywords"] = {"stage": "2"}
    status, answer = post("application/json")
    assert status == 200 and answer["result"]["strategy"]["stage"] == 2


class DevTools:
    """One page of a headless Chromium under the DevTools protocol."""

    def __init__(self, profile):
        self.proc = subprocess.Popen(
            [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--no-proxy-server", "--user-data-dir=" + profile,
             "--remote-debugging-port=0", "--remote-allow-origins=*", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        active = os.path.join(profile, "DevToolsActivePort")
        for _ in range(300):
            if os.path.exists(active) and len(open(active).read().split()) >= 2:
                break
            time.sleep(0.1)
        port = open(active).read().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60,
                                              suppress_origin=True)
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            m = json.loads(self.ws.recv())
            if m.get("id") == self.next_id:
                assert "error" not in m, m
                return m["result"]

    def js(self, expression):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    def wait_ready(self, until):
        """Polls until the page has redrawn for `until` (a JS condition) and says ready."""
        for _ in range(600):
            if self.js(f"!!document.body && document.body.getAttribute('data-zp-serve') === 'ready' && ({until})"):
                return
            time.sleep(0.1)
        raise AssertionError("the page did not redraw: " + self.js("document.body.outerHTML.slice(0, 3000)"))

    def gpu_total(self):
        return int(self.js("document.querySelector('#zp-summary span[data-tier=gpu]').dataset.bytes"))

    def close(self):
        self.ws.close()
        reap(self.proc)


def test_the_page_follows_a_change_and_an_upload(server):
    with profile_dir() as profile:
        page = DevTools(profile)
        try:
            page.call("Page.navigate", url=server + "?model=gpt2-xl&stage=2&dp=8")
            page.wait_ready("location.search.includes('stage=2')")
            assert page.gpu_total() == cli("estimate", "--model", "gpt2-xl", "--stage", "2",
                                           *PAGE_DEFAULTS)["per_device"]["gpu"]["total"]
            # A user picks stage 3: the summary, the bars and the address bar follow.
            page.js("const s = document.querySelector('select[name=stage]'); s.value = '3';"
                    "s.dispatchEvent(new Event('change', {bubbles: true})); true")
            page.wait_ready("location.search.includes('stage=3')")
            want = cli("estimate", "--model", "gpt2-xl", "--stage", "3", *PAGE_DEFAULTS)["per_device"]["gpu"]
            assert page.gpu_total() == want["total"]
            bars = page.js("Object.fromEntries([...document.querySelectorAll('#zp-memory rect')]"
                           ".map(r => [r.dataset.category, Number(r.dataset.bytes)]))")
            assert bars == {c: b for c, b in want["breakdown"].items() if b > 0}
            # And uploads a config.json through the file chooser.
            root = page.call("DOM.getDocument")["root"]["nodeId"]
            chooser = page.call("DOM.querySelector", nodeId=root, selector="#zp-file")["nodeId"]
            page.call("DOM.setFileInputFiles", files=[MISTRAL], nodeId=chooser)
            page.wait_ready("location.search.includes('config=')")
            assert page.gpu_total() == cli("estimate", "--model", MISTRAL, "--stage", "3",
                                           *PAGE_DEFAULTS)["per_device"]["gpu"]["total"]
            assert page.js("!location.search.includes('model=')")
        finally:
            page.close()
