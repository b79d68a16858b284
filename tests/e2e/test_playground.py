"""The playground at `/`, in headless Chromium (Debian's package, driven by Playwright) against the real
server: the numbers it shows are the API's. Set LOGPROBE_SCREENSHOTS=1 to refresh docs/screenshots/.

No wait here assumes a fast machine: every Playwright action and wait gets WAIT_MS (Playwright's own
default is 30 s), and every direct API request HTTP_TIMEOUT_S (httpx's default is 5 s)."""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
WAIT_MS = 600_000  # per Playwright action or wait: a loaded 2-core machine streams a few tokens a second
HTTP_TIMEOUT_S = 600
READY = "document.querySelector('#score-status').textContent === 'Ready.'"  # models and tokenizer read
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (the README's test command installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=WAIT_MS)
        yield b
        b.close()


def new_page(browser, viewport):
    """A page in a context of its own whose actions and waits all get WAIT_MS, and the page errors it
    collects."""
    ctx = browser.new_context(viewport=viewport)
    ctx.set_default_timeout(WAIT_MS)
    pg = ctx.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    return ctx, pg, errors


def open_ready(browser, server, viewport):
    ctx, pg, errors = new_page(browser, viewport)
    pg.goto(server + "/")
    pg.wait_for_function(READY)
    return ctx, pg, errors


def post(server, path, body):
    r = httpx.post(server + path, json=body, timeout=HTTP_TIMEOUT_S)
    r.raise_for_status()
    return r.json()


@pytest.fixture
def page(browser, server):
    ctx, pg, errors = open_ready(browser, server, {"width": 1280, "height": 900})
    yield pg
    ctx.close()
    assert not errors, errors


def shot(pg, name, tmp_path):
    path = DOCS / name if os.environ.get("LOGPROBE_SCREENSHOTS") else tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000


def test_score_view_shows_the_api_numbers(page, server, tmp_path):
    text = "The cat sat on the mat."
    page.fill("#score-text", text)
    page.fill("#score-k", "5")
    page.check("#score-entropy")
    sent = []
    page.on("request", lambda r: sent.append(r.post_data or "") if r.method == "POST" else None)
    page.click("#score-run")
    page.wait_for_function("document.querySelector('#score-status').textContent.startsWith('Scored')")
    # the entropy series comes from the server's position_stats, not from downloading the vocabulary
    assert any('"position_stats":true' in body for body in sent)
    assert not any("prompt_logprobs" in body for body in sent)
    api = post(server, "/v1/score", {"model": MODEL, "input": text, "top_logprobs": 5})["data"][0]
    spans = page.locator("#score-tokens .tok")
    assert spans.count() == api["num_tokens"] == 7
    for i in (0, 3, 5):
        spans.nth(i).hover()
        tip = page.inner_text("#tooltip")
        lp = api["token_logprobs"][i]
        assert f"log p = {lp:.4f}" in tip and f"p = {math.exp(lp):.4f}" in tip
        assert f"rank {api['token_ranks'][i]}" in tip
        for alt, value in api["top_logprobs"][i].items():
            assert f"{value:.3f}" in tip
    assert f"log-likelihood {api['logprob']:.3f}" in page.inner_text("#score-totals")
    assert f"perplexity {api['perplexity']:.3f}" in page.inner_text("#score-totals")
    assert page.locator("#score-line svg polyline").count() == 2  # surprisal and entropy
    assert page.locator("#score-bars svg rect").count() == 2 * 5  # probability and log probability bars
    spans.nth(3).hover()
    shot(page, "score.png", tmp_path)


def test_keyboard_focus_opens_the_tooltip(page):
    page.click("#score-run")
    page.wait_for_function("document.querySelector('#score-status').textContent.startsWith('Scored')")
    page.locator("#score-tokens .tok").first.focus()
    assert page.is_visible("#tooltip")
    page.keyboard.press("Escape")
    assert not page.is_visible("#tooltip")


def test_generate_streams_and_branches(page, server, tmp_path):
    page.click("#tab-generate")
    page.fill("#gen-prompt", "Once upon a time")
    page.fill("#gen-max", "12")
    page.fill("#gen-temp", "0.8")
    page.fill("#gen-seed", "5")
    page.click("#gen-run")
    page.wait_for_function("document.querySelector('#gen-status').textContent.startsWith('Done')")
    plain = post(server, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12,
                                             "temperature": 0.8, "seed": 5, "logprobs": 5})
    tokens = page.locator("#gen-tokens .tok")
    assert tokens.count() == len(plain["choices"][0]["logprobs"]["tokens"])
    assert page.inner_text("#gen-tokens").replace("⏎\n", "\n") == plain["choices"][0]["text"]
    tokens.nth(1).hover()
    lp = plain["choices"][0]["logprobs"]["token_logprobs"][1]
    assert f"log p = {lp:.4f}" in page.inner_text("#tooltip")
    shot(page, "generate.png", tmp_path)
    alt = page.locator("#tooltip button.alt").first
    chosen = alt.inner_text()
    alt.click()
    page.wait_for_function("document.querySelector('#gen-status').textContent.startsWith('Done')")
    assert page.locator("#gen-tokens .tok").nth(1).inner_text() == eval(chosen)  # the branch took the alternative
    assert page.locator("#gen-tokens .tok").count() == 2 + 12


