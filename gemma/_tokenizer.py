"""Tokenizers of Gemma checkpoint directories: `load_tokenizer(path)` -> `Tokenizer`.

Reads a directory the way transformers 5.17 reads a Gemma 3 / Gemma 4 tokenizer:

- `tokenizer.json` through Hugging Face `tokenizers`; without it, `tokenizer.model` through
  SentencePiece (the fallback of older checkpoints).
- `tokenizer_config.json`: the named special tokens (`bos_token`, `eos_token`, `pad_token`,
  `unk_token`, `mask_token` and model-specific `*_token` keys such as Gemma 4's `sot_token` /
  `eot_token`), `added_tokens_decoder`, and the chat template.
- `chat_template.jinja` (wins over the config's `chat_template`) and `chat_templates/*.jinja`.
- `generation_config.json`: its `eos_token_id` joins the stop ids.

The BOS rule: Gemma 3 and Gemma 4 models expect `<bos>` first. With `tokenizer.json`, its
post-processor decides what `encode(text)` adds (Gemma's adds `<bos>`; transformers ignores
the config's `add_bos_token` then); with `tokenizer.model` alone, the config's
`add_bos_token` / `add_eos_token` decide (default False, as in transformers). The chat
templates write `<bos>` themselves, so rendered chats are encoded without adding it again.

Turn tokens: Gemma 3 `<start_of_turn>` / `<end_of_turn>`, Gemma 4 `<|turn>` / `<turn|>`
(its config's `sot_token` / `eot_token`). Stop ids (`eos_token_ids`) are EOS, end of turn and
the generation config's `eos_token_id`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

# Named special tokens of transformers (`SPECIAL_TOKENS_ATTRIBUTES`), with GemmaTokenizer's
# defaults where it has one.
_NAMED_TOKENS = {
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
    "sep_token": None,
    "pad_token": "<pad>",
    "cls_token": None,
    "mask_token": "<mask>",
}
# (start, end) of a turn, by family; Gemma 4 configs name them sot_token / eot_token.
_TURN_TOKENS = (("<start_of_turn>", "<end_of_turn>"), ("<|turn>", "<turn|>"))
_REPLACEMENT = "\ufffd"


def _read_json(path: Path, what: str):
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text: {e}") from e
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{what} {str(path)!r} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _token_content(value, where: str) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"{where} must be a string or an object with a string 'content', got {value!r}"
    )


# --------------------------------------------------------------------------- backends


class _TokenizersBackend:
    """A `tokenizers.Tokenizer` from tokenizer.json."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        _read_json(path, "tokenizer file")  # JSON errors named before the Rust parser's
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust parser raises a bare Exception
            raise ValueError(f"tokenizer file {str(path)!r} is malformed: {e}") from e
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def added_tokens(self) -> dict[int, tuple[str, bool]]:
        return {i: (t.content, t.special) for i, t in self.tok.get_added_tokens_decoder().items()}

    def add_token(self, content: str, *, special: bool, flags: Mapping) -> None:
        from tokenizers import AddedToken

        token = AddedToken(
            content,
            single_word=bool(flags.get("single_word", False)),
            lstrip=bool(flags.get("lstrip", False)),
            rstrip=bool(flags.get("rstrip", False)),
            normalized=bool(flags.get("normalized", not special)),
            special=special,
        )
        if special:
            self.tok.add_special_tokens([token])
        else:
            self.tok.add_tokens([token])

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class _SentencePieceBackend:
    """A SentencePiece model (tokenizer.model) with transformers' handling of added tokens.

    SentencePiece matches its user-defined pieces in text but never its control pieces
    (`<bos>`, `<eos>`, `<pad>`); added tokens are therefore split out of the text before
    SentencePiece sees it. Decoding joins the pieces with Gemma's decoder.
    """

    def __init__(self, path: Path, add_bos: bool, add_eos: bool):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(path.read_bytes())
        except Exception as e:  # RuntimeError / OSError from the C++ parser
            raise ValueError(f"SentencePiece model {str(path)!r} is malformed: {e}") from e
        if self.sp.GetPieceSize() == 0:
            raise ValueError(f"SentencePiece model {str(path)!r} has no pieces")
        self.path = path
        self.add_bos, self.add_eos = add_bos, add_eos
        self.bos_id = self.eos_id = None
        self._added: dict[int, tuple[str, bool]] = {}
        for i in range(self.sp.GetPieceSize()):
            if self.sp.IsControl(i) or self.sp.IsUnknown(i):
                self._added[i] = (self.sp.IdToPiece(i), True)
        self._split = None

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.PieceToId(token)
        return i if self.sp.IdToPiece(i) == token else None

    def id_to_token(self, i: int) -> str | None:
        return self.sp.IdToPiece(i) if 0 <= i < self.vocab_size else None

    def added_tokens(self) -> dict[int, tuple[str, bool]]:
        return dict(self._added)

    def add_token(self, content: str, *, special: bool, flags: Mapping) -> None:
        i = self.token_to_id(content)
        if i is None:
            raise ValueError(f"added token {content!r} is not a piece of {str(self.path)!r}")
        self._added[i] = (content, special)
        self._split = None

    def _pieces(self, text: str):
        """(text, None) runs for SentencePiece and (None, id) for added tokens, in order."""
        if self._split is None:
            by_content = {c: i for i, (c, _) in self._added.items()}
            names = sorted(by_content, key=len, reverse=True)
            pattern = re.compile("|".join(map(re.escape, names))) if names else None
            self._split = (pattern, by_content)
        pattern, by_content = self._split
        pos = 0
        for m in pattern.finditer(text) if pattern is not None else ():
            if m.start() > pos:
                yield text[pos : m.start()], None
            yield None, by_content[m.group()]
            pos = m.end()
        if pos < len(text):
            yield text[pos:], None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = []
        for piece, token_id in self._pieces(text):
            ids.extend(self.sp.EncodeAsIds(piece) if token_id is None else [token_id])
        if add_special_tokens:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        pieces = [
            self.sp.IdToPiece(i)
            for i in ids
            if not (skip_special_tokens and self._added.get(i, (None, False))[1])
        ]
        return self._decoder.decode(pieces)

    @functools.cached_property
    def _decoder(self):
        # Gemma's decoder, as transformers converts a SentencePiece model: "▁" -> " ", byte
        # pieces <0xNN> fused into UTF-8 (a run that is not valid UTF-8 becomes U+FFFD per
        # byte), pieces concatenated. SentencePiece's own decoder differs on invalid runs.
        from tokenizers import decoders

        return decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )


