#!/usr/bin/env python3
"""The web console in a real headless browser, as a platform team would use it.

Run by tests/integration/tests/it/console.rs, which sets the scene: a type whose one task
was dead-lettered by a failing handler (labels pipeline=vod, asset=broken), the handler
since mended, and a second type with completed tasks. The story signs in, finds the failed
task through the overview and the filters, reads its timeline, retries it and watches it
complete; then looks at the type's dead letters again, redrives (nothing is left) and signs
out. Then another tenant's client signs in and sees its own task only: not the first
tenant's types, tasks, or the failed task by its id. Exits non-zero with what went wrong, the browser's console log and the page's tail.

Environment: CONVEYOR_URL (http://127.0.0.1:PORT), CONVEYOR_TOKEN, CONVEYOR_FAILED_TYPE,
CONVEYOR_FAILED_ID, CONVEYOR_OTHER_TOKEN and CONVEYOR_OTHER_ID (another tenant's client and
its one task), CONVEYOR_SCREENSHOTS (a directory to save PNGs in, or empty for none).
Needs selenium and Debian's chromium and chromium-driver (scripts/browser.sh).
"""

import json
import os
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
    WebDriverException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import Select, WebDriverWait

URL = os.environ["CONVEYOR_URL"].rstrip("/")
TOKEN = os.environ["CONVEYOR_TOKEN"]
FAILED_TYPE = os.environ["CONVEYOR_FAILED_TYPE"]
FAILED_ID = os.environ["CONVEYOR_FAILED_ID"]
OTHER_TOKEN = os.environ["CONVEYOR_OTHER_TOKEN"]
OTHER_ID = os.environ["CONVEYOR_OTHER_ID"]
SHOTS = os.environ.get("CONVEYOR_SCREENSHOTS", "")

# The machine running this is busy (builds beside it): waits are generous, never sleeps.
TIMEOUT = 30
SETTLE_TIMEOUT = 60
WIDTH, HEIGHT = 1280, 900


class StoryFailure(Exception):
    pass


def step(message):
    print(f"story: {message}", flush=True)


def check(condition, message):
    if not condition:
        raise StoryFailure(message)


