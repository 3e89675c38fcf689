"""The built leaderboard in a real headless browser: Debian's Chromium driven by Selenium through
Debian's chromedriver, the site opened from `file://` (no server: every link is relative).

Run by `make test-browser` (CI installs `chromium` and `chromium-driver` first); a machine
without them fails here with what to install, rather than skipping.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_leaderboard import _result, _write
from where import REPO

from clbench.leaderboard.site import build

pytestmark = pytest.mark.browser


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.fail("the browser test needs Chromium and its driver: on Debian or Ubuntu, "
                    "`apt-get install chromium chromium-driver`")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000",
                 "--disable-dev-shm-usage", "--allow-file-access-from-files"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


def _errors(browser) -> list[str]:
    return [entry["message"] for entry in browser.get_log("browser")
            if entry["level"] == "SEVERE"]


def test_the_site_sorts_filters_and_opens_an_entry_with_its_heatmap(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    results = tmp_path / "results"
    for method, seed, acc in [("sft", 0, 0.5), ("sft", 1, 0.7), ("grpo", 0, 0.8),
                              ("sdpo", 0, 0.2)]:
        _write(results, f"{method}-s{seed}", _result(tmp_path, method, seed, acc))
    site = tmp_path / "site"
    build([results], site)
    browser = _browser()
    try:
        browser.get((site / "index.html").as_uri())
        table = browser.find_element(By.CSS_SELECTOR, "table.board")

        def methods() -> list[str]:
            return [row.find_elements(By.TAG_NAME, "td")[1].text
                    for row in table.find_elements(By.CSS_SELECTOR, "tbody tr:not(.baseline)")
                    if row.is_displayed()]

        assert methods() == ["grpo", "sft", "sdpo"]  # ranked by ACC
        headers = {h.text.split()[0]: h for h in table.find_elements(By.TAG_NAME, "th")}
        headers["acc"].click()  # a metric where higher is better: best first
        assert methods() == ["grpo", "sft", "sdpo"]
        headers["acc"].click()  # again: the other way
        assert methods() == ["sdpo", "sft", "grpo"]
        headers["forgetting"].click()  # lower is better: best (lowest) first
        assert methods() == ["sdpo", "sft", "grpo"]
        headers["method"].click()
        assert methods() == ["grpo", "sdpo", "sft"]
        browser.find_element(By.CSS_SELECTOR, "input.filter").send_keys("sft")
        assert methods() == ["sft"]
        assert _errors(browser) == []
        browser.find_element(By.LINK_TEXT, "sft").click()
        assert "sft on smoke" in browser.title
        heatmap = browser.find_element(By.CSS_SELECTOR, "figure.heatmap svg")
        assert heatmap.size["width"] > 100 and heatmap.size["height"] > 50
        assert browser.find_elements(By.CSS_SELECTOR, "figure.curves svg")
        assert "2 seed(s): 0, 1" in browser.find_element(By.TAG_NAME, "h2").text
        browser.find_element(By.LINK_TEXT, "results.json").click()  # a raw file opens
        assert '"schema_version"' in browser.page_source
        browser.back()
        browser.find_element(By.PARTIAL_LINK_TEXT, "smoke").click()  # back to the index
        browser.find_element(By.LINK_TEXT, "compare them").click()
        assert len(browser.find_elements(By.CSS_SELECTOR, "figure.curves svg")) >= 2
        assert _errors(browser) == []
    finally:
        browser.quit()


def test_the_published_board_builds_and_every_page_opens_cleanly(tmp_path: Path) -> None:
    """`clbench leaderboard build leaderboard/results --out site`, as the Pages workflow runs it
    (strict: every published file validates), then every page in the browser."""
    from click.testing import CliRunner
    from selenium.webdriver.common.by import By

    from clbench.cli import cli

    published = REPO / "leaderboard" / "results"
    site = tmp_path / "site"
    built = CliRunner().invoke(cli, ["leaderboard", "build", str(published), "--out", str(site),
                                     "--strict"], env={"COLUMNS": "200"})
    assert built.exit_code == 0, built.output
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 4
    browser = _browser()
    try:
        browser.set_window_size(1920, 1080)
        browser.get((site / "index.html").as_uri())
        current, *older = browser.find_elements(By.CSS_SELECTOR, "section.suite")
        rows = current.find_elements(By.CSS_SELECTOR, "table.board tbody tr:not(.baseline)")
        (base,) = current.find_elements(By.CSS_SELECTOR, "table.board tbody tr.baseline")
        assert "base model (no training)" in base.text and "0.223" in base.text
        ranks = {row.find_elements(By.TAG_NAME, "td")[1].text:
                 row.find_elements(By.TAG_NAME, "td")[0].text for row in rows}
        # six entries, three seeds each; SFT and GRPO apart, the SDPO family one tied group
        assert len(rows) == 6 and ranks["sft"] == "1" and ranks["grpo"] == "2"
        assert sorted(v for k, v in ranks.items() if k not in ("sft", "grpo")) == ["=3"] * 4
        assert all(row.find_elements(By.TAG_NAME, "td")[-5].text == "3"
                   for row in rows)  # three seeds each
        # sorting by a metric keeps each cell's interval in view
        current.find_element(By.XPATH, ".//th[starts-with(normalize-space(.), 'bwt')]").click()
        cells = current.find_elements(By.CSS_SELECTOR, "tr:not(.baseline) td.metric")
        assert cells and all("[" in cell.text for cell in cells)
        # the date column is not clipped at 1920 px
        date = current.find_elements(By.CSS_SELECTOR, "thead th")[-1]
        assert date.is_displayed() and date.location["x"] + date.size["width"] <= 1920
        # older versions of the suite: apart, marked, their runs' diagnostics "not measured"
        assert older and all("superseded" in s.get_attribute("class") for s in older)
        heading = browser.find_element(By.CSS_SELECTOR, "h2.superseded-heading")
        assert heading.location["y"] > current.location["y"]
        assert "not measured" in older[0].text
        assert "not ranked" in browser.find_element(By.CSS_SELECTOR, "details.left-out").text
        for page in pages:
            browser.get(page.as_uri())
            assert browser.find_element(By.CSS_SELECTOR, "header a.home").text == \
                "clbench leaderboard"
            if page.parent.name == "entries":
                assert browser.find_element(By.CSS_SELECTOR, "figure.heatmap svg")
            assert _errors(browser) == [], page
    finally:
        browser.quit()