# --------------------------------------------------------------------------- chat templates


@functools.cache
def _compile_chat_template(source: str):
    """The template in transformers' environment: sandboxed, trim_blocks + lstrip_blocks,
    loop controls, `{% generation %}` blocks, JSON `tojson`, `raise_exception`, `strftime_now`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        # transformers tracks assistant spans with {% generation %}; rendering keeps the body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _load_chat_templates(directory: Path, config: Mapping, config_file: Path) -> dict[str, str]:
    """name -> template source; 'default' is the one `apply_chat_template` uses."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if not (
                isinstance(entry, Mapping)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ValueError(
                    f"{str(config_file)!r}: chat_template entries must be objects with string "
                    f"'name' and 'template', got {entry!r}"
                )
            templates[entry["name"]] = entry["template"]
    elif raw is not None:
        raise ValueError(
            f"{str(config_file)!r}: chat_template must be a string or a list of named templates, "
            f"got {type(raw).__name__}"
        )
    # Template files take priority over the config's entries, as in transformers.
    files = {}
    if (directory / "chat_template.jinja").is_file():
        files["default"] = directory / "chat_template.jinja"
    if (directory / "chat_templates").is_dir():
        for f in sorted((directory / "chat_templates").glob("*.jinja")):
            files[f.name.removesuffix(".jinja")] = f
    if files:
        templates = {}
    for name, f in files.items():
        try:
            templates[name] = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"chat template {str(f)!r} is not UTF-8 text: {e}") from e
    import jinja2

    for name, source in templates.items():
        where = files.get(name, config_file)
        try:
            _compile_chat_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(
                f"chat template {name!r} in {str(where)!r} is not valid jinja: {e} "
                f"(line {e.lineno})"
            ) from e
    return templates


