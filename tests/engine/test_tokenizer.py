"""Tokenizer, chat-template and streaming-detokenizer tests.

Fast tests use tiny tokenizers trained here; the slow ones compare against HF transformers on the
bundled SmolLM2 model.
"""

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from sluice_engine.tokenizer import IncrementalDetokenizer, Tokenizer

TRAINING_TEXT = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "Café crème, naïve façade; 中文字符 and emoji 😀👍🏽 sometimes.",
    "def main():\n    return 42  # the answer\n",
]
SPECIAL_TOKENS = ["<s>", "</s>", "<|eot|>", "<pad>"]
SIMPLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def train_tokenizer(kind: str = "byte_level") -> tokenizers.Tokenizer:
    if kind == "byte_level":
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-style: "▁" marks spaces and the decoder drops the one at the very start
        tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = sorted(set("".join(TRAINING_TEXT)) | {"▁"})
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[*SPECIAL_TOKENS, "<unk>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    return tok


def write_model_dir(path: Path, tokenizer_config: dict, kind: str = "byte_level", **extra_files) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    train_tokenizer(kind).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in extra_files.items():
        filename = name.replace("__", ".")
        (path / filename).write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.fixture
def tiny(tmp_path) -> Tokenizer:
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "pad_token": "<pad>"}
    return Tokenizer.from_dir(
        write_model_dir(tmp_path / "tiny", config, chat_template__jinja=SIMPLE_TEMPLATE)
    )


def render(template: str, messages, tmp_path: Path, **kwargs) -> str:
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "t", {"chat_template": template}))
    return tok.apply_chat_template(messages, **kwargs)


# --- settings read from the model directory ---------------------------------------------------------


def test_eos_ids_are_the_union_of_all_sources(tmp_path):
    tok = Tokenizer.from_dir(
        write_model_dir(
            tmp_path / "m",
            {"eos_token": "</s>"},
            generation_config__json={"eos_token_id": [2, 7]},
            config__json={"eos_token_id": 9, "bos_token_id": 0},
        )
    )
    assert tok.eos_token_ids == frozenset({tok.token_to_id("</s>"), 2, 7, 9})
    assert tok.bos_token_id == 0  # no bos_token in tokenizer_config, so config.json's id


def test_special_token_strings_and_ids(tiny):
    assert tiny.bos_token == "<s>"  # read from the serialized AddedToken dict form
    assert tiny.bos_token_id == tiny.token_to_id("<s>")
    assert tiny.id_to_token(tiny.bos_token_id) == "<s>"
    assert tiny.eos_token_ids == frozenset({tiny.token_to_id("</s>")})
    assert tiny.vocab_size == len(train_tokenizer().get_vocab())


def test_chat_template_list_form_takes_default(tmp_path):
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "m", {"chat_template": templates}))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "DEFAULT"


def test_chat_template_file_wins_over_tokenizer_config(tmp_path):
    # As in HF: a separate chat_template.jinja overrides the tokenizer_config entry.
    tok = Tokenizer.from_dir(
        write_model_dir(tmp_path / "m", {"chat_template": "FROM CONFIG"}, chat_template__jinja="FROM FILE")
    )
    assert tok.apply_chat_template([]) == "FROM FILE"


def test_no_chat_template_is_a_clear_error(tmp_path):
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "m", {}))
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template; use /v1/completions"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


# --- rendering ----------------------------------------------------------------------------------------


def test_renders_with_special_tokens_and_generation_prompt(tiny):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tiny.apply_chat_template(messages) == "<s>[system]be brief</s>[user]hi</s>[assistant]"
    assert (
        tiny.apply_chat_template(messages, add_generation_prompt=False)
        == "<s>[system]be brief</s>[user]hi</s>"
    )


def test_content_parts_are_flattened_to_text(tiny):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    messages = [{"role": "user", "content": parts}]
    assert tiny.apply_chat_template(messages) == "<s>[user]first\nsecond</s>[assistant]"
    assert messages[0]["content"] is parts  # the caller's messages are left alone


def test_non_text_content_part_is_rejected(tiny):
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(ValueError, match="image_url"):
        tiny.apply_chat_template([{"role": "user", "content": [image]}])


def test_raise_exception_becomes_value_error(tmp_path):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    assert render(template, [{"role": "user", "content": ""}], tmp_path) == "ok"
    with pytest.raises(ValueError, match="first must be user"):
        render(template, [{"role": "system", "content": ""}], tmp_path)


def test_template_errors_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="chat template"):
        render("{% for %}", [], tmp_path)  # does not compile
    with pytest.raises(ValueError, match="chat template"):
        render("{{ messages[0].content.upper() }}", [], tmp_path)  # fails while rendering


