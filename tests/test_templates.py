"""Chat templates: variables are data, rendering is bounded (time, output, memory)
and isolated, chatml when the model has none, llama.cpp's built-in templates with
--no-jinja."""
from __future__ import annotations

import time

import pytest

from stepmtp.chat import CHATML_TEMPLATE, ChatTemplateError, render_chat, template_context
from stepmtp.chat.jinja_render import TemplateFailure, render
from stepmtp.chat.sandbox import TemplateSandbox

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]

#: nested loops that produce nothing: no output bound catches them, only a deadline
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


class FakeModel:
    """What render_chat reads from a model."""

    bos, eos = -1, -1
    chat_template = None

    def token_to_piece(self, tok, special=False):  # pragma: no cover - bos/eos are -1
        return b""


def test_variables_cannot_replace_the_template_or_the_messages():
    out = render_chat(FakeModel(), MSGS, variables={"template": SPIN, "messages": [], "bos_token": "EVIL"})
    assert out == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                   "<|im_start|>assistant\n")


def test_variables_reach_the_template():
    src = "{% if enable_thinking is defined and not enable_thinking %}NO{% endif %}{{ messages|length }}"
    assert render_chat(FakeModel(), MSGS, template=src, variables={"enable_thinking": False}) == "NO2"


def test_tools_as_one_string_and_the_date():
    """Templates written for llama.cpp's variables: firefunction takes the tools as a
    JSON string (``functions``) and today's date (``datetime``, '%b %d %Y')."""
    import datetime
    from pathlib import Path

    src = (Path(__file__).resolve().parents[1] / "vendor" / "llama.cpp" / "models" / "templates" /
           "fireworks-ai-llama-3-firefunction-v2.jinja").read_text()
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    out = render_chat(FakeModel(), MSGS[1:], template=src, variables={"tools": [tool]})
    assert '"name": "get_weather"' in out and datetime.date.today().strftime("%b %d %Y") in out
    assert "get_weather" not in render_chat(FakeModel(), MSGS[1:], template=src)


def test_chatml_fallback_matches_llama_server():
    ctx = template_context(FakeModel(), MSGS, add_generation_prompt=False)
    assert render(CHATML_TEMPLATE, ctx) == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_tojson_is_not_html_escaped():
    # llama.cpp's templates engine writes tool schemas as plain JSON, '<' and '&' included
    assert render("{{ x|tojson }}", {"x": {"a": "<b>&"}}) == '{"a": "<b>&"}'


def test_output_bound():
    with pytest.raises(TemplateFailure, match="exceeds 100 characters"):
        render("{% for i in range(1000) %}xxxxxxxxxx{% endfor %}", {}, max_chars=100)


@pytest.fixture(scope="module")
def sandbox():
    sb = TemplateSandbox(n_workers=2, timeout=1.5, max_chars=10_000, max_memory=512 << 20)
    yield sb
    sb.close()


def test_sandbox_renders(sandbox):
    assert sandbox.render("{{ a }}-{{ b|tojson }}", {"a": 1, "b": [1, "x"]}) == '1-[1, "x"]'


def test_sandbox_stops_a_template_that_never_ends(sandbox):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="longer than 1.5 s"):
        sandbox.render(SPIN, {})
    assert time.monotonic() - t0 < 5
    assert sandbox.render("ok", {}) == "ok"  # a fresh worker took its place


def test_sandbox_bounds_output_and_memory(sandbox):
    with pytest.raises(ChatTemplateError, match="exceeds 10000 characters"):
        sandbox.render("{% for i in range(100000) %}abc{% endfor %}", {})
    # one string far past the worker's address space: its MemoryError, not the server's
    with pytest.raises(ChatTemplateError, match="memory"):
        sandbox.render("{{ 'x'.ljust(2000000000) }}", {})
    assert sandbox.render("{{ 1 + 1 }}", {}) == "2"


def test_sandbox_template_errors(sandbox):
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        sandbox.render("{% for %}", {})
    with pytest.raises(ChatTemplateError, match="no tools here"):
        sandbox.render("{{ raise_exception('no tools here') }}", {})
    with pytest.raises(ChatTemplateError, match="unsafe|access"):
        sandbox.render("{{ ''.__class__.__mro__ }}", {})


def test_the_templates_bos_goes_when_tokenizing_adds_one():
    """Step-3.5-Flash's template writes the BOS and its vocabulary adds one too: as in
    llama.cpp, the rendered prompt leaves it out, so the tokens start with one BOS
    (two made every chat prompt a token longer than llama-server's, and its text other)."""
    from stepmtp.llama import Model
    from stepmtp.models import default_model_path

    m = Model(default_model_path())
    try:
        bos = m.token_to_piece(m.bos, special=True).decode()
        assert m.add_bos and "bos_token" in m.chat_template
        text = render_chat(m, MSGS)
        assert text.startswith("<|im_start|>system\nbe brief") and not text.startswith(bos)
        toks = m.tokenize(text, add_special=True, parse_special=True)
        assert toks[0] == m.bos and toks[1] != m.bos
    finally:
        m.close()


def test_user_turn_start():
    """Where a chat prompt's latest user message opens (llama-server's n_before_user)."""
    from stepmtp.chat import user_turn_start
    from stepmtp.llama import Model
    from stepmtp.models import default_model_path

    assert user_turn_start(FakeModel()) == "<|im_start|>user\n"  # chatml
    assert user_turn_start(FakeModel(), "{{ raise_exception('no') }}") == ""
    m = Model(default_model_path())
    try:
        start = user_turn_start(m)
        assert start.startswith("<|im_start|>user")
        msgs = MSGS + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        text = render_chat(m, msgs)
        assert text[text.rfind(start):].startswith(start + "more")
    finally:
        m.close()


#: llama-server's /props chat_template_caps for these templates (llama.cpp's own, in the
#: vendored tree), read from the C++ server built here: the capabilities set
LLAMA_SERVER_CAPS = {
    "stepfun-ai-Step-3.5-Flash": {"object_arguments", "parallel_tool_calls", "preserve_reasoning",
                                  "string_content", "system_role", "tool_calls", "tools"},
    "google-gemma-2-2b-it": {"string_content"},  # raises on a system message
    "meta-llama-Llama-3.1-8B-Instruct": {"object_arguments", "string_content", "system_role", "tool_calls",
                                         "tools"},
    "mistralai-Mistral-Nemo-Instruct-2407": {"object_arguments", "parallel_tool_calls", "string_content",
                                             "system_role", "tool_calls", "tools"},
    "microsoft-Phi-3.5-mini-instruct": {"string_content", "system_role"},
}


@pytest.mark.parametrize("name", sorted(LLAMA_SERVER_CAPS))
def test_template_caps_are_llama_servers(name, sandbox):
    """/props chat_template_caps: probe conversations rendered, and what the template
    read of them, as llama.cpp decides (in-process and in the sandbox alike)."""
    from pathlib import Path

    import stepmtp.chat as chat

    path = Path(__file__).resolve().parents[1] / "vendor/llama.cpp/models/templates" / f"{name}.jinja"
    if not path.is_file():
        pytest.skip("the vendored llama.cpp tree is not here")
    src = path.read_text()
    got = {k.removeprefix("supports_") for k, v in chat.template_caps(FakeModel(), src).items() if v}
    assert got == LLAMA_SERVER_CAPS[name]
    chat._caps.clear()
    got = {k.removeprefix("supports_") for k, v in chat.template_caps(FakeModel(), src, sandbox=sandbox).items() if v}
    assert got == LLAMA_SERVER_CAPS[name]
    chat._caps.clear()
