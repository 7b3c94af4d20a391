"""Chat templates: one render + one tokenization gives the tokens of the tokenizer's
own ``apply_chat_template(tokenize=True)`` and where each message starts; safe to call
from many threads at once."""

from __future__ import annotations

import threading

import pytest

from promptcache.engine.formats.templates import ChatTemplate, content_spans
from promptcache.engine.models.loader import load_model
from promptcache.errors import RequestError


@pytest.fixture(scope="module")
def tok(tiny_llama_path):
    return load_model(tiny_llama_path)[1]


def _chat(n):
    msgs = [{"role": "system", "content": "You are terse."}]
    for i in range(n):
        msgs.append({"role": "user", "content": f"Question {i}: what is {i} plus {i}?"})
        msgs.append({"role": "assistant", "content": f"It is {2 * i}."})
    return msgs


def _prefix_starts(tok, msgs, tokens):
    """The old per-message method: render messages[:i] and take the common prefix."""
    starts = [0]
    for i in range(1, len(msgs)):
        prefix = tok.apply_chat_template(msgs[:i], add_generation_prompt=False, tokenize=True)
        n = 0
        for a, b in zip(prefix, tokens, strict=False):
            if a != b:
                break
            n += 1
        starts.append(n)
    return starts


def test_one_pass_equals_the_tokenizers_own_rendering(tok):
    t = ChatTemplate(tok)
    msgs = _chat(30)
    tokens, starts = t.render_with_offsets(msgs)
    assert tokens == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    assert tokens == t.render(msgs)
    assert len(starts) == len(msgs) and starts[0] == 0
    old = _prefix_starts(tok, msgs, tokens)
    # a start lies between the previous message's content and its own content: the old
    # method put the boundary after the closing marker, this one right after the content
    spans = content_spans(tok.decode(tokens), msgs)
    for i in range(1, len(msgs)):
        assert starts[i - 1] < starts[i] <= old[i]
        assert old[i] - starts[i] <= 2  # "<|im_end|>" "\n"
        assert spans[i] is not None
    # the first token of message i's content lies at or after its start
    text_tokens = [tok.decode(tokens[s:]) for s in starts]
    for i, m in enumerate(msgs):
        assert m["content"] in text_tokens[i]


def test_continue_final_message_and_template_kwargs(tok):
    t = ChatTemplate(tok)
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am"}]
    open_ = t.render(msgs, continue_final_message=True)
    assert tok.decode(open_).endswith("Hi, I am")
    closed = t.render(msgs, add_generation_prompt=False)
    assert tok.decode(closed).endswith("<|im_end|>\n")
    with_kwargs, starts = t.render_with_offsets(msgs, continue_final_message=True,
                                                template_kwargs={"enable_thinking": False})
    assert with_kwargs == open_ and len(starts) == 2


def test_tools_and_part_lists(tok):
    t = ChatTemplate(tok)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": "Let me check."},
            {"role": "user", "content": "Thanks"}]
    tokens, starts = t.render_with_offsets(msgs, tools=tools)
    assert tokens == list(tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
                                                  tokenize=True))
    assert 0 == starts[0] < starts[1] < starts[2] < len(tokens)
    assert "Let me check." in tok.decode(tokens[starts[1]:starts[2]])


def test_bad_messages(tok):
    t = ChatTemplate(tok)
    with pytest.raises(RequestError, match="non-empty list"):
        t.render([])
    with pytest.raises(RequestError, match="string 'role'"):
        t.render_with_offsets([{"content": "x"}])


def test_renders_from_many_threads_agree(tok):
    t = ChatTemplate(tok)
    chats = [_chat(5 + i) for i in range(8)]
    expected = [t.render_with_offsets(c) for c in chats]
    got: dict[int, object] = {}
    errors: list[BaseException] = []

    def work(k):
        try:
            for _ in range(5):
                got[k] = t.render_with_offsets(chats[k % 8])
        except BaseException as e:  # pragma: no cover - what the test looks for
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert all(got[k] == expected[k % 8] for k in range(16))


class CountingTokenizer:
    """The real tokenizer, recording how many characters each ``encode`` was given."""

    def __init__(self, tok):
        self.tok = tok
        self.encoded: list[int] = []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, **kw):
        self.encoded.append(len(text))
        return self.tok.encode(text, **kw)


def test_a_prompt_far_past_the_context_is_refused_after_a_bounded_tokenization(tok):
    from promptcache.errors import ContextLengthError

    counting = CountingTokenizer(tok)
    t = ChatTemplate(counting, token_limit=256)
    longest = t._longest_token_chars()
    huge = "word " * 2_000_000  # 10 MB of text
    with pytest.raises(ContextLengthError, match="context length \\(256\\)"):
        t.render([{"role": "user", "content": huge}])
    with pytest.raises(ContextLengthError):
        t.render_with_offsets([{"role": "user", "content": huge}])
    with pytest.raises(ContextLengthError):
        t.encode(huge)
    # each call tokenized (limit + 1) * longest characters, never the 10 MB
    assert counting.encoded == [257 * longest] * 3
    # a prompt that fits is tokenized whole and exactly as without a limit
    msgs = _chat(3)
    assert t.render(msgs) == ChatTemplate(tok).render(msgs)
    assert t.encode("hello world") == list(tok.encode("hello world"))