# --------------------------------------------------------------------------- Tokenizer


class Tokenizer:
    """Text <-> token ids of a Gemma checkpoint, its special tokens and its chat template.

    Built by `load_tokenizer(path)`. Token ids are Python ints in [0, vocab_size).

    Attributes:
      bos_token_id, eos_token_id, pad_token_id, unk_token_id: ids of the named special
        tokens (None where the vocabulary has none).
      start_of_turn_id, end_of_turn_id: Gemma 3 `<start_of_turn>` / `<end_of_turn>` or
        Gemma 4 `<|turn>` / `<turn|>` (None where absent).
      eos_token_ids: the stop ids of generation: EOS, end of turn, and the generation
        config's `eos_token_id`, in that order, without repeats.
      add_bos_token: whether `encode(text)` puts BOS first.
      chat_templates: name -> jinja source ('default' is used unless one is named).
      path: the checkpoint directory.
    """

    def __init__(
        self,
        backend,
        *,
        path: Path,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
        generation_eos_ids: Sequence[int] = (),
    ):
        self._backend = backend
        self.path = path
        self.special_tokens = dict(special_tokens)
        self.chat_templates = dict(chat_templates)

        def named_id(key):
            token = self.special_tokens.get(key)
            return None if token is None else backend.token_to_id(token)

        self.bos_token_id = named_id("bos_token")
        self.eos_token_id = named_id("eos_token")
        self.pad_token_id = named_id("pad_token")
        self.unk_token_id = named_id("unk_token")
        start = self.special_tokens.get("sot_token")
        end = self.special_tokens.get("eot_token")
        if start is None or end is None:
            start, end = next(
                (pair for pair in _TURN_TOKENS if backend.token_to_id(pair[1]) is not None),
                (None, None),
            )
        self.start_of_turn_id = None if start is None else backend.token_to_id(start)
        self.end_of_turn_id = None if end is None else backend.token_to_id(end)
        stop = [self.eos_token_id, self.end_of_turn_id, *generation_eos_ids]
        self.eos_token_ids = tuple(dict.fromkeys(i for i in stop if i is not None))
        bad = [i for i in self.eos_token_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"generation_config.json in {str(path)!r}: eos_token_id {bad} outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        self.add_bos_token = self.bos_token_id is not None and self.encode("")[:1] == [
            self.bos_token_id
        ]

    def __repr__(self) -> str:
        kind = type(self._backend).__name__.strip("_").removesuffix("Backend")
        return (
            f"Tokenizer({kind}, vocab_size={self.vocab_size}, add_bos_token={self.add_bos_token}, "
            f"eos_token_ids={self.eos_token_ids}, path={str(self.path)!r})"
        )

    # ----------------------------------------------------------------- vocabulary

    @property
    def vocab_size(self) -> int:
        """Ids in [0, vocab_size), added tokens included."""
        return self._backend.vocab_size

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        return frozenset(i for i, (_, special) in self._backend.added_tokens().items() if special)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    # ------------------------------------------------------------ encode / decode

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the BOS rule (module docstring)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens)

    def _check_ids(self, ids) -> list[int]:
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"token ids must be ints, got {type(ids).__name__}")
        try:
            out = [int(i) for i in ids]
        except (TypeError, ValueError) as e:
            raise TypeError(f"token ids must be ints: {e}") from e
        bad = [i for i in out if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        return out

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `ids` (an incomplete UTF-8 character at the end decodes to U+FFFD)."""
        return self._backend.decode(self._check_ids(ids), skip_special_tokens)

    def incremental_decoder(self, *, skip_special_tokens: bool = False) -> IncrementalDecoder:
        """A decoder for streaming: feed ids as they are generated, get the new text."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------- chat

    @property
    def chat_template(self) -> str | None:
        """The default chat template's jinja source (None without one)."""
        return self.chat_templates.get("default")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping],
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        tools: Sequence[Mapping] | None = None,
        documents: Sequence[Mapping] | None = None,
        chat_template: str | None = None,
        **template_kwargs,
    ) -> str | list[int]:
        """The conversation rendered by the checkpoint's chat template, as transformers does.

        Args:
          messages: [{"role": "user" | "assistant" | "system", "content": str}, ...].
          add_generation_prompt: end with the start of a model turn.
          tokenize: return token ids (the rendered text encoded without adding BOS, which
            the template writes) instead of the text. Unlike transformers, the text is the
            default.
          tools, documents: passed to the template (JSON-schema dicts).
          chat_template: a template name (of `chat_templates`) or a jinja source.
          **template_kwargs: further template variables (e.g. Gemma 4's enable_thinking);
            the special tokens (bos_token, eos_token, ...) are always defined.

        Raises:
          ValueError: no chat template, an empty or malformed conversation, or an error
            raised by the template (e.g. roles that do not alternate).
        """
        import jinja2

        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError(
                f"messages must be a list of {{'role', 'content'}} dicts, got "
                f"{type(messages).__name__}"
            )
        if not messages:
            raise ValueError("messages is empty: a conversation needs at least one message")
        for k, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ValueError(f"message {k} must be a dict with a 'role', got {m!r}")
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and not all(isinstance(v, Mapping) for v in value):
                raise ValueError(f"{name} must be a list of dicts (JSON schemas for tools)")
        source = self._template_source(chat_template)
        variables = {**self.special_tokens, **template_kwargs}
        try:
            text = _compile_chat_template(source).render(
                messages=[dict(m) for m in messages],
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None if documents is None else [dict(d) for d in documents],
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template raised an error: {e}") from e
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_source(self, chat_template: str | None) -> str:
        if chat_template is not None and chat_template in self.chat_templates:
            return self.chat_templates[chat_template]
        if chat_template is not None:
            return chat_template
        if not self.chat_templates:
            raise ValueError(
                f"no chat template in {str(self.path)!r} (looked for chat_template.jinja, "
                "chat_templates/ and tokenizer_config.json's chat_template)"
            )
        if "default" not in self.chat_templates:
            raise ValueError(
                f"several chat templates and no default in {str(self.path)!r}: pass one of "
                f"{sorted(self.chat_templates)} as chat_template"
            )
        return self.chat_templates["default"]


class IncrementalDecoder:
    """The text of a growing id sequence, piece by piece, for streaming.

    `feed(ids)` returns the text the new ids complete; text is held back while it ends
    inside a multi-byte character (decoded as U+FFFD), so no piece splits a character.
    The pieces of every `feed` and the final `flush()` concatenate to `decode(all ids)`
    whenever the byte pieces form valid UTF-8; emitted text is never revised (where invalid
    bytes follow a complete character, one-shot decoding turns the whole byte run into
    U+FFFD, the stream only the invalid part). Each `feed` decodes a window that starts at
    the previous emission, so it costs O(window), not O(sequence).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # the text of ids before this is emitted

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, hold_incomplete: bool) -> str:
        text = self._decode(self._ids[self._prefix :])
        if hold_incomplete and text.endswith(_REPLACEMENT):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        if text.startswith(prefix_text):
            new = text[len(prefix_text) :]
        else:  # the new ids changed how the window decodes; keep what was emitted
            new = self._decode(self._ids[self._read :])
        self._prefix, self._read = self._read, len(self._ids)
        return new

    def feed(self, ids: int | Iterable[int]) -> str:
        """Appends `ids` (one id or several); returns the newly completed text ('' if none)."""
        new = [ids] if isinstance(ids, int) else list(ids)
        self._ids.extend(self._tokenizer._check_ids(new))
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """The text still held back (a trailing incomplete character decodes to U+FFFD)."""
        return self._emit(hold_incomplete=False)


# --------------------------------------------------------------------------- loading


def _special_tokens(config: Mapping, config_file: Path) -> dict[str, str]:
    """Template variable -> token: the named tokens (Gemma defaults) and model-specific ones."""
    out = {}
    for key, default in _NAMED_TOKENS.items():
        value = _token_content(config.get(key, default), f"{str(config_file)!r}: {key}")
        if value is not None:
            out[key] = value
    for key, value in config.items():
        if key.endswith("_token") and key not in _NAMED_TOKENS and isinstance(value, str):
            out[key] = value
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            out[key] = _token_content(value, f"{str(config_file)!r}: extra_special_tokens.{key}")
    return out


def _extra_special_tokens(config: Mapping, config_file: Path) -> list[str]:
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    if isinstance(extra, Mapping):
        extra = list(extra.values())
    if not isinstance(extra, list):
        raise ValueError(
            f"{str(config_file)!r}: extra_special_tokens must be a list, got {type(extra).__name__}"
        )
    return [_token_content(t, f"{str(config_file)!r}: extra_special_tokens") for t in extra]


def _register_added_tokens(backend, config: Mapping, config_file: Path, special: Mapping) -> None:
    """Adds the config's added tokens and marks the special tokens, as transformers does."""
    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, Mapping):
        raise ValueError(f"{str(config_file)!r}: added_tokens_decoder must be an object")
    present = backend.added_tokens()
    for key, entry in sorted(declared.items(), key=lambda kv: int(kv[0])):
        where = f"{str(config_file)!r}: added_tokens_decoder[{key!r}]"
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"{where}: the key must be a token id") from None
        content = _token_content(entry, where)
        if content is None:
            raise ValueError(f"{where}: no token content")
        flags = entry if isinstance(entry, Mapping) else {}
        is_special = bool(flags.get("special", True))
        if present.get(token_id, (None,))[0] == content and present[token_id][1] == is_special:
            continue
        backend.add_token(content, special=is_special, flags=flags)
        got = backend.token_to_id(content)
        if got != token_id:
            raise ValueError(
                f"{where}: token {content!r} has id {got} in the vocabulary, not {token_id}"
            )
    present = backend.added_tokens()
    named = [t for k, t in special.items() if k != "sep_token" and k != "cls_token"]
    for token in dict.fromkeys([*named, *_extra_special_tokens(config, config_file)]):
        token_id = backend.token_to_id(token)
        if token_id is not None and present.get(token_id) != (token, True):
            backend.add_token(token, special=True, flags={})


