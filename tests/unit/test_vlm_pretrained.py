"""A LLaVA from pretrained parts: the same model transformers assembles by hand from the same folders, the
folders' weights untouched, `<image>` rows the mean; processor/tower disagreements and unusable folders are
one line; conversations are labelled on the assistant turns exactly (checked against pieces tokenized apart)."""

from __future__ import annotations

import os

import pytest
import torch
from PIL import Image
from transformers import (
    CLIPVisionModel,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    SiglipVisionModel,
)

from common.data.packing import IGNORE_INDEX
from common.errors import ConfigError
from recipes.vlm import llava
from recipes.vlm.config import VLMModelConfig
from recipes.vlm.data import blank_sample, chat_prompt, check_chat_template, collate, encode_conversation
from recipes.vlm.weights import LlavaWeights, PartWeights, llava_folder
from tests.fixtures import vlm as fx

CONVERSATION = [
    {"role": "user", "content": "<image>\nWhat digit is this?"},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Is it odd or even?"},
    {"role": "assistant", "content": "It is odd."},
]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    return {
        "clip": fx.write_clip(root / "clip"),
        "clip_dual": fx.write_clip(root / "clip_dual", dual_encoder=True),
        "siglip": fx.write_siglip(root / "siglip"),
        "vicuna": fx.write_llama(root / "vicuna"),
        "llama3": fx.write_llama(root / "llama3", chat_template=True, tie_word_embeddings=True),
        "llava_hf": fx.write_llava_hf(root / "llava_hf"),
    }


def assemble(parts, vision: str, language: str, attention: str = "sdpa"):
    source = PartWeights(str(parts[vision]), str(parts[language]), VLMModelConfig())
    processor = source.processor()
    torch.manual_seed(0)
    return source.load(attention).eval(), processor


def digit_image(i: int = 0) -> Image.Image:
    pixels, _ = fx._digits()
    return Image.fromarray(pixels[i], mode="L").convert("RGB")


def hand_assembled(vision_dir, language_dir, tower_cls, processor, projector, layer: int, strategy: str):
    """LlavaForConditionalGeneration put together with transformers' own calls: from_pretrained of each
    part, their state dicts loaded into a LLaVA of their configs, resize_token_embeddings, the new rows
    set to the mean of the old (LLaVA's rule), and the projector under test copied in (it is fresh)."""
    tower, lm = tower_cls.from_pretrained(vision_dir), LlamaForCausalLM.from_pretrained(language_dir)
    old = lm.config.vocab_size
    ref = LlavaForConditionalGeneration(
        LlavaConfig(
            vision_config=tower.config,
            text_config=lm.config,
            image_token_index=processor.image_token_id,
            vision_feature_layer=layer,
            vision_feature_select_strategy=strategy,
        )
    )
    ref.model.vision_tower.load_state_dict(tower.state_dict())
    ref.model.language_model.load_state_dict(lm.model.state_dict())
    ref.lm_head.load_state_dict(lm.lm_head.state_dict())
    ref.resize_token_embeddings(len(processor.tokenizer), mean_resizing=False)
    with torch.no_grad():
        for w in {id(w): w for w in (ref.get_input_embeddings().weight, ref.get_output_embeddings().weight)}.values():
            w[old:] = w[:old].mean(0)
    ref.model.multi_modal_projector.load_state_dict(projector.state_dict())
    return ref.eval()


@pytest.mark.parametrize(
    "vision,language,tower_cls,layer,strategy",
    [
        ("clip", "vicuna", CLIPVisionModel, -2, "default"),
        ("clip_dual", "llama3", CLIPVisionModel, -2, "default"),
        ("siglip", "llama3", SiglipVisionModel, -1, "full"),
    ],
)
def test_logits_equal_llava_assembled_by_hand(parts, vision, language, tower_cls, layer, strategy):
    model, processor = assemble(parts, vision, language)
    assert (model.config.vision_feature_layer, model.config.vision_feature_select_strategy) == (layer, strategy)
    ref = hand_assembled(
        parts[vision], parts[language], tower_cls, processor, model.model.multi_modal_projector, layer, strategy
    )
    enc = encode_conversation(CONVERSATION, [digit_image()], processor)
    with torch.no_grad():
        ours = model(input_ids=enc["input_ids"][None], pixel_values=enc["pixel_values"], labels=enc["labels"][None])
        theirs = ref(input_ids=enc["input_ids"][None], pixel_values=enc["pixel_values"], labels=enc["labels"][None])
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=0, atol=1e-5)


