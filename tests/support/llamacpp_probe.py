"""What llama.cpp makes of a GGUF file, in the Python that has llama.cpp's bindings (llama-cpp-python, .venv-llamacpp):
run as `PYTHON tests/support/llamacpp_probe.py FILE < request.json`, it prints one JSON object. It imports nothing
from Kiln (that environment has no torch): tests/fixtures/llamacpp.py compares its answers with transformers'.

request: {"prompt": [ids], "new_tokens": N, "stop": [ids], "texts": [str], "chat": [messages], "chat_tokens": N}
answer:  {"logits": prompt logits [n][vocab], "greedy": ids (llama.cpp's greedy sampler, to N tokens or a stop id),
          "tokens": [ids of each text, as llama.cpp tokenizes a prompt: with bos, special tokens parsed],
          "chat_prompt": ids of the chat rendered with the file's tokenizer.chat_template and tokenized as
          create_chat_completion does, "chat_answer": the greedy ids after it (to chat_tokens or a stop id),
          "metadata": the file's string metadata}
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # what create_chat_completion renders a template with

    request = json.load(sys.stdin)
    llm = Llama(model_path=path, n_ctx=256, n_batch=256, logits_all=True, n_threads=2, seed=0, verbose=False)
    prompt = request["prompt"]
    llm.reset()
    llm.eval(prompt)
    logits = llm.scores[: len(prompt)].tolist()

    def greedy(ids: list[int], n: int) -> list[int]:  # llama.cpp's greedy sampler (temperature 0), to n or a stop id
        out = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if len(out) == n or token in request["stop"]:
                break
        return out

    # special=True: special tokens' text is parsed as those tokens, as create_completion does (and transformers)
    tokens = [llm.tokenize(text.encode(), add_bos=True, special=True) for text in request["texts"]]
    chat_prompt, chat_answer = None, None
    if request["chat"]:  # the file's tokenizer.chat_template, as create_chat_completion renders and tokenizes it
        template = llm.metadata["tokenizer.chat_template"]
        bos, eos = (llm._model.token_get_text(i) for i in (llm.token_bos(), llm.token_eos()))
        rendered = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)(messages=request["chat"])
        chat_prompt = llm.tokenize(rendered.prompt.encode(), add_bos=False, special=True)
        chat_answer = greedy(chat_prompt, request["chat_tokens"])
    print(
        json.dumps(
            {
                "logits": logits,
                "greedy": greedy(prompt, request["new_tokens"]),
                "tokens": tokens,
                "chat_prompt": chat_prompt,
                "chat_answer": chat_answer,
                "metadata": {k: v for k, v in llm.metadata.items() if k != "tokenizer.chat_template"},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