def _generation_eos_ids(directory: Path) -> list[int]:
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    value = _read_json(path, "generation config").get("eos_token_id")
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{str(path)!r}: eos_token_id must be an int or a list of ints")
    return values


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer of a Gemma checkpoint directory (see the module docstring for the files).

    Raises:
      ValueError: no tokenizer.json / tokenizer.model, or a missing or malformed file
        (named in the message).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"no checkpoint directory at {str(directory)!r}")
    config_file = directory / "tokenizer_config.json"
    config = _read_json(config_file, "tokenizer config") if config_file.is_file() else {}
    special = _special_tokens(config, config_file)
    json_file, sp_file = directory / "tokenizer.json", directory / "tokenizer.model"
    if json_file.is_file():
        backend = _TokenizersBackend(json_file)
    elif sp_file.is_file():
        flags = {}
        for key in ("add_bos_token", "add_eos_token"):
            flags[key] = config.get(key, False)
            if not isinstance(flags[key], bool):
                raise ValueError(f"{str(config_file)!r}: {key} must be true or false")
        backend = _SentencePieceBackend(sp_file, flags["add_bos_token"], flags["add_eos_token"])
        backend.bos_id = backend.token_to_id(special.get("bos_token", ""))
        backend.eos_id = backend.token_to_id(special.get("eos_token", ""))
    else:
        raise ValueError(f"no tokenizer.json or tokenizer.model in {str(directory)!r}")
    _register_added_tokens(backend, config, config_file, special)
    return Tokenizer(
        backend,
        path=directory,
        special_tokens=special,
        chat_templates=_load_chat_templates(directory, config, config_file),
        generation_eos_ids=_generation_eos_ids(directory),
    )