def test_tojson_matches_hf_filter(tmp_path):
    tools = [{"name": "größe", "description": "a < b & c"}]
    assert render("{{ tools | tojson }}", [], tmp_path, tools=tools) == json.dumps(tools, ensure_ascii=False)
    assert render("{{ tools | tojson(indent=2) }}", [], tmp_path, tools=tools) == json.dumps(
        tools, ensure_ascii=False, indent=2
    )


def test_tools_and_extra_variables_reach_the_template(tmp_path):
    template = "{{ tools is none }} {{ enable_thinking }} {{ documents is none }}"
    assert render(template, [], tmp_path, enable_thinking=False) == "True False True"


def test_hf_template_extensions(tmp_path):
    # Loop controls and {% generation %} blocks appear in real Hub templates.
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}|{{ strftime_now('%Y')|length }}"
    )
    assert (
        render(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], tmp_path)
        == "a|4"
    )


# --- encoding -----------------------------------------------------------------------------------------


def test_encode_chat_does_not_double_bos(tmp_path):
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "m", config, chat_template__jinja=SIMPLE_TEMPLATE))
    bos = tok.bos_token_id
    assert tok.encode("Hello")[0] == bos  # add_bos_token makes plain encoding start with BOS
    assert tok.encode("Hello", add_special_tokens=False)[0] != bos
    ids = tok.encode_chat([{"role": "user", "content": "Hello"}])
    assert ids[0] == bos and ids[1] != bos  # the template's own "<s>" only
    assert ids == tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello"}]), False)


def test_encode_decode_round_trip(tiny):
    for text in TRAINING_TEXT:
        assert tiny.decode(tiny.encode(text)) == text
    ids = tiny.encode("<s>Hello</s>")
    assert tiny.decode(ids) == "Hello"
    assert tiny.decode(ids, skip_special_tokens=False) == "<s>Hello</s>"


# --- incremental detokenization -----------------------------------------------------------------------


def stream(tokenizer: Tokenizer, prompt_ids, ids, chunk: int = 1, skip_special_tokens: bool = True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return detok, pieces


def test_detokenizer_holds_back_split_characters(tiny):
    text = "中文字符 😀👍🏽 naïve"
    ids = tiny.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tiny.decode([i]) for i in ids), "test needs a character split across tokens"
    detok, pieces = stream(tiny, [], ids)
    assert "".join(pieces) == text == detok.text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces  # at least one step was held back
    assert detok.token_count == len(ids)
    assert detok.flush() == ""


def test_detokenizer_flush_emits_an_unfinished_character(tiny):
    ids = tiny.encode("😀", add_special_tokens=False)
    # Find a proper prefix of the emoji's tokens that is not a whole character.
    partial = next(ids[:n] for n in range(1, len(ids)) if tiny.decode(ids[:n]).endswith("\ufffd"))
    detok, pieces = stream(tiny, [], partial)
    assert "".join(pieces) == ""
    assert detok.flush().endswith("\ufffd")


def test_detokenizer_does_not_stall_on_invalid_bytes(tiny):
    # A model can emit bytes that never form a character; only the last few may still complete one.
    invalid_byte = next(i for i in range(tiny.vocab_size) if tiny.decode([i]) == "\ufffd")
    ids = [invalid_byte] * 8
    detok, _ = stream(tiny, [], ids)
    assert "\ufffd" in detok.text  # emitted before flush, although the text still ends in U+FFFD
    assert detok.text + detok.flush() == tiny.decode(ids)


def test_detokenizer_emits_finished_characters_while_the_next_is_split(tiny):
    # One token per byte, two per step: every step finishes a character and starts the next one, so the
    # text always ends unfinished. Finished characters must still come out right away.
    text = "中文字符"  # 3 bytes each
    ((byte_chars, _),) = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
    byte_ids = [tiny.token_to_id(c) for c in byte_chars]
    detok, pieces = stream(tiny, [], byte_ids, chunk=2)
    assert pieces == ["", "中", "文", "", "字", "符"]
    assert detok.text == text


