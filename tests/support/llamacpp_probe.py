"""What llama.cpp makes of a GGUF file, in the Python that has llama.cpp (xllamacpp, .venv-llamacpp: `make
llamacpp-env`): run as `PYTHON tests/support/llamacpp_probe.py FILE < request.json`, it prints one JSON object. It
imports nothing from Kiln (that environment has no torch): tests/fixtures/llamacpp.py compares its answers with
transformers'.

Every answer is llama.cpp's own server's (xllamacpp runs llama.cpp's server in process, on a loopback port), through
its native endpoints: /completion, /tokenize, /apply-template. That server gives no raw logits: it gives
log-probabilities (`n_probs`, from the raw logits before any sampler: post_sampling_probs=false), so the prompt's
distribution is read one position at a time, over the whole vocabulary.

request: {"prompt": [ids], "new_tokens": N, "stop": [ids], "texts": [str], "chat": [messages], "chat_tokens": N}
answer:  {"logprobs": the log-softmax of the logits at each prompt position [n][vocab],
          "greedy": ids (temperature 0, to N tokens or a stop id, the stop id included),
          "tokens": [ids of each text, as the server tokenizes a prompt: with bos, special tokens parsed],
          "chat_prompt": ids of the chat rendered with the file's tokenizer.chat_template (/apply-template) and
          tokenized as a chat completion's prompt, "chat_answer": the greedy ids after it (to chat_tokens or a stop id),
          "metadata": {"ftype": the file's type as llama.cpp reads it, "n_vocab"}}
"""

from __future__ import annotations

import json
import sys
import urllib.request


def main(path: str) -> None:
    import xllamacpp

    request = json.load(sys.stdin)
    params = xllamacpp.CommonParams()
    params.model.path = path
    params.n_ctx, params.n_batch, params.n_parallel = 256, 256, 1
    # One thread: on a shared 2-core machine two of llama.cpp's threads spin-wait on each other (measured 430 ms a
    # token against 0.2 ms with one, on the tiny models)
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 1
    params.warmup = False
    server = xllamacpp.Server(params)  # listens on a free loopback port until it is deleted
    base = server.listening_address

    def ask(endpoint: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(base + endpoint, data=data, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as response:
            return json.loads(response.read())

    meta = ask("/v1/models")["data"][0]["meta"]
    n_vocab = meta["n_vocab"]

    def complete(ids: list[int], n: int, extra: dict | None = None) -> dict:  # temperature 0: the greedy sampler
        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "return_tokens": True, "cache_prompt": True}
        return ask("/completion", body | (extra or {}))

    def greedy(ids: list[int], n: int) -> list[int]:
        out = []
        for token in complete(ids, n)["tokens"]:
            out.append(int(token))
            if token in request["stop"]:
                break
        return out

    # The server sends a token's probabilities with its text, and holds back a token that ends inside a UTF-8
    # character (a byte token): none come then. So the one token drawn is a whole character's ("a", by a logit bias in
    # the sampler); the probabilities are the raw logits' (post_sampling_probs=false), which the bias does not touch
    # (checked: identical with and without it, where both come).
    whole = ask("/tokenize", {"content": "a", "add_special": False})["tokens"][0]
    extra = {"n_probs": n_vocab, "post_sampling_probs": False, "logit_bias": [[whole, 1e4]]}

    def logprobs(ids: list[int]) -> list[float]:  # the next token's distribution after ids, over the whole vocabulary
        row = [0.0] * n_vocab
        for entry in complete(ids, 1, extra)["completion_probabilities"][0]["top_logprobs"]:
            row[entry["id"]] = entry["logprob"]
        return row

    def tokenize(text: str) -> list[int]:  # as the server tokenizes a prompt: bos added, special tokens parsed
        return ask("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]

    prompt = request["prompt"]
    chat_prompt, chat_answer = None, None
    if request["chat"]:  # the file's tokenizer.chat_template, rendered by the server's own Jinja engine
        rendered = ask("/apply-template", {"messages": request["chat"]})["prompt"]
        chat_prompt = tokenize(rendered)
        chat_answer = greedy(chat_prompt, request["chat_tokens"])
    answer = {
        "logprobs": [logprobs(prompt[: i + 1]) for i in range(len(prompt))],
        "greedy": greedy(prompt, request["new_tokens"]),
        "tokens": [tokenize(text) for text in request["texts"]],
        "chat_prompt": chat_prompt,
        "chat_answer": chat_answer,
        "metadata": {"ftype": ask("/props")["model_ftype"], "n_vocab": n_vocab},
    }
    del server
    print(json.dumps(answer))


if __name__ == "__main__":
    main(sys.argv[1])
