"""`medusa-heads serve`: the real server in a subprocess (the embedded model, fp32, the medusa drafter), queried with
the official `openai` client and raw HTTP. Greedy answers over the server equal `generate` in this process, also with
parallel clients decoded in one batch; metrics move by exactly one request's statistics; bad input gets OpenAI-style
errors and the next request is served. At default settings, the server answers as `medusa-heads generate` does."""

import json
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from medusa_heads.inference import generate, make_drafter

from test_cli import assert_clean_error  # noqa: E402  (pytest puts tests/ on sys.path)

MAX_QUEUE = 5
MAX_TOKENS = 24
BATCH = 4  # parallel requests: decoded together, drafting what configs/batching.json gives (fp32: nothing)
# The server and the in-process references decode with one thread each: the same numerics on both sides, and no
# oversubscription of a small machine (two processes with two threads each on two cores are many times slower).
THREADS = 1
BIN = Path(sys.executable).parent / "medusa-heads"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(log: Path, *flags: str):
    """The base URL of `medusa-heads serve` started with `flags` (and a free port, one thread), logging to `log`."""
    port = free_port()
    with log.open("w") as err:
        proc = subprocess.Popen([str(BIN), "serve", "--port", str(port), "--threads", str(THREADS), *flags],
                                stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The base URL of a server started for this module: the default model and heads, fp32, the medusa drafter on
    its default tree."""
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with running_server(log, "--max-queue", str(MAX_QUEUE), "--dtype", "float32", "--drafter", "medusa") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(model, tokenizer):
    """In-process greedy decoding with the server's drafter and tree: (prompt, max tokens, raw) -> Generation."""
    cache = {}

    def run(prompt: str, max_tokens: int = MAX_TOKENS, raw: bool = False):
        key = (prompt, max_tokens, raw)
        if key not in cache:
            threads = torch.get_num_threads()
            torch.set_num_threads(THREADS)
            try:
                cache[key] = generate(model, tokenizer, prompt, make_drafter(model, "medusa"),
                                      max_new_tokens=max_tokens, raw=raw)
            finally:
                torch.set_num_threads(threads)
        return cache[key]

    return run


def chat(client, prompt: str, **options):
    return client.chat.completions.create(model="smollm2-135m-embedded", messages=[{"role": "user", "content": prompt}],
                                          **({"max_tokens": MAX_TOKENS, "temperature": 0} | options))


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.slow
def test_health_and_models(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list()] == ["smollm2-135m-embedded"]


@pytest.mark.slow
def test_chat_greedy_equals_generate(client, reference, chat_prompts):
    ref = reference(chat_prompts[0])
    response = chat(client, chat_prompts[0])
    assert response.choices[0].message.content == ref.text
    assert response.usage.completion_tokens == len(ref.token_ids) == MAX_TOKENS
    assert response.usage.prompt_tokens == ref.stats.prompt_tokens
    assert response.choices[0].finish_reason == "length"
    spec = response.model_extra["speculative"]
    assert spec["steps"] == ref.stats.steps
    assert spec["mean_accepted_length"] == pytest.approx(ref.stats.mean_accepted_length, abs=1e-3)


@pytest.mark.slow
def test_completion_greedy_equals_generate(client, reference):
    prompt = "The three primary colors are"
    ref = reference(prompt, 16, raw=True)
    response = client.completions.create(model="smollm2-135m-embedded", prompt=prompt, max_tokens=16, temperature=0)
    assert response.choices[0].text == ref.text
    assert response.usage.completion_tokens == len(ref.token_ids)


@pytest.mark.slow
def test_streaming_sends_each_block(client, reference, chat_prompts):
    ref = reference(chat_prompts[1])
    chunks = list(chat(client, chat_prompts[1], stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == ref.text
    assert 1 < len(pieces) <= ref.stats.steps + 1  # at most one chunk per forward
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["speculative"]["steps"] == ref.stats.steps
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_answer_before_it(client, reference, chat_prompts, stream):
    ref = reference(chat_prompts[2])
    words = ref.text.split()
    stop = words[len(words) // 2]
    expected = ref.text[: ref.text.index(stop)]
    if stream:
        chunks = list(chat(client, chat_prompts[2], stop=[stop, "unlikely stop string"], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        response = chat(client, chat_prompts[2], stop=stop)
        text, finish = response.choices[0].message.content, response.choices[0].finish_reason
    assert text == expected and finish == "stop"


def batches(url: str) -> tuple[float, float, float]:
    """The batch-size histogram: (batches, requests in them, batches of more than 4)."""
    m = metrics(url)
    count = m[("medusa_batch_size_count", ())]
    return count, m[("medusa_batch_size_sum", ())], count - m[("medusa_batch_size_bucket", (("le", "4.0"),))]


def while_busy(client, prompt: str, requests: list, **options) -> tuple[str, list]:
    """Sends `requests` (functions of no argument) together while the stream of `prompt` decodes alone, so that
    they queue and the worker takes them as one batch. Returns the stream's text and their results."""
    pieces = (c.choices[0].delta.content for c in chat(client, prompt, stream=True, **options)
              if c.choices and c.choices[0].delta.content)
    first = next(pieces)  # it is decoding
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda request: request(), requests))
    return first + "".join(pieces), results


def answer(client, prompt: str, **options):
    return lambda: chat(client, prompt, **options).choices[0].message.content


@pytest.mark.slow
def test_parallel_clients_are_batched_and_get_their_own_answers(server, client, reference, chat_prompts):
    prompts = chat_prompts[3 : 3 + BATCH]
    refs = [reference(p, 16).text for p in prompts]
    before = batches(server)
    first, answers = while_busy(client, chat_prompts[0], [answer(client, p, max_tokens=16) for p in prompts])
    assert answers == refs and first == reference(chat_prompts[0]).text
    count, rows, _ = (a - b for a, b in zip(batches(server), before))
    assert rows > count  # a batch of more than one
    assert metrics(server)[("medusa_running_batch_size", ())] == 0


@pytest.mark.slow
def test_a_cancelled_stream_leaves_its_batch_and_the_others_go_on(server, client, reference, chat_prompts):
    prompts = chat_prompts[3 : 3 + BATCH - 1]
    refs = [reference(p, 16).text for p in prompts]
    before, before_batches = metrics(server), batches(server)
    long = {"messages": [{"role": "user", "content": chat_prompts[8]}], "max_tokens": 300, "temperature": 0,
            "stream": True}

    def hang_up() -> None:  # after its first block of text, while the others decode
        with httpx.stream("POST", f"{server}/v1/chat/completions", json=long, timeout=60) as stream:
            next(line for line in stream.iter_lines() if '"content": "' in line and '"content": ""' not in line)

    _, answers = while_busy(client, chat_prompts[0], [hang_up] + [answer(client, p, max_tokens=16) for p in prompts])
    assert answers[1:] == refs
    key = ("medusa_requests_total", (("status", "cancelled"),))
    deadline = time.monotonic() + 10
    while metrics(server)[key] == before[key]:
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.1)
    after = metrics(server)
    assert after[("medusa_generation_tokens_total", ())] - before[("medusa_generation_tokens_total", ())] < 200
    count, rows, _ = (a - b for a, b in zip(batches(server), before_batches))
    assert rows == 1 + BATCH and rows > count


@pytest.mark.slow
def test_a_seed_gives_the_same_answer_alone_and_in_a_batch(server, client, reference, chat_prompts):
    """Alone, then in a batch of five, whose unseeded requests draft less or nothing (which tokens a seed draws
    depends on the drafts, so a seeded request keeps the server's drafter)."""
    seeded = {"temperature": 0.9, "seed": 7}
    prompts = chat_prompts[3 : 3 + BATCH]
    refs = [reference(p, 16).text for p in prompts]
    before = batches(server)
    alone, answers = while_busy(client, "Tell me a joke.", [answer(client, "Tell me a joke.", **seeded)]
                                + [answer(client, p, max_tokens=16) for p in prompts], **seeded)
    assert alone and answers == [alone] + refs
    assert batches(server)[2] - before[2] == 1  # the batch of five


@pytest.mark.slow
def test_metrics_move_by_one_request(server, client, model, chat_prompts):
    tree_nodes = make_drafter(model, "medusa").tree.size
    before = metrics(server)
    response = chat(client, chat_prompts[0])
    after = metrics(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    spec = response.model_extra["speculative"]
    steps, accepted = spec["steps"], spec["accepted_tokens"]
    assert steps > 0 and spec["draft_tokens"] == steps * (tree_nodes - 1)
    assert spec["mean_accepted_length"] == pytest.approx((accepted + steps) / steps, abs=1e-3)
    assert delta("medusa_speculative_verification_steps_total") == steps
    assert delta("medusa_speculative_draft_tokens_total") == steps * (tree_nodes - 1)
    assert delta("medusa_speculative_accepted_tokens_total") == accepted
    assert delta("medusa_speculative_accepted_length_count") == steps
    assert delta("medusa_speculative_accepted_length_sum") == accepted + steps
    assert delta("medusa_speculative_depth_drafted_total", depth="1") == steps
    assert sum(delta("medusa_speculative_depth_accepted_total", depth=str(d)) for d in range(1, 10)) == accepted
    for phase in ("draft", "verification"):  # where its steps' time went, in its response and in the metrics
        assert spec[f"{phase}_seconds"] > 0
        assert delta(f"medusa_speculative_{phase}_seconds_total") == pytest.approx(spec[f"{phase}_seconds"], abs=1e-5)
    assert delta("medusa_generation_tokens_total") == response.usage.completion_tokens
    assert delta("medusa_prompt_tokens_total") == response.usage.prompt_tokens
    assert delta("medusa_requests_total", status="ok") == 1
    for histogram in ("request_latency_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds",
                      "batch_size"):
        assert delta(f"medusa_{histogram}_count") == 1
    assert delta("medusa_batch_size_sum") == 1
    assert after[("medusa_queue_depth", ())] == 0 and after[("medusa_running_batch_size", ())] == 0
    families = text_string_to_metric_families(httpx.get(f"{server}/metrics").text)
    assert {f.name for f in families if "speculative" in f.name} == {
        "medusa_speculative_draft_tokens", "medusa_speculative_accepted_tokens",
        "medusa_speculative_verification_steps", "medusa_speculative_accepted_length",
        "medusa_speculative_depth_drafted", "medusa_speculative_depth_accepted", "medusa_speculative_draft_seconds",
        "medusa_speculative_verification_seconds"}


GOOD = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
BAD = [
    ("not json", "{\"messages\": [", "invalid_json"),
    ("wrong type", GOOD | {"max_tokens": "4"}, "invalid_value"),
    ("wrong type in a message", GOOD | {"messages": [{"role": "user", "content": 3}]}, "invalid_value"),
    ("unknown model", GOOD | {"model": "gpt-4"}, "model_not_found"),
    ("empty messages", GOOD | {"messages": []}, "invalid_value"),
    ("negative max_tokens", GOOD | {"max_tokens": -1}, "invalid_value"),
    ("n other than 1", GOOD | {"n": 2}, "invalid_value"),
    ("beyond the context", GOOD | {"max_tokens": 100_000}, "context_length_exceeded"),
    ("top_p out of range", GOOD | {"top_p": 1.5}, "invalid_value"),
]


@pytest.mark.slow
def test_bad_requests_get_openai_errors_and_cost_nothing(server):
    before = metrics(server)
    for what, body, code in BAD:
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(f"{server}/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, what
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, (what, error)
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    after = metrics(server)
    key = ("medusa_speculative_verification_steps_total", ())
    assert after[key] == before[key]  # refused before any compute
    invalid = ("medusa_requests_total", (("status", "invalid"),))
    assert after[invalid] - before[invalid] == len(BAD) + 1
    r = httpx.post(f"{server}/v1/chat/completions", json=GOOD, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_full_queue_is_503_and_disconnects_free_their_slots(server):
    """One stream decoding, MAX_QUEUE waiting: the next request gets 503. The clients then hang up mid-stream,
    and the server cancels their requests and serves the next one."""
    before = metrics(server)
    long = {"messages": [{"role": "user", "content": "Write a very long story about a dragon who learns to fly."}],
            "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http, ExitStack() as streams:
        for i in range(MAX_QUEUE + 1):
            stream = streams.enter_context(http.stream("POST", f"{server}/v1/chat/completions", json=long))
            assert stream.status_code == 200
            if i == 0:  # wait until it is decoding: its first block of text arrives (after the role chunk)
                lines = stream.iter_lines()  # kept: an iterator dropped half-read closes the connection
                next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
        full = httpx.post(f"{server}/v1/chat/completions", json=GOOD)
        assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"

    def delta(status):
        key = ("medusa_requests_total", (("status", status),))
        return metrics(server)[key] - before[key]

    deadline = time.monotonic() + 10  # the server notices the hang-ups, the decoding one after its next step
    while delta("cancelled") < MAX_QUEUE + 1:
        assert time.monotonic() < deadline, "the abandoned requests were not cancelled"
        time.sleep(0.1)
    assert metrics(server)[("medusa_queue_depth", ())] == 0
    r = httpx.post(f"{server}/v1/chat/completions", json=GOOD, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert (delta("cancelled"), delta("rejected"), delta("ok")) == (MAX_QUEUE + 1, 1, 1)


@pytest.mark.slow
def test_a_client_that_gives_up_cancels_its_request(server):
    before = metrics(server)
    long = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=long, timeout=1)
    key = ("medusa_requests_total", (("status", "cancelled"),))
    deadline = time.monotonic() + 10  # noticed within a poll of the connection and a decoding step
    while metrics(server)[key] == before[key]:
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.1)
    generated = metrics(server)[("medusa_generation_tokens_total", ())] - before[("medusa_generation_tokens_total", ())]
    assert generated < 300


@pytest.mark.slow
def test_speculative_says_the_temperature_and_acceptance_used(server):
    """A request without `temperature` samples at OpenAI's default, 1.0: its response says so."""
    url = f"{server}/v1/chat/completions"
    greedy = httpx.post(url, json=GOOD, timeout=60).json()["speculative"]
    unset = httpx.post(url, json={k: v for k, v in GOOD.items() if k != "temperature"}, timeout=60).json()["speculative"]
    assert (greedy["temperature"], greedy["acceptance"]) == (0, "greedy")
    assert (unset["temperature"], unset["acceptance"]) == (1.0, "exact")


# The budget, and a prompt whose bf16 answer in it differs with the drafter (medusa+ngram on hydra-cpu-6 against
# medusa on cpu-8) and from the fp32 one.
ANSWER_TOKENS, PROMPT = 48, 3


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_at_default_settings_the_server_answers_as_generate(tmp_path, chat_prompts, dtype):
    """`auto` is bf16 on a CPU that computes in it natively; there a tree forward rounds differently from a
    one-token forward, so the answers agree only when the server decodes alone with generate's drafter, tree, dtype
    and chat template."""
    flags = [] if dtype == "auto" else ["--dtype", dtype]
    generated = subprocess.run([str(BIN), "generate", "--prompt", chat_prompts[PROMPT], "--max-new-tokens",
                                str(ANSWER_TOKENS), "--json", "--threads", str(THREADS), *flags],
                               capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr[-2000:]
    expected = json.loads(generated.stdout)
    request = {"messages": [{"role": "user", "content": chat_prompts[PROMPT]}], "max_tokens": ANSWER_TOKENS,
               "temperature": 0}
    with running_server(tmp_path / "stderr.log", *flags) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=request, timeout=120).json()
    spec = response["speculative"]
    assert response["choices"][0]["message"]["content"] == expected["text"]
    assert response["usage"]["prompt_tokens"] == expected["prompt_tokens"]
    assert (spec["drafter"], spec["steps"]) == (expected["drafter"], expected["steps"])


def test_bad_cli_options_are_one_line(cli):
    assert_clean_error(cli("serve", "--port", "99999"), "--port", "0..65535")
    assert_clean_error(cli("serve", "--port", "-1"), "--port")
    assert_clean_error(cli("serve", "--port", "0", "--max-queue", "0"), "--max-queue")
    assert_clean_error(cli("serve", "--port", "0", "--tree", "no-such-tree"), "Unknown tree")
    assert_clean_error(cli("serve", "--port", "0", "--heads", "/no/such/heads"), "does not exist")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert_clean_error(cli("serve", "--port", str(taken.getsockname()[1])), "Cannot listen")