def test_parts_are_the_folders_weights_and_image_rows_the_mean(parts):
    model, processor = assemble(parts, "siglip", "llama3")
    lm, tower = LlamaForCausalLM.from_pretrained(parts["llama3"]), SiglipVisionModel.from_pretrained(parts["siglip"])
    old = lm.config.vocab_size
    image_id = processor.image_token_id
    assert image_id == old and len(processor.tokenizer) == old + 1 == model.config.text_config.vocab_size
    ours = model.state_dict()
    for k, w in tower.state_dict().items():
        if not k.startswith("head."):  # SigLIP's pooling head is not part of LLaVA's tower
            assert torch.equal(ours[f"model.vision_tower.{k}"], w), k
    for k, w in lm.state_dict().items():
        ours_k = ours["lm_head.weight" if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)]
        assert torch.equal(ours_k[:old], w), k
    emb = model.get_input_embeddings().weight
    assert torch.equal(emb[image_id], lm.get_input_embeddings().weight.mean(0))
    assert model.lm_head.weight is emb  # Llama-3.2-style tied embeddings stay tied
    assert not any(k.startswith("model.vision_tower.head") for k in ours)


def test_processor_and_tower_must_agree(parts):
    model, processor = assemble(parts, "clip", "vicuna")
    blank = llava.check_image_tokens(processor, model.config, "src")
    assert blank.shape == (1, 3, fx.IMAGE_SIZE, fx.IMAGE_SIZE)
    processor.num_additional_image_tokens = 0  # as if the CLS token were forgotten: 15 tokens for 16 features
    with pytest.raises(
        ConfigError, match=r"src: the processor expands <image> to 15 tokens but the vision tower gives 16"
    ):
        llava.check_image_tokens(processor, model.config, "src")
    processor.num_additional_image_tokens = 1
    processor.image_processor.crop_size = {"height": 64, "width": 64}
    processor.image_processor.size = {"shortest_edge": 64}
    with pytest.raises(ConfigError, match="makes 64x64 images, the vision tower takes 32x32"):
        llava.check_image_tokens(processor, model.config, "src")


def test_unusable_folders_are_one_line(parts, tmp_path):
    def check(source):
        with pytest.raises(ConfigError) as exc:
            source.check()
        assert "\n" not in str(exc.value)
        return str(exc.value)

    m = VLMModelConfig()
    assert "no such folder" in check(PartWeights(str(tmp_path / "nope"), str(parts["vicuna"]), m))
    assert "not a CLIP or SigLIP" in check(PartWeights(str(parts["vicuna"]), str(parts["vicuna"]), m))
    assert "no *ForCausalLM" in check(PartWeights(str(parts["clip"]), str(parts["clip"]), m))
    assert "is not a LLaVA" in check(LlavaWeights(str(parts["vicuna"])))
    assert "no readable config.json" in check(LlavaWeights(str(tmp_path)))


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["vlm.vision_from={clip}"], "vlm.vision_from and vlm.language_from go together"),
        (["vlm.vision_from={clip}", "vlm.language_from={vicuna}", "model.init_from={llava_hf}"], "exclude each other"),
        (["model.init_from={llava_hf}", "vlm.stage=align"], "model.init_from is for vlm.stage=finetune"),
        (["vlm.init_from={llava_hf}"], "Key 'init_from' not in 'VLMConfig'"),  # the old key's release has passed
        (["vlm.train_vision=true", "vlm.stage=align"], "vlm.train_vision=true is for vlm.stage=finetune"),
        (["vlm.train_projector=false", "vlm.stage=align"], "vlm.train_projector=false with vlm.stage=align leaves"),
        # A quoted ~ (and a bare one: common/compose.py parse_overrides): expanded, as the README's commands rely on;
        # the line names the folder that was looked for.
        (
            ["vlm.vision_from='~/no/such/kiln/folder'", "vlm.language_from={vicuna}"],
            f"vlm.vision_from={os.path.expanduser('~')}/no/such/kiln/folder: no such folder",
        ),
    ],
)
def test_source_mistakes_stop_at_composition(parts, overrides, needle):
    from scripts.kiln.launch import compose

    with pytest.raises(ConfigError, match=needle):
        compose(["recipe=vlm_tiny", *(o.format(**parts) for o in overrides)])
    cfg = compose(["recipe=vlm_7b", f"vlm.vision_from={parts['clip']}", f"vlm.language_from={parts['vicuna']}"])
    assert cfg.data.build == [] and cfg.vlm.vision_from == str(parts["clip"])


