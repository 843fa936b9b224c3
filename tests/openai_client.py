"""The official `openai` Python client against kvrelay-server: completions, chat completions and
responses, each with `extra_body={"kv_hints": ...}`, streaming and not.

Usage: python3 tests/openai_client.py PATH/TO/kvrelay-server [SERVE FLAGS...]
(e.g. `--engine llama --model-file F.gguf` for the real model;
the test command installs the client into target/ci-tools/openai when it is missing).
"""

import json
import os
import subprocess
import sys

import openai

HINT = {
    "protocol_version": "0.1",
    "message_id": "openai-client-check",
    "actions": [
        {
            "action_id": "a1",
            "action_type": "kv.fetch",
            "action_version": "1.0",
            "payload": {"source_control_endpoint": "tcp://127.0.0.1:23280", "block_hashes": [1, 2, 3]},
        }
    ],
}


def metric(client_base, name):
    import urllib.request

    text = urllib.request.urlopen(client_base + "/metrics", timeout=30).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def main():
    server = sys.argv[1]
    env = dict(os.environ, KVRELAY_TRUST_KV_HINTS="1", KVRELAY_PREFILL_TOKENS_PER_S="0", KVRELAY_LOG="warn")
    flags = sys.argv[2:]
    proc = subprocess.Popen(
        [server, "serve", "--listen", "127.0.0.1:0", *flags], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on "), line
        base = "http://" + line.removeprefix("listening on ")
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60, max_retries=0)
        model = client.models.list().data[0].id
        prompt = "The official client sends kv_hints through extra_body. " * 8
        extra = {"kv_hints": HINT}

        first = client.completions.create(model=model, prompt=prompt, max_tokens=8, extra_body=extra)
        again = client.completions.create(model=model, prompt=prompt, max_tokens=8, extra_body=extra)
        assert first.usage.prompt_tokens_details.cached_tokens == 0, first.usage
        assert again.usage.prompt_tokens_details.cached_tokens > 0, again.usage
        assert first.choices[0].text == again.choices[0].text
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=8, stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in stream if c.choices) == first.choices[0].text

        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, extra_body=extra)
        assert chat.usage.prompt_tokens_details.cached_tokens is not None
        chunks = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )
        text, usage = "", None
        for c in chunks:
            if c.choices and c.choices[0].delta.content:
                text += c.choices[0].delta.content
            if c.usage:
                usage = c.usage
        assert text == chat.choices[0].message.content, (text, chat.choices[0].message.content)
        assert usage.prompt_tokens_details.cached_tokens > 0, usage

        # log-probabilities as the client's types read them (no hint: the hint count stays 7)
        lp = client.chat.completions.create(model=model, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2)
        content = lp.choices[0].logprobs.content
        said = lp.choices[0].message.content
        # (a character split across tokens is whole in the text, not in one token's entry)
        assert content and (not said.isascii() or "".join(t.token for t in content) == said), content
        assert all(t.logprob <= 0.0 and t.top_logprobs and t.top_logprobs[0].logprob == t.logprob for t in content), content
        legacy = client.completions.create(model=model, prompt=prompt, max_tokens=4, logprobs=2)
        assert len(legacy.choices[0].logprobs.token_logprobs) == len(legacy.choices[0].logprobs.tokens) > 0, legacy

        resp = client.responses.create(model=model, input=prompt, max_output_tokens=8, extra_body=extra)
        assert resp.output_text, resp
        deltas, done = "", None
        for ev in client.responses.create(model=model, input=prompt, max_output_tokens=8, stream=True, extra_body=extra):
            if ev.type == "response.output_text.delta":
                deltas += ev.delta
            if ev.type == "response.completed":
                done = ev.response
        assert deltas == resp.output_text and done is not None and done.output_text == resp.output_text

        admitted = metric(base, "kvrelay_kv_hints_admitted_total")
        assert admitted == 7, f"every call's hint was admitted once: {admitted}"
        print(json.dumps({"openai": openai.__version__, "model": model, "calls": 7, "hints_admitted": admitted, "ok": True}))
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