def test_generate_shows_the_token_tree(page, server, tmp_path):
    """The Generate view's token tree: every node of /v1/tree's answer, in its order, with its token and
    probability; a collapsed node opens to show its children."""
    page.click("#tab-generate")
    page.fill("#gen-prompt", "The capital of France is")
    page.fill("#gen-temp", "1")
    page.fill("#gen-top-p", "1")
    page.fill("#tree-depth", "3")
    page.fill("#tree-branches", "2")
    page.click("#tree-run")
    page.wait_for_function("document.querySelector('#tree-status').textContent.includes('nodes')")
    tree = post(server, "/v1/tree", {"model": MODEL, "prompt": "The capital of France is", "depth": 3, "branches": 2,
                                     "temperature": 1, "top_p": 1})
    labels = page.locator("#tree .tree-label")
    assert labels.count() == len(tree["nodes"]) == 14

    def order(index):  # the nodes depth first, as the nested list shows them
        yield tree["nodes"][index]
        for child in tree["nodes"][index]["children"]:
            yield from order(child)

    shown = [node for root in tree["roots"] for node in order(root)]
    for i, node in enumerate(shown):
        assert labels.nth(i).locator(".tree-token").text_content().replace("⏎\n", "\n") == node["token"]
        p = 100 * math.exp(node["logprob"])
        assert labels.nth(i).locator(".tree-p").text_content() == f"{p:.{1 if node['logprob'] > -4.6 else 3}f}%"
    closed = page.locator("#tree details:not([open])").first.element_handle()  # a node of depth 2
    child = closed.query_selector(".tree-children .tree-label")
    assert not child.is_visible()
    closed.query_selector("summary").click()
    assert child.is_visible()
    shot(page, "token-tree.png", tmp_path)


def test_compare_view(page, server, tmp_path):
    page.click("#tab-compare")
    page.click("#compare-run")
    page.wait_for_selector("#compare-table tbody tr")
    texts = ["The cat sat on the mat.", "The mat sat on the cat."]
    api = post(server, "/v1/score", {"model": MODEL, "input": texts})["data"]
    rows = page.locator("#compare-table tbody tr")
    assert rows.count() == 2
    for i, d in enumerate(api):
        assert f"{d['mean_logprob']:.3f}" in rows.nth(i).inner_text()
    best = max(range(2), key=lambda i: api[i]["mean_logprob"])
    assert "best" in rows.nth(best).get_attribute("class")
    shot(page, "compare.png", tmp_path)