def test_init_from_sets_the_model_keys_and_refuses_one_that_disagrees(parts, capsys):
    """With model.init_from the model.* keys are the LLaVA's (write_llava_hf: a CLIP tower of fx.TOWER, a Llama of
    width 64 with 2 of 4 heads for keys and values, LLaVA-1.5's feature choice), not vlm_tiny's (SigLIP, width 128);
    one given on the command line that disagrees stops at composition with one line, as in the DiT and the LLM."""
    from scripts.kiln.launch import compose

    folder = str(parts["llava_hf"])
    cfg = compose(["recipe=vlm_tiny", f"model.init_from={folder}", "model.text_hidden_size=64"])  # agrees: accepted
    m = cfg.model
    assert (m.vision, m.vision_hidden_size, m.vision_layers, m.image_size, m.vision_patch_size) == (
        "clip",
        fx.TOWER["hidden_size"],
        fx.TOWER["num_hidden_layers"],
        fx.TOWER["image_size"],
        fx.TOWER["patch_size"],
    )
    assert (m.text_hidden_size, m.text_layers, m.text_heads, m.text_kv_heads, m.text_intermediate_size) == (
        64,
        2,
        4,
        2,
        128,
    )
    assert (m.vision_feature_layer, m.vision_feature_select_strategy, m.max_seq_len) == (-2, "default", 512)
    for key, value, name, want in (
        ("text_hidden_size", 128, "text_config.hidden_size", 64),
        ("vision", "siglip", "vision_config.model_type", "clip"),
        ("vision_feature_layer", -1, "vision_feature_layer", -2),
    ):
        with pytest.raises(ConfigError) as exc:
            compose(["recipe=vlm_tiny", f"model.init_from={folder}", f"model.{key}={value}"])
        assert str(exc.value) == (
            f"model.{key}={value} disagrees with model.init_from={folder}, whose config.json gives "
            f"{name}={want}; leave model.{key} out of the command line"
        )
    assert capsys.readouterr().out == ""


def test_dry_run_sizes_the_parts_not_the_preset(parts):
    from recipes.vlm.sizing import memory_spec
    from scripts.kiln.launch import compose

    model, _ = assemble(parts, "clip", "vicuna")
    for stage, trainable in (("align", model.model.multi_modal_projector), ("finetune", None)):
        cfg = compose(
            [
                "recipe=vlm_7b",
                f"vlm.vision_from={parts['clip']}",
                f"vlm.language_from={parts['vicuna']}",
                f"vlm.stage={stage}",
            ]
        )
        spec = memory_spec(cfg)
        total = spec.frozen_params + spec.first_params + spec.layers * spec.layer_params
        assert total == sum(p.numel() for p in model.parameters())
        if trainable is not None:
            assert total - spec.frozen_params == sum(p.numel() for p in trainable.parameters())


