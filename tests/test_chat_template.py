"""The prompt option ``chat_template`` (kvcert.prompts.build_prompt, kvcert-run's key, kvcert.generate's argument).

Off (the default), a prompt's token ids are what every committed study ran with: the context encoded with the
tokenizer's special tokens, then question + answer prefix without them. On, the tokenizer's chat template frames
the prompt as kvpress's pipeline does: the template's opening and the context are the prefix, the question, the
template's closing (end of the user turn, the assistant's header) and the answer prefix the rest, so the streaming
setting compresses the framed context alone. A tokenizer without a template is refused in one line.

Tokenizers: the tests' own byte-level BPE (tests/helpers/tokenizer.py), given templates written here in the
formats of ChatML (SmolLM2, Qwen) and of Gemma (which trims the user's text) or none; the bundled SmolLM2's
(marker smollm2), whose GGUF carries a ChatML template; and the bundled Gemma 3 270M's, the pre-trained model,
whose GGUF carries none (marker long: make model does not fetch Gemma 3, and fetching and converting it takes
minutes). On SmolLM2 the framed ids equal, token for token, what kvpress 0.5.5's pipeline prefills and feeds
(its own preprocessing, run in the peer environment of tests/test_peers.py: tests/peers/kvpress_prompts.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

import kvcert
from kvcert.errors import ConfigError
from kvcert.hydra_app import compose
from kvcert.prompts import CONTENT_END, build_prompt, chat_frame
from kvcert.run_schema import ELIDED_AT_DEFAULT, IDENTITY_KEYS, RUN
from kvcert.runner import cli
from kvcert.runner.cell import _identity, config_yaml
from kvcert.runner.config import validate
from kvcert.scales import scales_folder

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

# ChatML with a default system turn, as SmolLM2's GGUF carries it (written here, not copied).
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
          "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Gemma's turn format: a BOS from the template, the user's text trimmed, the model's turn opened.
GEMMA_LIKE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
              "m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# Qwen3's switch: with enable_thinking false an empty thinking block follows the assistant's header.
THINKING = CHATML.replace("<|im_start|>assistant\n{% endif %}",
                          "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                          "<think>\n\n</think>\n\n{% endif %}{% endif %}")

CONTEXT = "Passage 1: The harbour town kept a ledger of every ship that docked there. The special pass key is 51326."
QUESTION = "\nWhat is the special pass key?"
PREFIX = " The special pass key is"


def tokenizer(template: str | None):
    from helpers.tokenizer import byte_level_tokenizer

    tok = byte_level_tokenizer()
    tok.chat_template = template
    return tok


def ids(prompt) -> tuple[list[int], list[int]]:
    return prompt.prefix_ids[0].tolist(), prompt.suffix_ids[0].tolist()


# ------------------------------------------------------------------------------------------- off: as before


def workload_items(tok):
    from kvcert.data import load_items

    items = load_items("ruler", {"name": "ruler", "tasks": ["niah_multikey_2", "vt", "fwe"], "seed": 0,
                                 "context_tokens": 400}, tok, 3)
    items += load_items("jsonl", {"name": "jsonl", "path": str(FIXTURES / "items_small.jsonl")}, tok, 2)
    items += load_items("longbench", {"name": "longbench", "path": str(FIXTURES / "longbench_small.jsonl")}, tok, 2)
    return items


@pytest.mark.parametrize("setting", ["question_aware", "streaming"])
def test_off_the_token_ids_are_the_raw_concatenation_of_every_study_so_far(setting):
    tok = tokenizer(CHATML)  # a template present but not asked for changes nothing
    for item in workload_items(tok):
        context = tok(item.context, add_special_tokens=True).input_ids
        rest = tok(item.question + item.answer_prefix, add_special_tokens=False).input_ids
        for prompt in (build_prompt(tok, item.context, item.question, item.answer_prefix, setting=setting),
                       build_prompt(tok, item.context, item.question, item.answer_prefix, setting=setting,
                                    chat_template=False)):
            want = (context + rest, []) if setting == "question_aware" else (context, rest)
            assert ids(prompt) == want, item.id


# ------------------------------------------------------------------------------------------- on: framed


@pytest.mark.parametrize("template, opening, closing", [
    (CHATML, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
    (GEMMA_LIKE, "<|im_start|><start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"),
    (THINKING, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n",
     "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
])
def test_the_frame_is_the_templates_text_around_a_lone_user_turn_with_the_reply_opened(template, opening, closing):
    assert chat_frame(tokenizer(template)) == (opening, closing)


@pytest.mark.parametrize("template", [CHATML, GEMMA_LIKE])
def test_on_the_context_opens_a_user_turn_the_question_closes_it_and_the_answer_opens_the_assistants(template):
    tok = tokenizer(template)
    opening, closing = chat_frame(tok)
    streaming = build_prompt(tok, CONTEXT, QUESTION, PREFIX, setting="streaming", chat_template=True)
    aware = build_prompt(tok, CONTEXT, QUESTION, PREFIX, setting="question_aware", chat_template=True)
    prefix, suffix = ids(streaming)
    # the streaming split is exactly at the context's end: the prefix is the framed context, no more
    assert tok.decode(prefix) == opening + CONTEXT
    assert prefix == tok(opening + CONTEXT, add_special_tokens=False).input_ids
    assert tok.decode(suffix) == QUESTION + closing + PREFIX
    assert suffix == tok(QUESTION + closing + PREFIX, add_special_tokens=False).input_ids
    # question-aware prefills the same ids at once
    assert ids(aware) == (prefix + suffix, [])
    text = tok.decode(prefix + suffix)
    assert text.index(CONTEXT) < text.index(QUESTION.strip()) < text.index(closing)
    assert text.endswith(QUESTION + closing + PREFIX)
    raw = build_prompt(tok, CONTEXT, QUESTION, PREFIX, setting="question_aware")
    assert ids(raw) != ids(aware) and "<|im_start|>assistant" not in tok.decode(ids(raw)[0])


def test_a_templated_prompt_cut_to_fit_keeps_the_templates_opening_and_the_question():
    tok = tokenizer(CHATML)
    opening, closing = chat_frame(tok)
    context = " ".join(f"Line {i}: the queue drained before dawn." for i in range(60))
    full = build_prompt(tok, context, QUESTION, PREFIX, setting="streaming", chat_template=True)
    limit = 200
    cut = build_prompt(tok, context, QUESTION, PREFIX, setting="streaming", chat_template=True, limit=limit,
                       max_new_tokens=16)
    assert not full.truncated and cut.truncated
    prefix, suffix = ids(cut)
    assert len(prefix) + len(suffix) + 16 == limit
    head = tok(opening, add_special_tokens=False).input_ids
    assert prefix[:len(head)] == head and ids(full)[0][:len(head) + 20] == prefix[:len(head) + 20]
    assert ids(full)[0][-20:] == prefix[-20:]  # the context's end survives: the middle was cut
    assert suffix == ids(full)[1]
    with pytest.raises(ConfigError, match=r"^item 'x': prompt \+ answer need \d+ tokens > max_context_tokens=200"):
        build_prompt(tok, context, QUESTION, PREFIX, chat_template=True, limit=limit, truncate="error", name="item 'x'")


def test_a_tokenizer_without_a_template_is_refused_in_one_line():
    tok = tokenizer(None)
    with pytest.raises(ConfigError) as err:
        build_prompt(tok, CONTEXT, QUESTION, PREFIX, chat_template=True, name="item 'a'")
    message = str(err.value)
    assert message.startswith("item 'a': chat_template=true, but the tokenizer ") and "\n" not in message
    assert message.endswith("has no chat template; set chat_template=false")
    assert ids(build_prompt(tok, CONTEXT, QUESTION, PREFIX)) == ids(build_prompt(tokenizer(CHATML), CONTEXT, QUESTION,
                                                                                PREFIX))


def test_a_template_that_does_not_render_the_users_text_verbatim_is_refused():
    tok = tokenizer("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    with pytest.raises(ConfigError, match="does not render a user turn's text verbatim once; set chat_template=false"):
        build_prompt(tok, CONTEXT, QUESTION, chat_template=True)
    with pytest.raises(ConfigError, match="the context holds"):
        build_prompt(tokenizer(CHATML), CONTEXT + CONTENT_END, QUESTION, chat_template=True)


# ------------------------------------------------------------------------------------------- the run config


def test_the_option_is_part_of_a_cells_identity_and_absent_from_its_config_while_off():
    assert RUN.chat_template is False and "chat_template" in IDENTITY_KEYS and "chat_template" in ELIDED_AT_DEFAULT
    off, on = compose(["out_dir=x"]), compose(["out_dir=x", "chat_template=true"])
    assert validate(off).chat_template is False and validate(on).chat_template is True
    assert "chat_template" not in config_yaml(off)  # a default cell writes its config.yaml as before
    assert "chat_template: true\n" in config_yaml(on)
    assert "chat_template" not in _identity(off, [], "f")["config"]
    assert _identity(on, [], "f")["config"]["chat_template"] is True
    assert _identity(on, [], "f") != _identity(off, [], "f")
    # a config.yaml written with the option reads back with it
    assert validate({**yaml.safe_load(config_yaml(on)), "out_dir": "x"}).chat_template is True


def test_a_bad_value_names_the_key():
    with pytest.raises(ConfigError, match=r"^chat_template='maybe': expected true or false$"):
        validate({**yaml.safe_load(config_yaml(compose(["out_dir=x"]))), "chat_template": "maybe"})


def test_the_library_takes_the_option_with_the_same_default():
    import inspect

    assert inspect.signature(kvcert.generate).parameters["chat_template"].default is RUN.chat_template
    assert inspect.signature(build_prompt).parameters["chat_template"].default is RUN.chat_template


# ------------------------------------------------------------------------------------------- the scales


def _cells(name: str) -> dict[str, dict]:
    from kvcert.scales import load_scale, study_cells

    scale = load_scale(name, scales_folder(ROOT))
    return {f"{study}/{cell}": spec for (study, cell), spec in study_cells(scale).items()}, scale


@pytest.mark.parametrize("name", ["paper", "rehearse"])
def test_the_paper_scale_prompts_every_cell_with_the_chat_template(name):
    from kvcert.scales import cell_overrides, override_value

    cells, scale = _cells(name)
    studies = {key.split("/")[0] for key in cells}
    assert studies == {"paper", "leaderboard"}
    for key, spec in cells.items():
        # the cell rule's params (its rerun trigger) and kvcert-run's config both carry it
        assert override_value(cell_overrides(scale, spec), "chat_template") is True, key


@pytest.mark.parametrize("name", ["default", "v4", "smoke"])
def test_the_bundled_models_studies_keep_their_raw_prompts(name):
    from kvcert.scales import cell_overrides, override_value

    cells, scale = _cells(name)
    assert cells
    for key, spec in cells.items():
        assert override_value(cell_overrides(scale, spec), "chat_template") is None, key


# ------------------------------------------------------------------------------------------- a cell, end to end


def _tiny_hf(path: Path, template: str | None) -> Path:
    """A tiny random-weight Llama with the tests' tokenizer (and ``template``), saved as a local HF directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer(template)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=len(tok), max_position_embeddings=1024,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _run(tmp_path, model_dir: Path, out: Path, *extra: str) -> int:
    return cli.main(["progress=false", "threads=1", "model=hf", f"model.name={model_dir}", "data=jsonl",
                     f"data.path={FIXTURES / 'items_small.jsonl'}", "n_items=2", "policies=[snapkv]",
                     "designs=[topk]", "budgets=[0.5]", "setting=streaming", f"out_dir={out}", *extra])


