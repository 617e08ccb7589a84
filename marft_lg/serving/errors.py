"""Errors of the serving layer. Each message says what was wrong and what to do about it.

The OpenAI-compatible server maps them to HTTP codes: `ContextLengthError` and `AdapterMismatchError`
-> 400, `UnknownAgentError` -> 404.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base class of every error raised by `marft_lg.serving`."""


class ContextLengthError(ServingError, ValueError):
    """A prompt (plus the tokens asked for) does not fit the model's context; nothing is truncated."""

    def __init__(self, prompt_tokens: int | None, max_tokens: int, max_context: int, agent: str | None = None, *,
                 prompt_chars: int | None = None, chars_per_token: int | None = None):
        self.prompt_tokens, self.max_tokens, self.max_context = prompt_tokens, max_tokens, max_context
        self.prompt_chars = prompt_chars
        who = f" for agent {agent!r}" if agent else ""
        if max_tokens >= max_context:  # the completion alone cannot fit, whatever the prompt
            super().__init__(
                f"this model's maximum context length is {max_context} tokens, but the request{who} asks for "
                f"max_tokens={max_tokens}, which leaves no room for a prompt; lower max_tokens below {max_context}"
            )
            return
        if prompt_tokens is None:  # refused from its length in characters, before tokenizing
            super().__init__(
                f"this model's maximum context length is {max_context} tokens, but the request{who} has "
                f"{prompt_chars} characters of messages: more than the {max_context - max_tokens} prompt tokens left "
                f"beside max_tokens={max_tokens} can hold (no token is longer than {chars_per_token} characters); "
                f"shorten the messages or lower max_tokens"
            )
            return
        super().__init__(
            f"this model's maximum context length is {max_context} tokens, but the request{who} has "
            f"{prompt_tokens} prompt tokens and asks for {max_tokens} more ({prompt_tokens + max_tokens}); "
            f"shorten the messages or lower max_tokens"
        )


class UnknownAgentError(ServingError, KeyError):
    """A role, version or adapter name the engine does not serve; the message lists the known ones."""

    def __init__(self, name: str, known: list[str], what: str = "agent"):
        self.name, self.known = name, sorted(known)
        super().__init__(f"unknown {what} {name!r}; known: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class AdapterMismatchError(ServingError, ValueError):
    """An adapter trained for another base model (fingerprints differ), or not a safe PEFT directory."""


class RegistryError(ServingError, ValueError):
    """A bad registry request: unknown version or alias, unsafe name, or a corrupt version directory."""


class AdapterIntegrityError(AdapterMismatchError):
    """An adapter whose files are damaged (truncated, altered since it was saved, or not fitting the base
    model); nothing was loaded. `file` is the offending file, `reason` what is wrong with it."""

    def __init__(self, file: object, reason: str):
        self.file, self.reason = str(file), reason
        super().__init__(f"damaged adapter file {self.file}: {reason}")


class AliasConflictError(RegistryError):
    """An alias changed between the moment a command read it and the moment it wrote it (compare-and-swap)."""
