import json
from pathlib import Path

import pytest

from engine.tokenizer import (
    V41_RENAMES,
    load_tokenizer,
    package_file,
    patch_v41_spellings,
    v41_tokenizer_json,
    write_tokenizer_files,
)

# spec section 7
SPEC_IDS = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜▁pad▁｜>": 2,
    "<｜System｜>": 128799,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<|EOT|>": 128805,
    "<｜tool▁calls▁begin｜>": 128806,
    "<｜tool▁sep｜>": 128814,
    "<think>": 128821,
    "</think>": 128822,
    "｜DSML｜": 128825,
    "<｜latest_reminder｜>": 128828,
    "<｜action｜>": 128829,
    "<｜query｜>": 128830,
    "<｜authority｜>": 128831,
    "<｜domain｜>": 128832,
    "<｜read_url｜>": 128845,
    "<｜deepseek_image｜>": 129264,
}


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(out)
    return out


@pytest.fixture(scope="module")
def tok(ckpt_dir):
    return load_tokenizer(ckpt_dir)


def test_patched_json_renames_exactly_two_tokens():
    v4 = json.loads(package_file("tokenizer.json").read_text(encoding="utf-8"))
    text = v41_tokenizer_json()
    v41 = json.loads(text)
    assert "<｜place▁holder▁no▁799｜>" not in text and "<｜image2｜>" not in text
    assert text.count('"<｜System｜>"') == 1 and text.count('"<｜deepseek_image｜>"') == 1
    old = {t["id"]: t for t in v4["added_tokens"]}
    new = {t["id"]: t for t in v41["added_tokens"]}
    assert old.keys() == new.keys()
    changed = {i for i in old if old[i] != new[i]}
    assert changed == {128799, 129264}
    for i in changed:  # only the spelling changes, not the flags
        assert {**old[i], "content": None} == {**new[i], "content": None}
        assert new[i]["content"] == V41_RENAMES[i][1]
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        assert v41[key] == v4[key]
    assert v41["model"]["vocab"] == v4["model"]["vocab"]
    assert v41["model"]["merges"] == v4["model"]["merges"]


def test_patch_refuses_unexpected_v4_file():
    v4 = json.loads(package_file("tokenizer.json").read_text(encoding="utf-8"))
    for t in v4["added_tokens"]:
        if t["id"] == 129264:
            t["content"] = "<｜something▁else｜>"
    with pytest.raises(ValueError, match="129264"):
        patch_v41_spellings(json.dumps(v4, ensure_ascii=False))


def test_special_ids_match_spec(tok):
    assert tok.vocab_size == 129280
    for token, token_id in SPEC_IDS.items():
        assert tok.token_to_id(token) == token_id, token
        assert tok.id_to_token(token_id) == token
        assert tok.encode(token) == [token_id], token
    assert tok.token_to_id("<｜place▁holder▁no▁799｜>") is None
    assert tok.token_to_id("<｜image2｜>") is None


def test_config_ids(tok, ckpt_dir):
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.pad_id == 1  # the package's tokenizer_config pads with EOS; Engram's pad (id 2) is separate
    config = json.loads((ckpt_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["add_bos_token"] is False
    assert config["model_max_length"] == 1048576
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!  Two spaces,\ttab,\r\nCRLF and trailing space ",
        "深度求索 DeepSeek：中文、日本語のテキスト、カタカナ",
        "emoji 🙂👍🏽 family 👨‍👩‍👧 and combining e\u0301",
        "<｜begin▁of▁sentence｜><｜System｜>Be brief.<｜User｜>Hi<｜Assistant｜><think>ok</think>"
        "answer<｜end▁of▁sentence｜>",
        "image <｜deepseek_image｜><｜deepseek_image｜> 12345678 <｜▁pad▁｜>",
        "",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    if not text.startswith("<｜begin▁of▁sentence｜>"):
        assert 0 not in ids  # no automatic BOS


def test_special_tokens_are_single_ids_in_text(tok):
    ids = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>")
    assert ids[:2] == [0, 128803] and ids[-2:] == [128804, 128822]
    assert tok.decode(tok.encode("a<｜begin▁of▁sentence｜>b"), skip_special_tokens=True) == "ab"


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(v41_tokenizer_json(), encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer_config.json")):
        load_tokenizer(tmp_path)


def test_unreadable_files(tmp_path, ckpt_dir):
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=str(tmp_path / "tokenizer.json")):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((ckpt_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[", encoding="utf-8")
    with pytest.raises(ValueError, match=str(tmp_path / "tokenizer_config.json")):
        load_tokenizer(tmp_path)
    config = json.loads((ckpt_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["bos_token"] = "<｜User｜>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ValueError, match="bos/eos"):
        load_tokenizer(tmp_path)
