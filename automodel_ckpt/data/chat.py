"""Chat ``messages`` rendered with the tokenizer's chat template, with the character spans that carry the loss."""

from __future__ import annotations

from typing import Any

from automodel_ckpt.errors import ConfigError

CHAT_LOSS_MODES = ("assistant", "last", "all")
_PROBE = "\u2063reply\u2063"  # an assistant reply no real conversation contains
ROLES = ("system", "user", "assistant", "tool")


def resolve_chat_template(tokenizer: Any, override: str | None) -> str:
    """The Jinja template to use: ``tokenizer.chat_template`` from the recipe, else the tokenizer's own."""
    template = override or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        raise ConfigError(
            "tokenizer.chat_template: the tokenizer has no chat template, so 'messages' data cannot be rendered; "
            "set tokenizer.chat_template to a Jinja template (see docs/data.md) or use a tokenizer that has one")
    return template


class ChatRenderer:
    """Renders conversations and finds the trained characters: each assistant reply and its end-of-turn marker."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None, loss: str = "assistant") -> None:
        if loss not in CHAT_LOSS_MODES:
            raise ConfigError(f"data.chat_loss: expected one of {', '.join(CHAT_LOSS_MODES)}, got '{loss}'")
        self.template = resolve_chat_template(tokenizer, chat_template)
        self.loss = loss
        self.kwargs = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        self._header, self._end_of_turn = self._probe()

    def _probe(self) -> tuple[str, str] | tuple[None, None]:
        """What the template writes before a reply and after it; with both, one rendering finds every reply."""
        user = [{"role": "user", "content": "ping"}]
        try:
            asked = self._render(user)
            prompted = self._render(user, add_generation_prompt=True)
            answered = self._render(user + [{"role": "assistant", "content": _PROBE}])
        except Exception:  # noqa: BLE001 - a template that needs more than this probe gives: render turn by turn
            return None, None
        if not prompted.startswith(asked) or not answered.startswith(prompted + _PROBE):
            return None, None
        return prompted[len(asked):], answered[len(prompted) + len(_PROBE):]

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.template,
                                            add_generation_prompt=add_generation_prompt, **self.kwargs)
        return rendered[0]

    def render(self, messages: Any, record_number: int, field: str = "messages") -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the rendered conversation and the ``[start, end)`` character spans to train on."""
        messages = _check_messages(messages, record_number, field)
        try:
            text = self._render(messages)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the template's own error, said in one line
            raise ConfigError(f"dataset: record {record_number}: the chat template failed: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        if self.loss == "all":
            return text, [(0, len(text))]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.loss == "last":
            turns = turns[-1:]
        found = self._find_spans(text, messages, set(turns))
        if found is not None:
            return text, found
        spans = []
        for i in turns:
            start = len(self._prefix(messages[:i], True, text, record_number))
            end = len(self._prefix(messages[: i + 1], False, text, record_number))
            if end > start:
                spans.append((start, end))
        return text, spans

    def _find_spans(self, text: str, messages: list[dict], turns: set[int]) -> list[tuple[int, int]] | None:
        """Spans from one rendering (each reply between the generation prompt and the end of turn), else None."""
        if self._header is None or self._end_of_turn is None:
            return None
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            content = m.get("content")
            if not isinstance(content, str) or not content:
                if i in turns:
                    return None
                continue
            pos = text.find(content, cursor)
            h = self._header
            while i in turns and pos >= 0 and not (pos >= len(h) and text.startswith(h, pos - len(h))):
                pos = text.find(content, pos + 1)
            if pos < 0:
                return None
            end = pos + len(content)
            if i in turns:
                if not text.startswith(self._end_of_turn, end):
                    return None
                spans.append((pos, end + len(self._end_of_turn)))
            cursor = end
        return spans

    def _prefix(self, messages: list[dict], generation_prompt: bool, full: str, record_number: int) -> str:
        prefix = self._render(messages, add_generation_prompt=generation_prompt) if messages or generation_prompt \
            else ""
        if not full.startswith(prefix):  # a template that renders the last turn differently (reasoning dropped)
            raise ConfigError(
                f"dataset: record {record_number}: the chat template does not render the conversation's first "
                f"{len(messages)} message(s) as a prefix of the whole, so the assistant turns cannot be located; "
                "set data.chat_loss: all, or set tokenizer.chat_template to a template that does")
        return prefix


def _check_messages(messages: Any, record_number: int, field: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"dataset: record {record_number}: '{field}' must be a non-empty list of "
                          "{role, content} messages")
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ConfigError(f"dataset: record {record_number}: message {n} of '{field}' has no 'role'")
        if m["role"] not in ROLES:
            raise ConfigError(f"dataset: record {record_number}: message {n} has role '{m['role']}' "
                              f"(expected one of {', '.join(ROLES)})")
        # Arrow stores absent keys of a struct column as None; the templates test for absence.
        out.append({k: v for k, v in m.items() if v is not None})
    return out
