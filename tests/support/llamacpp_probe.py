"""What llama.cpp makes of a GGUF file, in the Python that has llama.cpp's bindings (llama-cpp-python, .venv-llamacpp):
run as `PYTHON tests/support/llamacpp_probe.py FILE < request.json`, it prints one JSON object. It imports nothing
from Kiln (that environment has no torch): tests/fixtures/llamacpp.py compares its answers with transformers'.

request: {"prompt": [ids], "new_tokens": N, "stop": [ids], "texts": [str], "chat": [messages], "chat_tokens": N}
answer:  {"logits": prompt logits [n][vocab], "greedy": ids (llama.cpp's greedy sampler, to N tokens or a stop id),
          "tokens": [ids of each text, as llama.cpp tokenizes it with bos], "chat_prompt": ids of the chat rendered
          with the file's tokenizer.chat_template and tokenized as create_chat_completion does,
          "chat_answer": create_chat_completion's greedy answer text, "metadata": the file's string metadata}
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    request = json.load(sys.stdin)
    llm = Llama(model_path=path, n_ctx=256, n_batch=256, logits_all=True, n_threads=2, seed=0, verbose=False)
    prompt = request["prompt"]
    llm.reset()
    llm.eval(prompt)
    logits = llm.scores[: len(prompt)].tolist()
    greedy = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        greedy.append(int(token))
        if len(greedy) == request["new_tokens"] or token in request["stop"]:
            break
    tokens = [llm.tokenize(text.encode(), add_bos=True, special=False) for text in request["texts"]]
    chat_prompt, chat_answer = None, None
    if request["chat"]:  # the file's tokenizer.chat_template, as create_chat_completion renders and tokenizes it
        template = llm.metadata["tokenizer.chat_template"]
        bos, eos = (llm._model.token_get_text(i) for i in (llm.token_bos(), llm.token_eos()))
        rendered = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)(messages=request["chat"])
        chat_prompt = llm.tokenize(rendered.prompt.encode(), add_bos=False, special=True)
        answer = llm.create_chat_completion(
            messages=request["chat"], temperature=0.0, max_tokens=request["chat_tokens"]
        )
        chat_answer = answer["choices"][0]["message"]["content"]
    print(
        json.dumps(
            {
                "logits": logits,
                "greedy": greedy,
                "tokens": tokens,
                "chat_prompt": chat_prompt,
                "chat_answer": chat_answer,
                "metadata": {k: v for k, v in llm.metadata.items() if k != "tokenizer.chat_template"},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
