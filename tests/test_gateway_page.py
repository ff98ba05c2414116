"""The status page in a real browser: Debian's ``chromium``, headless,
driven through its ``chromedriver`` by Selenium, opens the gateway's ``/``
while a batch runs on an echo worker and shows that batch's progress and
the depth of its queue. ``./dev.sh test`` installs chromium when it is
missing; without it this test fails (it never skips).

``JAXSERVE_GATEWAY_SCREENSHOT=docs/img/gateway-status.png`` keeps the
screenshot it takes (how the one in docs/gateway.md was made)."""

from __future__ import annotations

import io
import os
import shutil
import time
import types

import openai
import pytest

from gateway_support import GatewayProcess, drop_prefix, openai_line
from queue_support import start_worker_process, stop_process, unique_prefix, wait_log

pytestmark = pytest.mark.timeout(300)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
READ_PAGE = """
const row = document.querySelector(`#batches tr[data-batch='${arguments[0]}']`);
if (!row) return null;
const text = sel => row.querySelector(sel).textContent;
return {
  status: text("td.status"), done: text("td.completed"), total: text("td.total"), progress: text("td.progress"),
  queues: [...document.querySelectorAll("#queues tbody tr[data-queue]")].map(r => [...r.children].map(c => c.textContent)),
  refusals: document.getElementById("refusals").textContent,
};
"""


def _browser(profile_dir):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    assert not missing, f"{missing} missing: install Debian's chromium and chromium-driver (./dev.sh test does)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile_dir}",
        "--window-size=1100,760",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture
def running_batch(tmp_path):
    prefix = unique_prefix()
    worker = start_worker_process(
        prefix, tmp_path / "worker.log", "--store", "memory", "--drain-timeout", "1", "--engine-arg", "step_s=0.05"
    )
    gateway = None
    try:
        wait_log(tmp_path / "worker.log", "worker_consuming")
        gateway = GatewayProcess(prefix, tmp_path / "state", tmp_path / "gateway.log", "--broker-poll", "1").start()
        sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        lines = "\n".join(openai_line(f"row-{i}", f"row {i}", model="echo", max_tokens=10) for i in range(150))
        upload = sdk.files.create(file=("rows.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h")
        with pytest.raises(openai.BadRequestError):  # a refusal for the page's table
            sdk.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "x"}], extra_headers={"X-Jaxserve-Priority": "x"}
            )
        yield types.SimpleNamespace(gateway=gateway, sdk=sdk, batch=batch)
    finally:
        if gateway is not None:
            gateway.kill()
        stop_process(worker)
        drop_prefix(prefix)


def test_status_page_shows_a_running_batch_and_queue_depths(running_batch, tmp_path):
    gateway, batch = running_batch.gateway, running_batch.batch
    driver = _browser(tmp_path / "chromium-profile")
    try:
        driver.get(gateway.url + "/")
        seen = None
        end = time.monotonic() + 60
        while time.monotonic() < end:
            # read the rendered tables in one script: the page redraws them every 2 s
            view = driver.execute_script(READ_PAGE, batch.id)
            if view and view["status"] == "in_progress" and 0 < int(view["done"]) < int(view["total"]):
                depths = {cells[1]: int(cells[2]) for cells in view["queues"]}
                if depths.get("batch", 0) > 0:
                    seen = (int(view["done"]), int(view["total"]), depths, view["progress"], view["refusals"])
                    break
            time.sleep(0.2)
        shot = tmp_path / "gateway-status.png"
        driver.save_screenshot(str(shot))
        assert seen is not None, driver.page_source[:3000]
        done, total, depths, progress, refusals = seen
        assert total == 150 and progress.endswith("%") and 0 < int(progress.rstrip("%")) < 100
        assert depths["batch"] > 0  # jobs of the batch wait in its queue, beyond the worker's prefetch
        assert "invalid_priority" in refusals
        assert shot.stat().st_size > 10_000
        keep = os.environ.get("JAXSERVE_GATEWAY_SCREENSHOT")
        if keep:
            shutil.copyfile(shot, keep)
    finally:
        driver.quit()
