"""Text in, text out: `generate_text` turns strings or chat conversations into generated text.

A prompt is a string (encoded with the tokenizer's BOS rule) or a conversation, a list of
`{"role", "content"}` messages rendered by the checkpoint's chat template with the start of a
model turn (`chat=True` makes a string one user message). Generation stops at the tokenizer's
stop ids (EOS and end of turn, `tokenizer.eos_token_ids`) or after `max_new_tokens`.

The tokenizer is duck-typed (`gemma.Tokenizer`: `encode`, `decode`, `apply_chat_template`,
`incremental_decoder`, `eos_token_ids`, `vocab_size`), so this module imports no model code.

Text of a request: its generated ids without the stop token that ended it, decoded with
`skip_special_tokens` (default True, as Hugging Face pipelines and vLLM do); ids the tokenizer
does not know (a model vocabulary padded past the tokenizer's) have no text. Streaming decodes
each request incrementally (`tokenizer.incremental_decoder()`), so no piece splits a multi-byte
character, and the pieces of a request concatenate to its non-streamed text.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence

from swajax import _validate
from swajax._engine import Engine, RequestOutput
from swajax._engine_config import EngineConfig
from swajax._generate import cached_engine, validate_prompts
from swajax._sampling import SamplingParams, check_seed


@dataclasses.dataclass(frozen=True)
class TextOutput:
    """One request's result.

    text: the generated text (without the stop token); token_ids: the generated ids, the stop
    token included as the last one when finish_reason is "stop" (as `swajax.generate` returns
    them); finish_reason: "stop" (a stop id) or "length" (max_new_tokens); prompt_token_ids:
    the ids the prompt was encoded to.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TextChunk:
    """A streamed piece of one request's text.

    index: the prompt's position; text: the new text ('' while a character is incomplete);
    token_ids: the ids generated since the request's previous chunk; finished / finish_reason:
    as `TextOutput` once the request is done (its last chunk), else False / None.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


def _is_conversation(prompt) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (str, bytes))
        and len(prompt) > 0
        and all(isinstance(m, Mapping) for m in prompt)
    )


def encode_prompt(
    tokenizer,
    prompt,
    *,
    chat: bool | None = None,
    chat_template_kwargs: Mapping | None = None,
    name: str = "prompt",
) -> list[int]:
    """Token ids of one prompt.

    prompt: a string, or a conversation (a list of {"role", "content"} dicts). A string is
    encoded as text (BOS as the tokenizer adds it) unless chat=True, which makes it one user
    message; a conversation is rendered by the chat template with `add_generation_prompt=True`
    and `chat_template_kwargs` (chat=False with a conversation is an error).
    ValueError naming `name` for anything else, or when the template fails.
    """
    if isinstance(prompt, str):
        _validate.unicode_text(name, prompt)
        if not chat:
            return list(tokenizer.encode(prompt))
        prompt = [{"role": "user", "content": prompt}]
    elif not _is_conversation(prompt):
        raise ValueError(
            f"{name} must be a string or a non-empty list of {{'role', 'content'}} messages, "
            f"got {_describe(prompt)}"
        )
    elif chat is False:
        raise ValueError(f"{name} is a conversation but chat=False; use chat=None or True")
    for k, m in enumerate(prompt):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(
                f"{name}: message {k} needs a string 'role' and a string 'content', got {m!r}"
            )
        _validate.unicode_text(f"{name}: message {k} role", m["role"])
        _validate.unicode_text(f"{name}: message {k} content", m["content"])
    try:
        return list(
            tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
            )
        )
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


def _describe(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else f"{type(x).__name__} {text[:77]}..."


def _text_ids(tokenizer, ids: Sequence[int], finish_reason: str | None) -> list[int]:
    """The ids that make the text: without the stop token, without ids the tokenizer lacks."""
    if finish_reason == "stop":
        ids = ids[:-1]
    known = tokenizer.vocab_size
    return [t for t in ids if t < known]


def text_of(tokenizer, token_ids, finish_reason, *, skip_special_tokens: bool = True) -> str:
    """The text of a request's generated ids (module docstring)."""
    ids = _text_ids(tokenizer, list(token_ids), finish_reason)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def text_chunks(
    tokenizer,
    outputs: Iterable[tuple[int, RequestOutput]],
    *,
    skip_special_tokens: bool = True,
) -> Iterator[TextChunk]:
    """(index, RequestOutput) pairs, as `Engine.stream` yields them, as text pieces."""
    decoders = {}
    for index, out in outputs:
        decoder = decoders.get(index)
        if decoder is None:
            decoder = decoders[index] = tokenizer.incremental_decoder(
                skip_special_tokens=skip_special_tokens
            )
        reason = out.finish_reason if out.finished else None
        ids = _text_ids(tokenizer, out.new_token_ids, reason)
        text = decoder.feed(ids) if ids else ""
        if out.finished:
            text += decoder.flush()
            del decoders[index]
        yield TextChunk(index, text, out.new_token_ids, out.finished, reason)