def api(path, token=TOKEN):
    """GET from the API directly: what the page should be showing."""
    request = urllib.request.Request(
        f"{URL}/v1/{path}", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--disable-extensions",
        "--no-first-run",
        f"--window-size={WIDTH},{HEIGHT}",
        "--lang=en-US",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


class Story:
    def __init__(self, driver):
        self.d = driver

    # ---- helpers --------------------------------------------------------------------

    def wait(self, what, condition, timeout=TIMEOUT):
        try:
            return WebDriverWait(
                self.d,
                timeout,
                poll_frequency=0.2,
                ignored_exceptions=(StaleElementReferenceException, NoSuchElementException),
            ).until(lambda d: condition())
        except TimeoutException:
            raise StoryFailure(f"timed out after {timeout} s waiting for {what}") from None

    def find(self, css):
        return self.d.find_element(By.CSS_SELECTOR, css)

    def shown(self, css):
        found = self.d.find_elements(By.CSS_SELECTOR, css)
        return bool(found) and found[0].is_displayed()

    def text(self, css):
        return self.find(css).text

    def hash(self):
        return urllib.parse.unquote(self.d.execute_script("return location.hash"))

    def rows(self):
        """The task list's rows as (id, state), read at once."""
        return [
            tuple(row)
            for row in self.d.execute_script(
                "return [...document.querySelectorAll('table#tasks tbody tr[data-id]')]"
                ".map(r => [r.dataset.id, r.dataset.state])"
            )
        ]

    def loads(self):
        return int(self.find("table#tasks").get_attribute("data-loads") or 0)

    def list_loaded_after(self, before):
        """Waits for a list load that began after `before` loads to finish."""
        self.wait(
            "the task list to load",
            lambda: self.loads() > before
            and self.find("table#tasks").get_attribute("aria-busy") == "false",
        )

    def apply(self, state=None, task_type=None, labels=None):
        """Sets the filters given and presses Apply; returns once the list has loaded."""
        if state is not None:
            Select(self.find("#filter-state")).select_by_value(state)
        if task_type is not None:
            value = self.type_option(task_type) if task_type else ""
            Select(self.find("#filter-type")).select_by_value(value)
        if labels is not None:
            field = self.find("#filter-labels")
            field.clear()
            field.send_keys(labels)
        before = self.loads()
        self.find("#apply").click()
        self.list_loaded_after(before)

    def type_option(self, name):
        """The type filter's option for `name` (its value is namespace/name)."""
        values = []
        self.wait(
            f"{name} among the type filter's options",
            lambda: values.extend(
                o.get_attribute("value")
                for o in self.d.find_elements(By.CSS_SELECTOR, "#filter-type option")
                if o.get_attribute("value").endswith("/" + name)
            )
            or values,
        )
        return values[0]

    def confirm(self, accept, expect_in_text):
        alert = WebDriverWait(self.d, TIMEOUT).until(EC.alert_is_present())
        said = alert.text
        if accept:
            alert.accept()
        else:
            alert.dismiss()
        check(expect_in_text in said, f"the confirmation {said!r} does not mention {expect_in_text!r}")

    def screenshot(self, name):
        if not SHOTS:
            return
        os.makedirs(SHOTS, exist_ok=True)
        # The whole page: grow the window to its height, shoot, and shrink it back.
        height = self.d.execute_script(
            "return Math.ceil(Math.max(document.documentElement.scrollHeight, document.body.scrollHeight))"
        )
        self.d.execute_script("window.scrollTo(0, 0); document.activeElement && document.activeElement.blur()")
        self.d.set_window_size(WIDTH, max(HEIGHT, min(height + 140, 3000)))
        path = os.path.join(SHOTS, name)
        self.d.save_screenshot(path)
        self.d.set_window_size(WIDTH, HEIGHT)
        step(f"saved {path}")

    # ---- the story ------------------------------------------------------------------

    def run(self):
        d = self.d
        step(f"opening {URL}/console/")
        d.get(f"{URL}/console/")
        self.wait("the token prompt", lambda: self.shown("#token"))
        check(self.find("#token").get_attribute("type") == "password", "the token field is not a password field")

        step("a wrong token is refused with the API's message")
        self.find("#token").send_keys("not-the-token")
        self.find("#sign-in").click()
        self.wait("the refusal", lambda: self.shown("#signin-error") and self.text("#signin-error"))
        check("refused" in self.text("#signin-error"), f"unexpected refusal: {self.text('#signin-error')!r}")
        check(self.shown("#token"), "the token prompt went away after a refused token")

        step("signing in")
        self.find("#token").send_keys(TOKEN)
        self.find("#sign-in").click()
        self.wait("the list view", lambda: self.shown("#list-view"))
        stored = d.execute_script("return sessionStorage.getItem('conveyor.token')")
        check(stored == TOKEN, "the token is not kept in sessionStorage")

        step("the task types at a glance: the failing type has 1 dead letter")
        failing_row = f'#types tbody tr[data-type="{FAILED_TYPE}"]'
        self.wait(
            f"{FAILED_TYPE} with 1 dead letter in the overview",
            lambda: self.find(failing_row).get_attribute("data-dead-letters") == "1",
        )
        others = d.find_elements(By.CSS_SELECTOR, f'#types tbody tr[data-type]:not([data-type="{FAILED_TYPE}"])')
        check(others, "the overview shows only the failing type")
        check(
            all(row.get_attribute("data-dead-letters") == "0" for row in others),
            "another type shows dead letters",
        )

        step("all tasks, newest first")
        self.list_loaded_after(0)
        self.wait("several tasks listed", lambda: len(self.rows()) >= 4)
        states = {state for _, state in self.rows()}
        check({"COMPLETED", "DEAD_LETTER"} <= states, f"the unfiltered list shows states {states}")
        self.screenshot("console-list.png")

        step("the overview's dead-letter link filters to that type's dead letters")
        before = self.loads()
        self.find(f"{failing_row} a.dead-link").click()
        self.list_loaded_after(before)
        check("state=DEAD_LETTER" in self.hash() and FAILED_TYPE in self.hash(), f"the hash is {self.hash()!r}")
        check(self.rows() == [(FAILED_ID, "DEAD_LETTER")], f"the dead letters are {self.rows()}")
        check(self.shown("#dead-letters") and self.shown("#redrive"), "no redrive panel for a type's dead letters")
        check(FAILED_TYPE in self.text("#dead-type"), "the redrive panel names another type")
        self.screenshot("console-dead-letters.png")

        step("the filters by hand: state DEAD_LETTER and the failing type")
        before = self.loads()
        self.find("nav a[href='#tasks']").click()
        self.list_loaded_after(before)
        check(len(self.rows()) >= 4, "the Tasks link did not clear the filters")
        self.apply(state="DEAD_LETTER", task_type=FAILED_TYPE)
        check(self.rows() == [(FAILED_ID, "DEAD_LETTER")], f"filtered to dead letters: {self.rows()}")
        check(
            "state=DEAD_LETTER" in self.hash() and f"type={FAILED_TYPE}" in self.hash(),
            f"the filters are not in the URL: {self.hash()!r}",
        )

        step("a label selector narrows the list")
        self.apply(labels="asset=broken")
        check(self.rows() == [(FAILED_ID, "DEAD_LETTER")], f"asset=broken: {self.rows()}")
        check("labels=asset=broken" in self.hash(), f"the selector is not in the URL: {self.hash()!r}")
        self.apply(labels="asset=fine")
        check(self.rows() == [], f"asset=fine matched {self.rows()}")
        check("No tasks match" in self.text("table#tasks tbody"), "no empty-list message")

        step("a malformed selector shows the API's message and leaves the page working")
        bad = "asset in (x"
        status, body = api("tasks?" + urllib.parse.urlencode({"labelSelector": bad}))
        check(status == 400, f"the API answered {status} to a malformed selector")
        message = body["error"]["message"]
        self.apply(labels=bad)
        self.wait("the error banner", lambda: self.shown("#banner"))
        check(message in self.text("#banner"), f"the banner says {self.text('#banner')!r}, not {message!r}")
        check(self.rows() == [], "rows shown for a refused filter")
        self.apply(labels="asset=broken")
        check(not self.shown("#banner"), "the error banner stayed after a good filter")
        check(self.rows() == [(FAILED_ID, "DEAD_LETTER")], f"after the error: {self.rows()}")

        step("a reload keeps the session and the filters (the URL holds them)")
        d.refresh()
        self.wait("the list view after a reload", lambda: self.shown("#list-view"))
        self.wait("the list after a reload", lambda: self.rows() == [(FAILED_ID, "DEAD_LETTER")])
        check(self.find("#filter-state").get_attribute("value") == "DEAD_LETTER", "state filter lost on reload")
        check(self.find("#filter-labels").get_attribute("value") == "asset=broken", "label filter lost on reload")
        check(not self.shown("#token"), "asked for the token again after a reload")

        step("opening the failed task")
        row = self.find(f'table#tasks tbody tr[data-id="{FAILED_ID}"]')
        link = row.find_element(By.CSS_SELECTOR, "a")
        check(link.get_attribute("title") == FAILED_ID, "the short id has not the full id as its title")
        row.find_elements(By.CSS_SELECTOR, "td")[2].click()  # the row, not its link
        self.wait("the task page", lambda: self.shown("#task-view") and self.text("#task-id") == FAILED_ID)
        self.wait("the task's state", lambda: self.find("#task-state").get_attribute("data-state") == "DEAD_LETTER")
        check(self.shown("#retry"), "no Retry button on a dead letter")
        check(not self.shown("#cancel"), "a Cancel button on a dead letter")

        _, task = api(f"tasks/{FAILED_ID}")
        self.wait("the payload", lambda: self.text("#task-payload").strip() not in ("", "—"))
        check(json.loads(self.text("#task-payload")) == task["payload"], "the payload shown is not the task's")
        for key, value in task["labels"].items():
            check(f"{key}={value}" in self.text("#task-fields"), f"label {key}={value} not shown")

        step("its timeline shows the failure and the dead-lettering, highlighted")
        self.wait("the timeline", lambda: self.shown('#timeline tbody tr[data-to-state="DEAD_LETTER"]'))
        error = task["error"]
        check(error, "the scene's task has no error")
        failures = d.find_elements(By.CSS_SELECTOR, "#timeline tbody tr.bad")
        check(any(error in f.text for f in failures), f"the handler's error {error!r} is not among the highlighted steps")
        check(error in self.text("#task-fields"), "the last error is not among the task's fields")

        step("Retry asks first; dismissing does nothing")
        self.find("#retry").click()
        self.confirm(accept=False, expect_in_text=FAILED_ID)
        check(self.find("#task-state").get_attribute("data-state") == "DEAD_LETTER", "a dismissed retry changed the task")
        check(not self.shown("#action-result"), "an outcome shown for a dismissed retry")

        step("Retry, confirmed: the task goes back to work and completes")
        self.find("#retry").click()
        self.confirm(accept=True, expect_in_text=FAILED_ID)
        self.wait("the retry's outcome", lambda: "Retried" in self.text("#action-result"))
        self.wait(
            "the retried task to complete",
            lambda: self.find("#task-state").get_attribute("data-state") == "COMPLETED",
            SETTLE_TIMEOUT,
        )
        self.wait("COMPLETED on the timeline", lambda: self.shown('#timeline tbody tr[data-to-state="COMPLETED"]'))
        check("retried by" in self.text("#timeline"), "the retry is not on the timeline")
        check(not self.shown("#retry") and not self.shown("#cancel"), "remedies offered on a completed task")
        self.wait("the outcome to say COMPLETED", lambda: "COMPLETED" in self.text("#action-result"))
        self.screenshot("console-task.png")

        step("the type's dead letters are gone; redrive finds nothing left")
        self.find("#back").click()
        self.wait("the list view", lambda: self.shown("#list-view"))
        self.wait(
            f"{FAILED_TYPE} with no dead letter in the overview",
            lambda: self.find(failing_row).get_attribute("data-dead-letters") == "0",
        )
        before = self.loads()
        self.find(f"{failing_row} a.dead-link").click()
        self.list_loaded_after(before)
        check(self.rows() == [], f"dead letters left after the retry: {self.rows()}")
        self.find("#redrive").click()
        self.confirm(accept=False, expect_in_text=FAILED_TYPE)
        check(not self.shown("#redrive-result"), "a dismissed redrive did something")
        self.find("#redrive").click()
        self.confirm(accept=True, expect_in_text=FAILED_TYPE)
        self.wait("the redrive's answer", lambda: self.find("#redrive-result").get_attribute("data-redriven") is not None)
        result = self.find("#redrive-result")
        check(result.get_attribute("data-redriven") == "0", f"redrive says {result.text!r}")
        check(result.get_attribute("data-more") == "false", f"redrive says {result.text!r}")

        self.sign_out()
        self.another_tenant()
        self.sign_out()

        step("no script errors or Content-Security-Policy violations")
        problems = [
            entry["message"]
            for entry in browser_log(d)
            if "Content Security Policy" in entry["message"]
            or "Uncaught" in entry["message"]
            or "Refused to" in entry["message"]
        ]
        check(not problems, "the browser reported:\n  " + "\n  ".join(problems))


    def sign_out(self):
        step("signing out forgets the token")
        self.find("#sign-out").click()
        self.wait("the token prompt", lambda: self.shown("#token"))
        stored = self.d.execute_script("return sessionStorage.getItem('conveyor.token')")
        check(stored is None, "the token outlived the sign-out")
        check(not self.shown("#list-view") and not self.shown("#task-view"), "data still shown after signing out")

    def another_tenant(self):
        d = self.d
        step("another tenant's client signs in: its own type and task, nothing else")
        self.find("#token").clear()
        self.find("#token").send_keys(OTHER_TOKEN)
        self.find("#sign-in").click()
        self.wait("the list view", lambda: self.shown("#list-view"))
        self.wait("its one task listed", lambda: [id for id, _ in self.rows()] == [OTHER_ID])
        types = self.d.execute_script(
            "return [...document.querySelectorAll('#types tbody tr[data-type]')].map(r => r.dataset.type)"
        )
        check(FAILED_TYPE not in types and len(types) == 1, f"the other tenant's overview shows {types}")
        options = [o.get_attribute("value") for o in d.find_elements(By.CSS_SELECTOR, "#filter-type option")]
        check(not any(v.endswith("/" + FAILED_TYPE) for v in options), f"the type filter offers {options}")
        self.apply(state="DEAD_LETTER")
        check(self.rows() == [], f"the other tenant sees dead letters {self.rows()}")

        step("the first tenant's task by its id: the API's not-found message, no remedies")
        status, body = api(f"tasks/{FAILED_ID}", token=OTHER_TOKEN)
        check(status == 404, f"the API answered {status} to another tenant's id")
        d.execute_script("location.hash = arguments[0]", f"#task/{FAILED_ID}")
        self.wait("the not-found banner", lambda: self.shown("#banner"))
        check(body["error"]["message"] in self.text("#banner"), f"the banner says {self.text('#banner')!r}")
        check(not self.shown("#retry") and not self.shown("#cancel"), "remedies offered on another tenant's task")
        check(self.find("#task-payload").text.strip() in ("", "—"), "another tenant's payload is shown")


def browser_log(driver):
    try:
        return driver.get_log("browser")
    except WebDriverException:
        return []


def report(driver, failure):
    print(f"\nconsole story FAILED: {failure}", file=sys.stderr)
    if not isinstance(failure, StoryFailure):
        traceback.print_exc()
    if driver is None:
        return
    try:
        print(f"at {driver.current_url}", file=sys.stderr)
        print("--- browser console log ---", file=sys.stderr)
        for entry in browser_log(driver):
            print(f"{entry.get('level')} {entry.get('message')}", file=sys.stderr)
        print("--- page source (tail) ---", file=sys.stderr)
        print(driver.page_source[-4000:], file=sys.stderr)
        shot = os.path.join(tempfile.gettempdir(), f"console-failure-{int(time.time())}.png")
        driver.save_screenshot(shot)
        print(f"--- a screenshot of the failure: {shot}", file=sys.stderr)
    except WebDriverException as err:
        print(f"(the browser could not say more: {err})", file=sys.stderr)


def main():
    driver = None
    try:
        driver = browser()
        driver.set_page_load_timeout(TIMEOUT * 2)
        Story(driver).run()
    except Exception as failure:  # every failure is reported the same way
        report(driver, failure)
        return 1
    finally:
        if driver is not None:
            driver.quit()
    step("passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
