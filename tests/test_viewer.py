"""The live viewer (gateway_svc/static/) in headless Chromium, driven by Playwright, against the
real system with its HTTP gateway."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest

from specinfer.tree import depths

from .conftest import MODELS
from .services import reference_greedy
from .test_gateway import CHAT_TEMPLATE

CHROMIUM = Path("/usr/bin/chromium")
# without the background-networking flags Chromium keeps calling out into the closed network
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EXPANSION = "2,2,1,1"
MAX_TOKENS = 48

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason=f"needs Debian's chromium at {CHROMIUM} "
                                "(`apt-get install chromium`; .ci/run installs it)")


@pytest.fixture(scope="module")
def system():
    from specinfer_rpc.launch import launch

    system = launch(MODELS / "llm", [MODELS / "ssm-0", MODELS / "ssm-1"], speculators=2, port=0, http_port=0)
    yield system
    system.stop()


@pytest.fixture(scope="module")
def gateway(system) -> str:
    """The whole system with the gateway in front; its base URL."""
    return "http://" + system.by_name("gateway").address


@pytest.fixture(scope="module")
def chat_gateway(system, tmp_path_factory) -> str:
    """A second gateway on the same manager whose tokenizer has a chat template; its base URL."""
    from specinfer_rpc.launch import System

    tok = tmp_path_factory.mktemp("chat-tokenizer")
    shutil.copy(MODELS / "llm" / "tokenizer.json", tok)
    config = json.loads((MODELS / "llm" / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    extra = System()
    try:
        gw = extra.start("gateway-chat", "gateway_svc", ["--port", "0", "--manager", system.manager.address,
                                                         "--tokenizer", str(tok)], 120, http="http")
        yield "http://" + gw.address
    finally:
        extra.stop()


@pytest.fixture
def page():
    """A fresh headless Chromium page; the page's uncaught errors are collected in page.errors."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.errors = []
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        yield page
        browser.close()


def stream_completion(base: str, body: dict, path: str = "/v1/completions") -> tuple[list[dict], dict]:
    """POST a streamed completion with urllib: (the step choices, usage)."""
    request = urllib.request.Request(base + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        events = [e[len("data: "):] for e in response.read().decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return [c["choices"][0] for c in chunks if c["choices"]], chunks[-1]["usage"]


def run_in_viewer(page, prompt: str, max_tokens: int) -> None:
    """Generate greedily with the fixed EXPANSION in the viewer page, until done; no page errors."""
    page.fill("#prompt", prompt)
    page.select_option("#speculation", "fixed")
    page.fill("#expansion", EXPANSION)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#seed", "0")
    page.click("#run")
    page.wait_for_function("['done', 'error'].includes(document.getElementById('status').dataset.state)",
                           timeout=300_000)
    assert page.get_attribute("#status", "data-state") == "done", page.text_content("#error")
    assert page.errors == []


def test_viewer_streams_the_greedy_text_and_draws_every_steps_tree_with_its_accepted_path(
        gateway, page, heldout_prompts, heldout_ids, tmp_path):
    prompt = heldout_prompts[0]["prompt"]
    page.goto(gateway + "/")
    page.wait_for_function("document.getElementById('server').textContent.includes('speculators')")
    run_in_viewer(page, prompt, MAX_TOKENS)

    # the text shown is the LLM's own greedy continuation, as the API streams it
    steps, usage = stream_completion(gateway, {
        "model": json.loads(urllib.request.urlopen(gateway + "/v1/models").read())["data"][0]["id"],
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 0, "stream": True,
        "stream_options": {"include_usage": True}, "speculation": EXPANSION, "return_draft_trees": True})
    assert [t for s in steps for t in s["token_ids"]] == reference_greedy([heldout_ids[0]], MAX_TOKENS)[0]
    assert page.text_content("#completion") == "".join(s["text"] for s in steps) != ""

    # one row per verifier step; the large tree follows the latest step until a row is clicked
    assert page.locator("#steps li").count() == len(steps) == int(page.get_attribute("#fig-steps", "data-value"))
    assert page.locator("#tree svg.tree").get_attribute("data-step") == str(len(steps))
    # a step with accepted drafts shows them as a path, with the bonus token below its end
    with_path = page.locator("#steps li:not([data-accepted='0'])").nth(1)  # not the newest: it may be cut short
    step = steps[int(with_path.get_attribute("data-step")) - 1]
    with_path.click()
    assert page.locator("#tree svg.tree").get_attribute("data-step") == with_path.get_attribute("data-step")
    assert page.locator("#tree [data-accepted='true']").count() == len(step["draft_tree"]["accepted"]) > 0
    assert page.locator("#tree [data-bonus='true']").count() == 1
    assert page.locator("#tree g.node.draft").count() == len(step["draft_tree"]["token_ids"])

    # the running figures
    assert float(page.get_attribute("#fig-tps", "data-value")) > 1
    assert int(page.get_attribute("#fig-tokens", "data-value")) == usage["completion_tokens"]
    assert float(page.get_attribute("#fig-rate", "data-value")) > 0
    rates = [float(r) for r in page.locator("#depth-chart .bar").evaluate_all("bars => bars.map(b => b.dataset.rate)")]
    # a bar per depth the trees reached (context lookup's chain may reach past the expansion's)
    deepest = max(max(depths(s["draft_tree"]["parents"]), default=0) for s in steps if "draft_tree" in s)
    assert len(rates) == deepest >= len(EXPANSION.split(",")) and rates[0] > 0

    # the legend keeps each drafter's own tally: its nodes and how many of them the LLM accepted
    tallies = page.locator("#legend [data-drafter]").evaluate_all(
        "items => items.map(i => [+i.dataset.accepted, +i.dataset.drafted, i.textContent])")
    assert any(0 < a <= d for a, d, _ in tallies), tallies
    assert all(a <= d and (f"{a} of {d} accepted" in text or not d) for a, d, text in tallies), tallies

    page.screenshot(path=tmp_path / "viewer.png", full_page=True)
    shutil.copy(tmp_path / "viewer.png", "/tmp/viewer.png")


def test_viewer_offers_chat_where_the_model_has_a_chat_template_and_streams_the_answer(gateway, chat_gateway, page):
    page.goto(gateway + "/")
    page.wait_for_function("document.getElementById('server').textContent.includes('speculators')")
    assert page.is_disabled("#chat") and not page.is_checked("#chat")  # the fixture LLM has no chat template
    page.goto(chat_gateway + "/")
    page.wait_for_function("document.getElementById('server').textContent.includes('speculators')")
    assert page.is_enabled("#chat") and page.is_checked("#chat")  # chat by default where there is a template
    message = "Write a function that adds two numbers."
    run_in_viewer(page, message, 24)
    steps, usage = stream_completion(chat_gateway, {
        "model": json.loads(urllib.request.urlopen(chat_gateway + "/v1/models").read())["data"][0]["id"],
        "messages": [{"role": "user", "content": message}], "max_tokens": 24, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "speculation": EXPANSION}, "/v1/chat/completions")
    assert page.text_content("#completion") == "".join(s["delta"].get("content", "") for s in steps) != ""
    assert int(page.get_attribute("#fig-tokens", "data-value")) == usage["completion_tokens"]