def test_llava_hf_folder_loads_with_its_processor(parts):
    folder = llava_folder(str(parts["llava_hf"]))
    model, processor = llava.load_llava(folder, "sdpa"), llava.llava_processor(folder)
    llava.check_image_tokens(processor, model.config, "model.init_from")
    assert not check_chat_template(processor)  # llava-hf's template has no eos after answers
    ref = LlavaForConditionalGeneration.from_pretrained(parts["llava_hf"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


# --- label masks ---------------------------------------------------------------------------------------------


def expected_pieces(template: str, image: str) -> list[tuple[str, bool]]:
    """The conversation rendered by hand in each template's format: (text, is it an answer?)."""
    if template == "llava-1.5":
        q = llava.LLAVA_SYSTEM
        return [
            (f"<s>{q} USER: {image}\nWhat digit is this? ASSISTANT:", False),
            (" Seven.</s>", True),
            ("USER: Is it odd or even? ASSISTANT:", False),
            (" It is odd.</s>", True),
        ]
    if template == "llama3":
        h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"  # noqa: E731
        return [
            (f"<s>{h('user')}{image}\nWhat digit is this?<|eot_id|>{h('assistant')}", False),
            ("Seven.<|eot_id|>", True),
            (f"{h('user')}Is it odd or even?<|eot_id|>{h('assistant')}", False),
            ("It is odd.<|eot_id|>", True),
        ]
    # llava-hf: parts, images first then text + " ", "ASSISTANT:" generation prompt, no eos.
    return [
        (f"USER: {image}\nWhat digit is this? ASSISTANT:", False),
        (" Seven.", True),
        (" USER: Is it odd or even? ASSISTANT:", False),
        (" It is odd.", True),
        (" ", False),
    ]


@pytest.mark.parametrize(
    "template,vision,language",
    [("llava-1.5", "clip", "vicuna"), ("llama3", "siglip", "llama3"), ("llava-hf", None, "llava_hf")],
)
def test_multi_turn_labels_are_the_assistant_turns(parts, template, vision, language):
    if vision:
        processor = llava.parts_processor(str(parts[vision]), str(parts[language]), VLMModelConfig())
    else:
        processor = llava.llava_processor(parts[language])
    tok = processor.tokenizer
    enc = encode_conversation(CONVERSATION, [digit_image()], processor)
    # Independently: each piece tokenized on its own, labels = the answer pieces' ids, -100 elsewhere.
    ids, labels = [], []
    for text, answer in expected_pieces(template, "<image>" * 16):
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if answer else [IGNORE_INDEX] * len(piece)
    assert enc["input_ids"].tolist() == ids
    assert enc["labels"].tolist() == labels
    assert enc["pixel_values"].shape == (1, 3, fx.IMAGE_SIZE, fx.IMAGE_SIZE) and not enc["truncated"]
    # The prompt for the first answer is what generation sees (chat_prompt + the processor).
    prompt = processor(text=chat_prompt(processor, CONVERSATION[:1]), images=[digit_image()], add_special_tokens=False)
    n = len(prompt["input_ids"][0])
    assert enc["input_ids"][:n].tolist() == prompt["input_ids"][0] and enc["labels"][n] != IGNORE_INDEX


def test_truncation_never_splits_an_image(parts):
    processor = llava.parts_processor(str(parts["clip"]), str(parts["vicuna"]), VLMModelConfig())
    two = [
        {"role": "user", "content": "<image>\nWhat digit is this?"},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "And this one?\n<image>"},
        {"role": "assistant", "content": "It is odd."},
    ]
    full = encode_conversation(two, [digit_image(0), digit_image(1)], processor)
    second = int((full["input_ids"] == processor.image_token_id).nonzero()[16])  # first token of image 2
    for cut in (second + 5, second + 16 + 3):
        enc = encode_conversation(two, [digit_image(0), digit_image(1)], processor, max_seq_len=cut)
        kept = 1 if cut < second + 16 else 2
        assert enc["truncated"] and len(enc["pixel_values"]) == kept
        assert len(enc["input_ids"]) == (second if kept == 1 else cut)
        assert int((enc["input_ids"] == processor.image_token_id).sum()) == 16 * kept
        assert torch.equal(enc["input_ids"], full["input_ids"][: len(enc["input_ids"])])


@pytest.mark.parametrize("packing", [True, False])
def test_text_only_micro_batch_gets_a_silent_blank_image(parts, packing):
    # A micro-batch without images still runs the tower (ZeRO-3 ranks must run the same modules): a blank
    # image's tokens ride along as their own unlabeled segment, and the loss is the same as without it.
    model, processor = assemble(parts, "clip", "vicuna")
    text = encode_conversation(
        [{"role": "user", "content": "What is two plus three?"}, {"role": "assistant", "content": "Five."}],
        [],
        processor,
    )
    assert (
        tuple(text["pixel_values"].shape) == (0,)
        and processor.tokenizer.decode(text["labels"][text["labels"] >= 0]) == " Five.</s>"
    )
    blank = blank_sample(processor.image_token_id, 16, llava.check_image_tokens(processor, model.config, "src"))
    short = encode_conversation(
        [{"role": "user", "content": "Thank you!"}, {"role": "assistant", "content": "You are welcome."}], [], processor
    )
    plain = collate([text, short], packing=packing, max_seq_len=256, pad_id=0)
    padded = collate([text, short], packing=packing, max_seq_len=256, pad_id=0, blank=blank)
    assert plain["pixel_values"] is None and padded["pixel_values"].shape == (1, 3, fx.IMAGE_SIZE, fx.IMAGE_SIZE)
    for batch in (plain, padded):
        assert batch["text_only"] == batch["samples"] == 2 and batch["real_tokens"] == len(text["input_ids"]) + len(
            short["input_ids"]
        )
    with torch.no_grad():
        loss = model(**plain["packed"].model_inputs("sdpa")).loss
        with_blank = model(**padded["packed"].model_inputs("sdpa"), pixel_values=padded["pixel_values"]).loss
    torch.testing.assert_close(with_blank, loss, rtol=1e-6, atol=0)
    image = encode_conversation(CONVERSATION, [digit_image()], processor)
    mixed = collate([text, image], packing=packing, max_seq_len=256, pad_id=0, blank=blank)
    assert mixed["pixel_values"].shape[0] == 1 and mixed["samples"] == 2  # an image already there: no blank