def test_a_cell_with_the_option_records_it_and_compresses_the_framed_context(tmp_path, capsys):
    import pandas as pd

    from kvcert.data import load_items

    model_dir = _tiny_hf(tmp_path / "model", CHATML)
    on, off = tmp_path / "on", tmp_path / "off"
    assert _run(tmp_path, model_dir, on, "chat_template=true") == 0, capsys.readouterr().err[-2000:]
    assert _run(tmp_path, model_dir, off) == 0, capsys.readouterr().err[-2000:]
    assert yaml.safe_load((on / "config.yaml").read_text())["chat_template"] is True
    assert "chat_template" not in (off / "config.yaml").read_text()
    tok = kvcert.load_tokenizer(f"hf:{model_dir}")
    items = load_items("jsonl", {"name": "jsonl", "path": str(FIXTURES / "items_small.jsonl")}, tok, 2)
    for out, templated in ((on, True), (off, False)):
        rows = pd.read_parquet(out / "items.parquet").drop_duplicates("item_id").set_index("item_id")
        for item in items:
            prompt = build_prompt(tok, item.context, item.question, item.answer_prefix, setting="streaming",
                                  chat_template=templated)
            assert rows.loc[item.id, "context_tokens"] == prompt.prefix_ids.shape[-1], (out.name, item.id)


