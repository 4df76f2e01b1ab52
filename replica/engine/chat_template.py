"""`--chat-template`, as vLLM's: a Jinja chat template given as a file path or as the template
text itself. The file is read where the flag is read (the CLI, the app config), so the text
travels with the config to replicas on other machines that lack the file, and a template
with a syntax error is refused there, before anything starts.

Only jinja2 (no torch, no transformers): the CLI validates it in milliseconds.
"""

from __future__ import annotations

import os
from typing import Optional

# A model's chat template renders these itself; a request's `chat_template_kwargs` may not
# replace them (vLLM drops them; we say so).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "chat_template",
        "tokenizer",
    }
)


def check_continue_final_message(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule: a reply is either started (the generation prompt) or continued, not both."""
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message cannot be combined with add_generation_prompt=true "
            "(the default): set add_generation_prompt to false to continue the last message"
        )


def read_chat_template(value: Optional[str]) -> Optional[str]:
    """The template text of `value` (a path to a file, or the template itself); ValueError
    with the reason when it is neither or does not parse."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError("chat_template must be a file path or a Jinja template, got an empty value")
    looks_inline = "{{" in value or "{%" in value or "\n" in value  # (paths have no newline)
    if not looks_inline:
        path = os.path.expanduser(value)
        if not os.path.isfile(path):
            raise ValueError(
                f"chat_template {value!r} is neither a file nor a Jinja template "
                "(a template has {{ ... }} or {% ... %})"
            )
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template file {path}: {e}") from None
        where = f"chat_template file {path}"
    else:
        where = "chat_template"
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    try:
        env.parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where} is not a valid Jinja template: {e.message} (line {e.lineno})") from None
    return value


def check_template_kwargs(kwargs: Optional[dict]) -> dict:
    """A request's `chat_template_kwargs`: extra variables for the template (e.g. Qwen3's
    `enable_thinking`); ValueError naming any that would replace the template's own."""
    if not kwargs:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs must be an object of template variables")
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}: the request's own fields set them")
    return dict(kwargs)