def stream_requests_text(
    engine: Engine,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    sampling: Sequence[SamplingParams],
    *,
    stop_token_ids=None,
    skip_special_tokens: bool = True,
) -> Iterator[tuple[int, TextOutput]]:
    """Serves requests with their own max_new_tokens and sampling; yields (index, TextOutput)
    as each finishes (completion order).

    Each request goes through `Engine.add_request`, so its PRNG key comes from its
    `sampling.seed` alone (not from its position or the other requests): a request draws the
    same tokens whichever requests it is served with. Stop ids default to the tokenizer's.
    Closing the generator, or an exception, aborts the requests not yet finished.
    """
    if not len(prompts) == len(max_new_tokens) == len(sampling):
        raise ValueError(
            f"prompts, max_new_tokens and sampling differ in length: {len(prompts)}, "
            f"{len(max_new_tokens)}, {len(sampling)}"
        )
    stop = tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids
    ids: list[int] = []
    try:
        for p, n, s in zip(prompts, max_new_tokens, sampling, strict=True):
            ids.append(engine.add_request(p, n, s, stop_token_ids=stop))
    except BaseException:
        if ids:
            engine.abort(ids)
        raise
    index = {rid: i for i, rid in enumerate(ids)}
    with contextlib.closing(engine.stream_requests(ids)) as outputs:
        for out in outputs:
            if out.finished:
                yield (
                    index[out.request_id],
                    TextOutput(
                        text_of(
                            tokenizer,
                            out.token_ids,
                            out.finish_reason,
                            skip_special_tokens=skip_special_tokens,
                        ),
                        out.token_ids,
                        out.finish_reason,
                        tuple(prompts[index[out.request_id]]),
                    ),
                )


def generate_text(
    model,
    tokenizer,
    prompts,
    max_new_tokens: int,
    *,
    stream: bool = False,
    chat: bool | None = None,
    chat_template_kwargs: Mapping | None = None,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    stop_token_ids=None,
    skip_special_tokens: bool = True,
    config: EngineConfig | None = None,
    **settings,
) -> list[TextOutput] | Iterator[TextChunk]:
    """Generates text for each prompt on the paged KV cache (`swajax.generate` on text).

    Args:
      model: e.g. a `gemma.Transformer`.
      tokenizer: the checkpoint's tokenizer (`gemma.load_tokenizer(path)`).
      prompts: a list of prompts, each a string or a conversation (a list of
        {"role", "content"} messages); a single string or conversation is one prompt.
      max_new_tokens: tokens generated per prompt at most.
      stream: return an iterator of `TextChunk`s, the pieces of every request as they are
        generated (requests interleaved; `chunk.index` says whose), instead of the list.
      chat: True: strings are user messages of a chat; False: no chat template; None:
        conversations use the chat template, strings do not.
      chat_template_kwargs: extra template variables (e.g. Gemma 4's enable_thinking).
      sampling, seed: as `swajax.generate` (greedy by default; prompt i draws from a key of
        (seed, i)), so the tokens equal `swajax.generate`'s for the same prompt ids.
      stop_token_ids: ids that end a request (default: `tokenizer.eos_token_ids`, EOS and end
        of turn).
      skip_special_tokens: leave special tokens out of the text (default True).
      config, **settings: the `EngineConfig`, as `swajax.generate` (the same kept engine
        serves both).

    Returns:
      One `TextOutput` per prompt, in order; with stream=True an iterator of `TextChunk`s.
      Bad prompts raise ValueError before anything runs (with stream=True too).
    """
    ids = _encode_prompts(tokenizer, prompts, chat, chat_template_kwargs)
    max_new_tokens = _validate.positive_int("max_new_tokens", max_new_tokens)
    model_config = model.config
    ids = validate_prompts(ids, model_config.vocab_size, model_config.max_context, max_new_tokens)
    stop = tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids
    # Checked here as the engine would, so that stream=True raises before returning.
    stop = _validate.token_ids("stop_token_ids", stop, model_config.vocab_size)
    seed = check_seed(seed)
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    engine = cached_engine(
        model, [len(p) + max_new_tokens for p in ids], EngineConfig.of(config, **settings)
    )
    for i, p in enumerate(ids):
        try:
            engine.check_fits(len(p), max_new_tokens)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from e
    outputs = engine.stream(ids, max_new_tokens, sampling=sampling, seed=seed, stop_token_ids=stop)
    if stream:
        return text_chunks(tokenizer, outputs, skip_special_tokens=skip_special_tokens)
    results: list[TextOutput | None] = [None] * len(ids)
    with contextlib.closing(outputs):
        for i, out in outputs:
            if out.finished:
                text = text_of(
                    tokenizer,
                    out.token_ids,
                    out.finish_reason,
                    skip_special_tokens=skip_special_tokens,
                )
                results[i] = TextOutput(text, out.token_ids, out.finish_reason, tuple(ids[i]))
    return results


def _encode_prompts(tokenizer, prompts, chat, chat_template_kwargs) -> list[list[int]]:
    """The token ids of `generate_text`'s prompts (one string or conversation is one prompt);
    ValueError naming the prompt for a bad one."""
    if isinstance(prompts, str) or _is_conversation(prompts):
        prompts = [prompts]
    if isinstance(prompts, (bytes, Mapping)) or not isinstance(prompts, Iterable):
        raise ValueError(
            "prompts must be a list of strings or conversations, got " + _describe(prompts)
        )
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one string or conversation")
    return [
        encode_prompt(
            tokenizer, p, chat=chat, chat_template_kwargs=chat_template_kwargs, name=f"prompt {i}"
        )
        for i, p in enumerate(prompts)
    ]