def test_a_cell_with_the_option_on_a_model_without_a_template_is_refused_before_anything_is_written(tmp_path, capsys):
    model_dir = _tiny_hf(tmp_path / "model", None)
    out = tmp_path / "cell"
    assert _run(tmp_path, model_dir, out, "chat_template=true") == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"kvcert-run: error: chat_template=true: the tokenizer of model=hf ({model_dir}) has no chat "
                    "template; set chat_template=false")
    assert not out.exists() or not any(out.iterdir())


# ------------------------------------------------------------------------------------------- the bundled models


def _digest(prompt) -> str:
    return hashlib.sha256(json.dumps(list(ids(prompt))).encode()).hexdigest()[:16]


# SmolLM2's token ids of these items, computed with build_prompt before the option existed (prefix, suffix)
BEFORE = {
    "ruler/niah_multikey_2/s0/00000|question_aware": "cd171922a1d5e61f",
    "ruler/niah_multikey_2/s0/00000|streaming": "a36abe55606c927b",
    "ruler/vt/s0/00000|question_aware": "6fa403f11e40d52a",
    "ruler/vt/s0/00000|streaming": "14da9bd60f116da5",
    "ruler/cwe/s0/00000|question_aware": "792486a5dbf094a4",
    "ruler/cwe/s0/00000|streaming": "8e6cd1ab9cb18643",
    "fact-1|question_aware": "5c3a1dbcd673b8e7",
    "fact-1|streaming": "c94205ef919885fd",
    "fact-2|question_aware": "736b3c1036c68050",
    "fact-2|streaming": "23fdbb10de5d2b1f",
    "longbench/gov_report/gov-0001|question_aware": "f345306a01573785",
    "longbench/gov_report/gov-0001|streaming": "83ff8798d2d906fc",
    "longbench/hotpotqa/hq-0001|question_aware": "27efce36b7c9863c",
    "longbench/hotpotqa/hq-0001|streaming": "ff4358e336b703e4",
}


