"""A chat tokenizer built here, no hub: one token per character, ChatML templates.

Shared by the renderer's unit tests, the episode runner's chat test and the start-up
check's test, which need a tokenizer with a chat template the toy model's lacks.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

#: Qwen2.5's ChatML shape: tools' schemas in the system turn (after the row's own system
#: prompt, if any), a tool result as a user turn wrapped in <tool_response>.
CHATML = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m.role == 'system' %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: The same, but an assistant turn that is not the last loses its reasoning (as templates
#: that strip earlier <think> blocks do): the earlier turns' tokens change.
STRIPPING = CHATML.replace(
    "{{ m.content }}<|im_end|>",
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>",
)


def char_tokenizer(template: str | None) -> PreTrainedTokenizerFast:
    """One token per printable character or newline, ChatML's two markers as special tokens."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(["<unk>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = template
    return fast


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def rendered(tok: PreTrainedTokenizerFast, messages: list, tools: list | None) -> list[int]:
    """The ids of the template's rendering of `messages` with `tools`, ready for the
    assistant's turn: what a conversation's first (or next) turn is sent."""
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return encode(tok, text)