def test_lens_view(page, server, tmp_path):
    """Layers x positions: each cell the probability a layer gives its column's token, the API's number."""
    page.click("#tab-lens")
    page.fill("#lens-step", "10")
    page.click("#lens-run")
    page.wait_for_function("document.querySelector('#lens-status').textContent.startsWith('Read')")
    text = page.input_value("#lens-text")
    api = post(server, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 0,
                                           "output_lens": {"layers": [0, 10, 20, 30], "top_k": 3}})
    lens = api["choices"][0]["logit_lens"]
    rows = page.locator("#lens-table tbody tr")
    assert rows.count() == 4 and rows.nth(0).locator("th").inner_text() == "30 (out)"
    for r, entry in enumerate(reversed(lens["layers"])):
        cells = rows.nth(r).locator("td")
        assert cells.count() == len(lens["tokens"])
        for i in range(1, len(lens["tokens"])):
            assert math.isclose(float(cells.nth(i).get_attribute("data-p")), math.exp(entry["logprobs"][i]),
                                rel_tol=1e-4, abs_tol=1e-6)
            shown = entry["top_tokens"][i][0].replace("\n", "⏎\n").replace("\t", "⇥")  # as the page shows it
            assert cells.nth(i).text_content() == shown
    shot(page, "lens.png", tmp_path)


def test_patch_view(page, server, tmp_path):
    """One row per patched layer: the next token under the patch and both probabilities, the API's numbers."""
    page.click("#tab-patch")
    page.fill("#patch-step", "10")
    page.click("#patch-run")
    page.wait_for_function("document.querySelector('#patch-status').textContent.startsWith('Patched')")
    rows = page.locator("#patch-table tbody tr")
    assert rows.count() == 4  # layers 0, 10, 20 and 30
    text, source = page.input_value("#patch-text"), page.input_value("#patch-source")
    answers = set()
    for r, layer in enumerate((0, 10, 20, 30)):
        api = post(server, "/v1/completions", {
            "model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0, "logprobs": 1, "return_unmodified": True,
            "interventions": [{"layer": layer, "op": "patch", "positions": [-1],
                               "source": {"prompt": source, "position": -1}}]})["choices"][0]
        row = rows.nth(r)
        assert row.get_attribute("data-layer") == str(layer)
        assert row.locator("td").nth(0).inner_text() == '"' + api["text"] + '"'
        assert math.isclose(float(row.get_attribute("data-p")), math.exp(api["logprobs"]["token_logprobs"][0]),
                            rel_tol=1e-4, abs_tol=1e-6)
        assert math.isclose(float(row.get_attribute("data-q")), math.exp(api["unmodified"]["logprobs"][-1]),
                            rel_tol=1e-4, abs_tol=1e-6)
        answers.add(api["text"])
    assert answers == {" Paris", " Rome"}  # the source's answer appears once the last layers are patched
    shot(page, "patch.png", tmp_path)


# Each tab, the fields set to keep its run small (few tokens, few layers), its button, and the status its
# run ends with.
TABS = [("score", {}, "#score-run", "score-status", "Scored"),
        ("generate", {"#gen-max": "8"}, "#gen-run", "gen-status", "Done"),
        ("compare", {}, "#compare-run", "compare-status", "Most natural"),
        ("lens", {"#lens-step": "10"}, "#lens-run", "lens-status", "Read"),
        ("patch", {"#patch-step": "10"}, "#patch-run", "patch-status", "Patched")]
PAGE_WIDTH = "[document.scrollingElement.scrollWidth, innerWidth]"


def test_phone_sized_screen_every_tab_fits(browser, server, tmp_path):
    """At 390 px nothing runs off the side on any tab, filled with its results: a wide table scrolls in
    its own box, the page never sideways."""
    ctx, pg, errors = open_ready(browser, server, PHONE)
    for tab, fields, button, status, done in TABS:
        pg.click(f"#tab-{tab}")
        for selector, value in fields.items():
            pg.fill(selector, value)
        pg.click(button)
        pg.wait_for_function(f"document.querySelector('#{status}').textContent.startsWith({done!r})")
        scroll_width, width = pg.evaluate(PAGE_WIDTH)
        assert scroll_width <= width == PHONE["width"], (tab, scroll_width)
        if tab == "score":
            shot(pg, "phone.png", tmp_path)
    assert pg.locator("#patch-table tbody tr").count() == 4  # the widest table is there, filled
    ctx.close()
    assert not errors, errors