# The three tests on these items run in make test-full (marker slow): building the RULER items takes half a minute
# and kvpress's pipeline runs in the peer environment; the framing itself is checked above on built-in templates.
@pytest.fixture(scope="module")
def smollm2_items():
    from kvcert.data import load_items

    tok = kvcert.load_tokenizer("smollm2")
    items = load_items("ruler", {"name": "ruler", "tasks": ["niah_multikey_2", "vt", "cwe"], "seed": 0,
                                 "context_tokens": 800}, tok, 3)
    items += load_items("jsonl", {"name": "jsonl", "path": str(FIXTURES / "items_small.jsonl")}, tok, 2)
    items += load_items("longbench", {"name": "longbench", "path": str(FIXTURES / "longbench_small.jsonl")}, tok, 2)
    return tok, items


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_off_gives_the_token_ids_of_every_study_so_far(smollm2_items):
    tok, items = smollm2_items
    got = {}
    for item in items:
        for setting in ("question_aware", "streaming"):
            limit = 400 if item.id.startswith("ruler") else None  # the RULER items are cut to fit
            prompt = build_prompt(tok, item.context, item.question, item.answer_prefix, setting=setting,
                                  max_new_tokens=int(item.max_new_tokens), limit=limit)
            assert prompt.truncated == (limit is not None)
            got[f"{item.id}|{setting}"] = _digest(prompt)
    assert got == BEFORE


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_on_frames_its_chatml_turns_and_splits_at_the_context_end(smollm2_items):
    tok, items = smollm2_items
    opening, closing = chat_frame(tok)
    assert opening.endswith("<|im_start|>user\n") and opening.startswith("<|im_start|>system\n")
    assert closing == "<|im_end|>\n<|im_start|>assistant\n"
    for item in items:
        prompt = build_prompt(tok, item.context, item.question, item.answer_prefix, setting="streaming",
                              chat_template=True)
        prefix, suffix = ids(prompt)
        assert tok.decode(prefix) == opening + item.context, item.id
        assert tok.decode(suffix) == item.question + closing + item.answer_prefix, item.id
        assert tok.convert_tokens_to_ids("<|im_end|>") in suffix and tok.convert_tokens_to_ids("<|im_start|>") in prefix


