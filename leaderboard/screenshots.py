"""The README's screenshots of the leaderboard, taken in headless Chromium (Selenium, Debian's
`chromium` and `chromium-driver`):

    clbench leaderboard build leaderboard/results --out site
    python leaderboard/screenshots.py site docs/img

writes `leaderboard-index.png` (the index) and `leaderboard-entry.png` (the first entry of the
first suite).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(site: Path, out: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1920,1000",
                 "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"),
                               options=options)
    try:
        out.mkdir(parents=True, exist_ok=True)
        browser.get((site / "index.html").resolve().as_uri())
        browser.save_screenshot(str(out / "leaderboard-index.png"))
        browser.find_element(By.CSS_SELECTOR, "table.board tbody tr td a").click()
        browser.set_window_size(1920, 1500)
        browser.save_screenshot(str(out / "leaderboard-entry.png"))
    finally:
        browser.quit()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
