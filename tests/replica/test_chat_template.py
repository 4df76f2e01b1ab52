"""`--chat-template` (replica/engine/chat_template.py): a file or the template itself, read
and parsed where the flag is read; the offline LLM renders with it, and with a call's
`chat_template_kwargs`."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fleetserve.replica.engine.chat_template import check_template_kwargs, read_chat_template
from fleetserve.replica.engine.engine_args import EngineArgs

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}{% if mood is defined %} ({{ mood }}){% endif %}"
)


def test_a_file_is_read_and_text_is_taken_as_it_is(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE
    assert EngineArgs(chat_template=str(path)).chat_template == TEMPLATE  # the text travels
    assert EngineArgs(chat_template=TEMPLATE).chat_template == TEMPLATE  # and re-validates as is
    assert read_chat_template(None) is None


@pytest.mark.parametrize(
    "value, says",
    [
        ("no/such/file.jinja", "neither a file nor a Jinja template"),
        ("{% for m in messages %}{{ m }}", "not a valid Jinja template"),
        ("   ", "empty"),
    ],
)
def test_what_is_neither_is_refused_with_the_reason(value, says):
    with pytest.raises(ValueError, match=says):
        read_chat_template(value)
    with pytest.raises(ValidationError, match=says):
        EngineArgs(chat_template=value)


def test_a_broken_template_file_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(ValueError, match=r"broken.jinja is not a valid Jinja template: .*\(line 2\)"):
        read_chat_template(str(path))


def test_reserved_kwargs_are_refused():
    assert check_template_kwargs(None) == {} and check_template_kwargs({"enable_thinking": False}) == {
        "enable_thinking": False
    }
    with pytest.raises(ValueError, match="may not set messages, tools"):
        check_template_kwargs({"tools": [], "messages": [], "x": 1})


def test_llm_chat_renders_with_the_configured_template_and_kwargs(tmp_path):
    from fleetserve import LLM, SamplingParams
    from fleetserve.replica.testing import make_tiny_llama

    llm = LLM(
        str(make_tiny_llama(tmp_path / "tiny")),
        chat_template=TEMPLATE,
        max_model_len=128,
        num_gpu_blocks_override=16,
        num_threads=1,
    )
    conv = [{"role": "user", "content": "hi"}]
    sp = SamplingParams(max_tokens=1, temperature=0)
    assert llm.chat(conv, sp, use_tqdm=False)[0].prompt == "[user] hi\n[assistant]"
    out = llm.chat(conv, sp, use_tqdm=False, chat_template_kwargs={"mood": "calm"})[0]
    assert out.prompt == "[user] hi\n[assistant] (calm)"
    with pytest.raises(ValueError, match="may not set"):
        llm.chat(conv, sp, use_tqdm=False, chat_template_kwargs={"messages": []})
    # continue_final_message: the last message is left open (and needs no generation prompt).
    prefilled = conv + [{"role": "assistant", "content": "Hello"}]
    out = llm.chat(prefilled, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("[assistant] Hello") and not out.prompt.endswith("\n"), out.prompt
    with pytest.raises(ValueError, match="continue_final_message cannot be combined"):
        llm.chat(prefilled, sp, use_tqdm=False, continue_final_message=True)