@pytest.mark.smollm2
def test_smollm2_generate_with_the_option_answers_in_its_assistant_turn(smollm2):
    model, tok = smollm2
    context = "The hall was booked on Tuesday, so the meeting moved to Thursday."
    kwargs = dict(context=context, question="\nWhen is the meeting?", answer_prefix=" The meeting is on",
                  policy="full", certify=False, oracle=False, max_new_tokens=4, setting="streaming")
    framed = kvcert.generate(model, tok, chat_template=True, **kwargs)
    raw = kvcert.generate(model, tok, **kwargs)
    opening, _ = chat_frame(tok)
    assert framed.context_tokens == len(tok(opening + context, add_special_tokens=False).input_ids)
    assert raw.context_tokens == len(tok(context, add_special_tokens=True).input_ids)
    assert "Thursday" in framed.text


@pytest.mark.long  # fetches and converts Gemma 3 where make model has not (minutes): make test-long
@pytest.mark.smollm2
def test_gemma3_the_pretrained_model_has_no_template_and_is_refused():
    tok = kvcert.load_tokenizer("gemma3")
    assert not tok.chat_template
    with pytest.raises(ConfigError, match="has no chat template; set chat_template=false"):
        build_prompt(tok, CONTEXT, QUESTION, PREFIX, chat_template=True)
    prompt = build_prompt(tok, CONTEXT, QUESTION, PREFIX, setting="streaming")
    assert ids(prompt) == (tok(CONTEXT, add_special_tokens=True).input_ids,
                           tok(QUESTION + PREFIX, add_special_tokens=False).input_ids)


@pytest.mark.smollm2
def test_the_rehearsal_stand_ins_keep_smollm2s_template(tmp_path):
    """The rehearse scale runs the paper scale's cells, chat_template=true included, on stand-ins that carry the
    bundled SmolLM2's tokenizer (kvcert.standins): its template survives their save and reload."""
    from kvcert.standins import build_model

    tok = kvcert.load_tokenizer("smollm2")
    path = build_model("qwen3", tmp_path / "qwen3", tok, layers=1, kv_heads=1, head_dim=8)
    saved = kvcert.load_tokenizer(f"hf:{path}")
    assert chat_frame(saved) == chat_frame(tok)
    prompt = build_prompt(saved, CONTEXT, QUESTION, PREFIX, setting="streaming", chat_template=True)
    assert ids(prompt) == ids(build_prompt(tok, CONTEXT, QUESTION, PREFIX, setting="streaming", chat_template=True))


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_on_gives_kvpress_pipelines_token_ids(smollm2_items, tmp_path):
    """kvpress 0.5.5's pipeline (its own preprocessing, in the peer environment: `make peers`) prefills and
    compresses exactly the streaming prefix and feeds exactly the suffix that chat_template=true builds."""
    import os
    import subprocess

    tok, items = smollm2_items
    peer = Path(os.environ.get("KVCERT_PEER_PYTHON") or ROOT / ".venv-peers" / "bin" / "python")
    if not peer.is_file():
        pytest.fail(f"{peer}: no peer environment; run `make peers` (or set KVCERT_PEER_PYTHON)")
    tok.save_pretrained(tmp_path / "tokenizer")
    request = [{"context": i.context, "question": i.question, "answer_prefix": i.answer_prefix} for i in items]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # nothing of kvcert's there
    done = subprocess.run([str(peer), str(ROOT / "tests" / "peers" / "kvpress_prompts.py"), str(tmp_path / "tokenizer")],
                          input=json.dumps(request), capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout)
    assert len(theirs) == len(items)
    for item, (context_ids, question_ids) in zip(items, theirs):
        prompt = build_prompt(tok, item.context, item.question, item.answer_prefix, setting="streaming",
                              chat_template=True)
        assert ids(prompt) == (context_ids, question_ids), item.id
