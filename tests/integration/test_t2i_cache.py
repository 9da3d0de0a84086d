"""The text-to-image cache (python -m data.cache_latents recipe=t2i_tiny ...; data.latents=DIR): its prompt
embeddings are the pipeline's text encoders' output (recomputed here with them), a run on it trains the losses of
the run that encodes on the fly (the shared 12-step t2i_tiny run), and a cache made with other settings stops the
run with one line."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from common.data.webdataset import iter_samples
from common.errors import DataError
from data import cache_latents
from scripts.kiln.launch import compose
from tests.conftest import losses, run_train
from tests.fixtures.t2i import t2i_run_args

pytestmark = pytest.mark.integration
STEPS = 3


@pytest.fixture(scope="module")
def cache(t2i_world, tmp_path_factory):
    from tests.fixtures.shared import once, shared_root

    args = [a for a in t2i_run_args(t2i_world) if a.split("=")[0] in ("recipe", "model.init_from", "data.root")]

    def build(out):
        assert cache_latents.main([*args, "data.build=[]", "--out", str(out), "--batch-size", "16"]) == 0
        return out

    return once(shared_root(tmp_path_factory), "t2i_cache", build)


def test_cached_embeddings_are_the_text_encoders_output(t2i_world, cache):
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    from common.diffusion.prompts import EMPTY_PROMPT

    cfg = compose(t2i_run_args(t2i_world))
    folder, length = t2i_world["pipeline"], cfg.model.max_sequence_length
    samples = [s for _, s in zip(range(6), iter_samples([str(p) for p in sorted(cache.glob("train-*.tar"))]))]
    captions = [s["txt"].decode() for s in samples]

    # Independent reference: SD3's encode_prompt by hand from transformers' classes (penultimate CLIP states,
    # projected pooled outputs, T5 states; CLIP zero-padded to T5's width, then joined on the sequence).
    def encode(prompts):
        states, pooled = [], []
        for s in ("", "_2"):
            tok = AutoTokenizer.from_pretrained(folder / f"tokenizer{s}")
            ids = tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
            out = CLIPTextModelWithProjection.from_pretrained(folder / f"text_encoder{s}")(
                torch.tensor(ids), output_hidden_states=True
            )
            states.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        tok = AutoTokenizer.from_pretrained(folder / "tokenizer_3")
        ids = tok(prompts, padding="max_length", max_length=length, truncation=True).input_ids
        t5 = T5EncoderModel.from_pretrained(folder / "text_encoder_3")(torch.tensor(ids))[0]
        clip = torch.cat(states, -1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], -2).detach().numpy(), torch.cat(pooled, -1).detach().numpy()

    with torch.no_grad():
        context, pooled = encode(captions)
        empty_context, empty_pooled = encode([""])
    for i, s in enumerate(samples):
        np.testing.assert_allclose(np.load(io.BytesIO(s["context.npy"])), context[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.load(io.BytesIO(s["pooled.npy"])), pooled[i], rtol=1e-5, atol=1e-6)
    with np.load(cache / EMPTY_PROMPT) as empty:
        np.testing.assert_allclose(empty["encoder_hidden_states"], empty_context[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(empty["pooled_projections"], empty_pooled[0], rtol=1e-5, atol=1e-6)


def test_a_run_on_the_cache_trains_the_on_the_fly_losses(t2i_world, cache, trained, tmp_path):
    fly_dir = trained(t2i_run_args(t2i_world))
    run = tmp_path / "cached"
    args = [a for a in t2i_run_args(t2i_world) if not a.startswith("trainer.max_steps=")]
    # trainer.eval=false: the eval (after training; no effect on the losses) loads the text encoders for its held-out
    # prompts, and keeps the VAE's encoder; without it the run never loads them.
    args += [f"trainer.max_steps={STEPS}", f"data.latents={cache}", f"run.dir={run}", "trainer.eval=false"]
    proc = run_train(args)
    # transformers' loading bar, shown for each text encoder by a run that encodes on the fly: none loaded here.
    assert "Loading weights" not in proc.stdout + proc.stderr
    fly, cached = losses(fly_dir), losses(run)
    assert len(cached) == STEPS
    for step in range(1, STEPS + 1):
        assert cached[step] == pytest.approx(fly[step], rel=1e-5), (step, fly, cached)


def test_a_cache_made_with_other_settings_stops_the_run_with_one_line(t2i_world, cache, tmp_path, capsys):
    from recipes.t2i.data import load_cache_meta
    from recipes.t2i.weights import encoders_identity

    cfg = compose([*t2i_run_args(t2i_world), f"data.latents={cache}", "model.max_sequence_length=16"])
    identity = encoders_identity(t2i_world["pipeline"])
    with pytest.raises(DataError) as err:
        load_cache_meta(cfg, identity)
    assert "model.max_sequence_length=16 (the cache's: 32)" in str(err.value) and "\n" not in str(err.value)
    other = json.loads(json.dumps(identity))
    other["text_encoder_3"]["weights"] = "sampled-v1:0"  # another T5's weights
    cfg = compose([*t2i_run_args(t2i_world), f"data.latents={cache}"])
    with pytest.raises(DataError, match="model.init_from's text_encoder_3; rebuild it"):
        load_cache_meta(cfg, other)
    # Through the user's command: one `kiln: error:` line, exit 2.
    proc = run_train(
        [*t2i_run_args(t2i_world), f"data.latents={cache}", "model.max_sequence_length=16", f"run.dir={tmp_path}/r"],
        check=False,
    )
    err_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert not (tmp_path / "r").exists()
    assert proc.returncode == 2 and len(err_lines) == 1 and err_lines[0].startswith("kiln: error: data.latents="), (
        proc.stderr
    )
