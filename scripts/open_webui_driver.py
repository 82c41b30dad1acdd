"""Drive Open WebUI in headless Chromium: pick a model, send one chat message, wait for the
streamed reply, screenshot it (manual check run by scripts/open-webui-check.sh, not a test).

Needs `pip install playwright` (any venv) and a Chromium binary (Debian: `apt-get install chromium`);
`playwright install` is not needed. Exit status 0 when an assistant reply with text arrived and no
error was shown; the reply text, any error text and the timings are printed as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page, sync_playwright

ERROR_SELECTORS = ".chat-assistant [class*='red'], .chat-assistant .text-red-500, [data-sonner-toast][data-type='error']"

SCROLL_TO_TOP = """() => { for (const el of document.querySelectorAll('*')) {
    if (el.scrollHeight > el.clientHeight + 10 && /auto|scroll/.test(getComputedStyle(el).overflowY)) el.scrollTop = 0;
} }"""  # the screenshot shows the question too


def dismiss_popups(page: Page) -> None:
    """First visit: the changelog ("Okay, Let's Go!") and similar modals."""
    for label in ("Okay, Let's Go!", "Dismiss"):
        button = page.get_by_role("button", name=label, exact=True)
        try:
            if button.count() and button.first.is_visible():
                button.first.click(timeout=5_000)
        except PlaywrightError:
            pass  # it went away by itself
    page.keyboard.press("Escape")


MODEL_BUTTON = '#model-selector-model-button, button[aria-label="Select a model"]'  # 0.12 and older
MODEL_ITEM = 'button[aria-roledescription="model-item"], [role="listbox"] [role="option"]'


def pick_model(page: Page, model: str) -> str:
    """Select `model` in the model menu (already selected when it is the only one); returns the label."""
    button = page.locator(MODEL_BUTTON).first
    button.wait_for(timeout=30_000)
    if button.inner_text().strip() != model:
        button.click()
        items = page.locator(MODEL_ITEM)
        items.first.wait_for(timeout=30_000)
        match = items.filter(has_text=model)
        (match if match.count() else items).first.click()
    return button.inner_text().strip()


def wait_for_reply(page: Page, timeout_s: float, settle_s: float) -> tuple[str, str, float, float]:
    """(reply text, error text, seconds to the first text, seconds to the end of the stream)."""
    started = time.monotonic()
    first_text_s = -1.0
    last_text, last_change = "", time.monotonic()
    while time.monotonic() - started < timeout_s:
        assistant = page.locator(".chat-assistant").last
        text = assistant.inner_text().strip() if assistant.count() else ""
        errors = page.locator(ERROR_SELECTORS)
        error = "\n".join(e.inner_text().strip() for e in errors.all() if e.is_visible())
        if error:
            return text, error, first_text_s, time.monotonic() - started
        if text and first_text_s < 0:
            first_text_s = time.monotonic() - started
        if text != last_text:
            last_text, last_change = text, time.monotonic()
        done = page.locator('div[aria-label="Generation Info"], button[aria-label="Generation Info"]').count() > 0
        if text and (done or time.monotonic() - last_change > settle_s):
            return text, "", first_text_s, last_change - started
        time.sleep(0.25)
    return last_text, f"no finished reply after {timeout_s:.0f} s", first_text_s, time.monotonic() - started


def wait_for_idle(page: Page, timeout_s: float) -> float:
    """After the reply Open WebUI runs follow-up / title / tags requests with the stop button still
    shown; wait until it is gone (or the timeout). Returns the time.monotonic() it ended."""
    deadline = time.monotonic() + timeout_s
    stop = page.locator('button[aria-label="Stop"], #stop-response-button')
    while time.monotonic() < deadline and stop.count() and stop.first.is_visible():
        time.sleep(0.5)
    return time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--model", default="specexec-default")
    parser.add_argument("--message", default="Write a Python function that reads a file.")
    parser.add_argument("--screenshot", type=Path, default=Path("open-webui.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the reply")
    parser.add_argument("--settle", type=float, default=8.0, help="reply unchanged this long: finished")
    parser.add_argument("--tasks-timeout", type=float, default=120.0,
                        help="seconds to wait after the reply for the background tasks (stop button gone)")
    args = parser.parse_args()

    result: dict[str, object] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        try:
            page.goto(args.url, wait_until="domcontentloaded", timeout=120_000)
            page.locator("#chat-input").wait_for(timeout=120_000)
            time.sleep(2)
            dismiss_popups(page)
            result["model_selected"] = pick_model(page, args.model)
            dismiss_popups(page)
            page.locator("#chat-input").focus()  # focus, not click: a late toast may cover it
            page.keyboard.type(args.message)
            sent = time.monotonic()
            page.keyboard.press("Enter")
            page.locator(".chat-user").first.wait_for(timeout=30_000)
            reply, error, first_s, end_s = wait_for_reply(page, args.timeout, args.settle)
            result.update(reply=reply, error=error, first_text_s=round(first_s, 2), reply_done_s=round(end_s, 2))
            result["tasks_done_s"] = round(wait_for_idle(page, args.tasks_timeout) - sent, 2)
            result["title"] = page.title()
        except PlaywrightError as exc:
            result["error"] = " | ".join(f"playwright: {exc}".splitlines()[:4])
        finally:
            page.evaluate(SCROLL_TO_TOP)
            args.screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.screenshot))
            result["screenshot"] = str(args.screenshot)
            browser.close()
    print(json.dumps(result, indent=1))
    return 0 if result.get("reply") and not result.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