def test_model_select_says_it_is_loading_and_why_it_failed(browser, server):
    """Before /v1/models answers the select shows a hint, not an empty list; when the request fails, the
    reason stands beside it (on every tab: the header holds both)."""
    ctx, pg, errors = new_page(browser, PHONE)
    held = []
    pg.route("**/v1/models", lambda route: held.append(route))  # the request waits until the test answers it
    pg.goto(server + "/")
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while not held and time.monotonic() < deadline:
        pg.wait_for_timeout(50)
    assert held, "the page never asked for /v1/models"
    assert pg.locator("#model option").all_text_contents() == ["loading models…"]
    assert pg.is_disabled("#model") and not pg.is_visible("#model-hint")
    held[0].fulfill(status=503, content_type="application/json",
                    body='{"error": {"message": "the server is starting", "type": "server_error"}}')
    pg.wait_for_function("!document.querySelector('#model-hint').hidden")
    assert pg.locator("#model option").all_text_contents() == ["no models"]
    assert pg.inner_text("#model-hint") == "Cannot load the models: the server is starting"
    pg.click("#tab-patch")
    assert pg.is_visible("#model-hint")
    assert pg.evaluate(PAGE_WIDTH)[0] <= PHONE["width"]
    ctx.close()
    assert not errors, errors


# Wraps over several lines at 390 px, and holds a 64-character token (one run of '#') whose tooltip has to wrap.
LONG_TEXT = ("# Notes\n" + "#" * 64 + "\nThe quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat "
             "by the window, and nobody notices the rain outside.")
OUTSIDE = """(w) => [tooltip, ...tooltip.querySelectorAll('*')].flatMap((e) => {
  const r = e.getBoundingClientRect();
  return r.left < 0 || r.right > w ? [`${e.tagName} ${e.textContent.slice(0, 20)} [${r.left}, ${r.right}]`] : [];
})"""


def test_phone_tooltip_and_model_select_stay_on_screen(browser, server):
    width = PHONE["width"]
    ctx, pg, errors = open_ready(browser, server, PHONE)
    pg.fill("#score-text", LONG_TEXT)
    pg.click("#score-run")
    pg.wait_for_function("document.querySelector('#score-status').textContent.startsWith('Scored')")
    boxes = pg.evaluate("""[...document.querySelectorAll('#score-tokens .tok')].map((s) => {
      const r = s.getBoundingClientRect();
      return {text: s.textContent, right: r.right, top: r.top, pieces: s.getClientRects().length}; })""")
    assert len({round(b["top"]) for b in boxes}) > 3  # the text wraps
    # The token that ends furthest right on its line (one that wraps spans two lines and starts at the left).
    edge = max((i for i, b in enumerate(boxes) if b["pieces"] == 1), key=lambda i: boxes[i]["right"])
    assert boxes[edge]["right"] > width - 80
    long = next(i for i, b in enumerate(boxes) if b["text"] == "#" * 64)
    tokens = pg.locator("#score-tokens .tok")
    # Hover (the pointer) and focus (the keyboard), after a tooltip stood elsewhere and from none open.
    for open_ in (lambda i: tokens.nth(i).hover(), lambda i: tokens.nth(i).focus()):
        for i in (0, edge, long, edge):
            open_(i)
            assert pg.is_visible("#tooltip")
            tip = pg.locator("#tooltip").bounding_box()
            assert 0 <= tip["x"] and tip["x"] + tip["width"] <= width, (boxes[i]["text"], tip)
            assert tip["width"] <= width - 8
            assert pg.evaluate(OUTSIDE, width) == [], boxes[i]["text"]  # nothing in it spills past the edges
        pg.keyboard.press("Escape")
    select = pg.locator("#model").bounding_box()
    assert select["x"] >= 0 and select["x"] + select["width"] <= width
    header_right = pg.evaluate("""(() => { const h = document.querySelector('header');
      return h.getBoundingClientRect().right - parseFloat(getComputedStyle(h).paddingRight); })()""")
    assert select["x"] + select["width"] <= header_right + 0.5  # inside the header's padding, not over it
    assert pg.evaluate("document.documentElement.scrollWidth") <= width  # no horizontal scroll
    ctx.close()
    assert not errors, errors