def byte_fallback_tokenizer(tmp_path: Path) -> Tokenizer:
    """Llama/Mistral style: characters outside the vocab become <0xNN> byte tokens, one U+FFFD each alone."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "b": 5, "▁a": 6}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    (tmp_path / "bf").mkdir()
    tok.save(str(tmp_path / "bf" / "tokenizer.json"))
    return Tokenizer.from_dir(tmp_path / "bf")


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_detokenizer_with_byte_fallback_tokens(tmp_path, chunk):
    tok = byte_fallback_tokenizer(tmp_path)
    ids = tok.encode("a 中b 😀a 文", add_special_tokens=False)
    assert tok.decode(ids[2:4]) == "\ufffd\ufffd"  # two bytes of 中: one U+FFFD per byte
    detok, pieces = stream(tok, [], ids, chunk=chunk)
    assert "".join(pieces) == tok.decode(ids) == "a 中b 😀a 文"
    assert not any("\ufffd" in piece for piece in pieces)


def test_detokenizer_skips_special_tokens(tiny):
    ids = tiny.encode("<s>Hello</s>", add_special_tokens=False)
    assert "".join(stream(tiny, [], ids)[1]) == "Hello"
    assert "".join(stream(tiny, [], ids, skip_special_tokens=False)[1]) == "<s>Hello</s>"


@pytest.mark.parametrize("chunk", [1, 3])
def test_detokenizer_keeps_spaces_of_sentencepiece_tokens(tmp_path, chunk):
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "sp", {}, kind="metaspace"))
    prompt = tok.encode("Hello world,", add_special_tokens=False)
    generated = tok.encode("this is a small corpus", add_special_tokens=False)
    detok, pieces = stream(tok, prompt, generated, chunk=chunk)
    # In context the first generated word keeps its space, which decoding it alone would drop.
    expected = tok.decode(prompt + generated)[len(tok.decode(prompt)) :]
    assert expected.startswith(" this")
    assert "".join(pieces) == expected == detok.text


# --- against HF transformers on the bundled model ----------------------------------------------------

ENCODE_CASES = [
    "Hello, world!",
    "",
    " leading space",
    "trailing space ",
    "  double  spaces\tand\ttabs\n\nnewlines\r\n",
    "Café crème brûlée, naïve façade, Ångström",
    "中文字符和日本語のテキスト",
    "emoji 😀👍🏽🇺🇳 family 👨‍👩‍👧‍👦",
    "def main(argv: list[str]) -> int:\n    return len(argv)  # comment\n",
    "<html><body class='x'>&amp;</body></html>",
    "numbers 1234567890 3.14159 -2e10",
    "<|im_start|>user\nhi<|im_end|>",
    "Ελληνικά και русский текст",
    "مرحبا بالعالم",
    "x" * 300,
]

CHAT_CASES = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 😀"},
    ],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "中文"},
        {"role": "assistant", "content": "好"},
    ],
]

STREAM_CASES = [
    "Café crème brûlée — naïve façade",
    "中文字符和日本語のテキスト",
    "emoji 😀👍🏽🇺🇳 family 👨‍👩‍👧‍👦 done",
    "mixed: Ångström 🚀 测试 ok\n  indented",
]


@pytest.fixture(scope="module")
def smol(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.slow
class TestAgainstHF:
    @pytest.mark.parametrize("text", ENCODE_CASES)
    def test_same_ids(self, smol, hf, text):
        assert smol.encode(text) == hf.encode(text)
        assert smol.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert smol.decode(hf.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)

    @pytest.mark.parametrize("messages", CHAT_CASES)
    @pytest.mark.parametrize("add_generation_prompt", [True, False])
    def test_same_chat_rendering(self, smol, hf, messages, add_generation_prompt):
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
        expected_ids = hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
        )["input_ids"]
        assert smol.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected_ids

    def test_special_tokens(self, smol, hf):
        assert 2 in smol.eos_token_ids
        assert hf.eos_token_id in smol.eos_token_ids
        assert smol.bos_token_id == hf.bos_token_id
        assert smol.vocab_size == len(hf)
        assert smol.has_chat_template

    @pytest.mark.parametrize("text", STREAM_CASES)
    def test_streaming_matches_full_decode(self, smol, hf, text):
        ids = hf.encode(text, add_special_tokens=False)
        prompt = smol.encode_chat([{"role": "user", "content": "Say something."}])
        for prompt_ids in ([], prompt):
            for chunk in (1, 2):
                detok, pieces = stream(smol, prompt_ids, ids, chunk=chunk)
                assert "".join(pieces) == hf.decode(ids, skip_special_tokens=True) == detok.text
                assert not any("\ufffd" in piece for piece in pieces)

    def test_streaming_exercises_split_characters(self, smol):
        ids = smol.encode("😀👍🏽", add_special_tokens=False)
        assert any("\ufffd" in smol.decode([i]) for i in ids)
        _, pieces = stream(smol, [], ids)
        assert "" in pieces and "".join(pieces) == "😀👍🏽"
