"""Observations as token ids: token in, token out.

What the model sampled is never decoded and re-encoded (a round trip can merge or split
tokens, and the trainer would then score tokens the model never chose). Only the
environment's observation is turned into tokens, appended after the sampled ones:

- text is encoded with ``add_special_tokens=False`` (no BOS in the middle of an episode);
- chat messages become the delta the chat template adds for them: the template renders a
  dummy conversation ending in an assistant turn, then the same with the messages (and the
  next assistant turn's header) appended, and the suffix is the delta. Where the sampled
  turn did not end with the template's end-of-turn tokens (it stopped at a stop string),
  those are prepended, so the episode reads as the template would have rendered it;
- token ids are used as they are.

That the delta is what the template itself renders holds only for a template that renders
a conversation turn by turn as a prefix of the next; :func:`check_prefix_preserving`
checks that once at start-up and refuses a model whose template does not (one that
strips earlier turns' reasoning, say).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sampler_service.environments.base import Observation

_DUMMY = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]


class NotPrefixPreserving(ValueError):
    """A chat template rewrites earlier turns when a turn is added."""


def message_text(message: dict[str, Any]) -> str:
    """A chat message's text: its content, or the text parts of a content list (OpenAI's
    ``[{"type": "text", "text": ...}]``) joined; no content is no text."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    raise ValueError(f"a message's content must be text or a list of parts, got {content!r:.80}")


class ObservationRenderer:
    """Renders observations into token ids for one tokenizer (and its chat template)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._dummy: tuple[list[int], list[int]] | None = None

    @property
    def templated(self) -> bool:
        """Whether the tokenizer has a chat template (chat messages can be rendered)."""
        return bool(getattr(self._tokenizer, "chat_template", None))

    def encode_prompt(self, text: str) -> list[int]:
        """``text`` as a text prompt's ids, with the special tokens the tokenizer adds at
        the start of a sequence (as a text row is encoded)."""
        return list(self._tokenizer(text, verbose=False)["input_ids"])

    def chat_text(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        generation: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The template's rendering of ``messages`` (and the tools' schemas, where the
        template renders them), as text."""
        if not self.templated:
            raise ValueError("chat messages need a tokenizer with a chat template")
        return str(
            self._tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=generation,
                tokenize=False,
            )
        )

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, generation: bool) -> list[int]:
        """The template's rendering of ``messages``, as token ids."""
        return self.encode(self.chat_text(messages, generation=generation))

    def encode(self, text: str) -> list[int]:
        """``text`` as token ids, without the special tokens a tokenizer adds at the start
        of a sequence (a rendered template has its own)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def dummy_turn(self) -> tuple[list[int], list[int]]:
        """The dummy conversation's ids and its assistant turn's end-of-turn ids."""
        if self._dummy is None:
            rendered = self.encode_chat(_DUMMY, generation=False)
            opened = self.encode_chat(_DUMMY[:1], generation=True)
            content = self._tokenizer.encode(_DUMMY[1]["content"], add_special_tokens=False)
            head = opened + content
            if rendered[: len(head)] != head:
                raise NotPrefixPreserving(
                    "the chat template does not render an assistant turn as the generation "
                    "prompt followed by the sampled content"
                )
            self._dummy = (rendered, rendered[len(head) :])
        return self._dummy

    def chat_delta(self, messages: Sequence[dict[str, Any]], *, turn: Sequence[int]) -> list[int]:
        """The ids that append ``messages`` (and open the next assistant turn) after ``turn``.

        ``turn`` is the sampled turn's ids; the template's end-of-turn ids it lacks (all of
        them after a stop string, the newline after an end-of-turn token) come first.
        """
        rendered, end_of_turn = self.dummy_turn()
        full = self.encode_chat([*_DUMMY, *messages], generation=True)
        if full[: len(rendered)] != rendered:
            raise NotPrefixPreserving("the chat template rewrites the turns before an observation")
        have = next(
            n
            for n in range(len(end_of_turn), -1, -1)
            if n == 0 or list(turn[-n:]) == end_of_turn[:n]
        )
        return end_of_turn[have:] + full[len(rendered) :]

    def render(
        self, observation: Observation, *, turn: Sequence[int] = (), max_tokens: int | None = None
    ) -> list[int]:
        """The token ids of ``observation``, cut to the first ``max_tokens`` (None: all)."""
        if isinstance(observation, str):
            ids = self.encode(observation)
        elif all(isinstance(item, int) for item in observation):
            ids = [int(item) for item in observation]  # type: ignore[arg-type]
        else:
            ids = self.chat_delta(observation, turn=turn)  # type: ignore[arg-type]
        return ids if max_tokens is None else ids[:max_tokens]


#: A conversation with what templates tend to treat specially: a system prompt, reasoning,
#: a tool call and its result, and a second user turn after reasoning.
_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 6 times 7?"},
    {
        "role": "assistant",
        "content": '<think>use the tool</think><tool_call>{"name": "mul", '
        '"arguments": {"a": 6, "b": 7}}</tool_call>',
    },
    {"role": "tool", "name": "mul", "content": "42"},
    {"role": "assistant", "content": "<think>copy it</think>42"},
    {"role": "user", "content": "And 6 plus 7?"},
    {"role": "assistant", "content": "13"},
]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def check_prefix_preserving(tokenizer: Any, model: str) -> None:
    """Refuse (NotPrefixPreserving naming ``model``) a chat template episodes cannot use.

    For every k, the rendering of the first k messages must be a prefix of the rendering
    of the first k+1, and after each assistant turn the renderer's delta for the messages
    that follow must give exactly the template's rendering, whether the turn ended with
    the end-of-turn tokens or at a stop string. A tokenizer without a chat template has
    nothing to check (its observations are text or token ids).
    """
    if not getattr(tokenizer, "chat_template", None):
        return
    renderer = ObservationRenderer(tokenizer)

    def refuse(detail: str) -> NotPrefixPreserving:
        return NotPrefixPreserving(
            f"model {model!r}: its chat template is not prefix-preserving turn by turn, so "
            f"an episode's earlier tokens would not be what the template renders: {detail}"
        )

    try:
        _, end_of_turn = renderer.dummy_turn()
    except NotPrefixPreserving as exc:
        raise refuse(str(exc)) from exc
    convo = _CONVERSATION
    for k in range(1, len(convo)):
        before = renderer.encode_chat(convo[:k], generation=False)
        after = renderer.encode_chat(convo[: k + 1], generation=False)
        if after[: len(before)] != before:
            i = _first_difference(before, after)
            raise refuse(
                f"adding message {k + 1} ({convo[k]['role']}) changes the rendering at token "
                f"{i}: {tokenizer.decode(before[i : i + 12])!r} became "
                f"{tokenizer.decode(after[i : i + 12])!r}"
            )
        if convo[k - 1]["role"] != "assistant" or convo[k]["role"] == "assistant":
            continue
        end = next(j for j in range(k, len(convo)) if convo[j]["role"] == "assistant")
        expected = renderer.encode_chat(convo[:end], generation=True)
        stopped = before[: len(before) - len(end_of_turn)]
        for turn in (before, stopped):
            if turn + renderer.chat_delta(convo[k:end], turn=turn) != expected:
                raise refuse(
                    f"the delta for messages {k + 1}-{end} is not what the template renders"
                )
